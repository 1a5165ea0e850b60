"""The errors a user meets, in one module that imports nothing else of the package.

    ConfigError               a Config field (named) holds a value or combination we cannot run
    RoutedExpertsInputError   an argument of routed_experts (named) is invalid; nothing written
    ARG_NAMES                 routed_experts' arguments in order: a peer's rejected argument is
                              named by its index in collective checks
"""

from __future__ import annotations

__all__ = ["ConfigError", "RoutedExpertsInputError", "ARG_NAMES"]

# Argument order used to name a peer's rejected argument in collective checks.
ARG_NAMES = ("x", "expert_ids", "scores", "w13", "w2", "ctx", "wgrad_into", "is_first_microbatch")


class ConfigError(ValueError):
    """A Config field (named in the message) holds a value or combination we cannot run."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"Config.{field}: {message}")


class RoutedExpertsInputError(ValueError):
    """An argument of routed_experts (named in the message) is invalid. Nothing was written.
    The public functions that prepare routed_experts' arguments (prepare_expert_weights) raise
    it too, under their own name (`function`)."""

    def __init__(self, arg: str, message: str, function: str = "routed_experts"):
        self.arg = arg
        super().__init__(f"{function}({arg}): {message}")

"""Config: the one frozen description of a Dist-MoE layer shape and its execution policy.

Both backends, the memory plan and the planner read only this object. It is validated on
construction; every error names the offending field so that a user can fix a YAML preset or a
launch flag without reading the source.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

__all__ = [
    "Config",
    "ConfigError",
    "PRECISIONS",
    "PIPELINES",
    "ACTIVATIONS",
    "BACKENDS",
    "WGRAD_DTYPES",
    "load_config",
    "feature_multiple",
]

PRECISIONS = ("bf16", "mxfp8", "fp8_block", "nvfp4")
PIPELINES = ("standard", "staged", "mega")
ACTIVATIONS = ("swiglu", "swiglu_clamped")
BACKENDS = ("auto", "reference", "cuda")
WGRAD_DTYPES = ("bf16", "fp32")


def feature_multiple(precision: str) -> int:
    """Multiple that D and F must be for the kernels of `precision`.

    BF16 kernels tile the contraction in steps of 64 elements; the block-scaled formats carry one
    scale per 128 (fp8_block, and MXFP8 requantized to 1x128 on Hopper) or per 32/16 values but
    their Hopper GEMMs promote every 128 elements of K, so D and F must be multiples of 128.
    """
    return 64 if precision == "bf16" else 128


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ConfigError(name, f"must be > 0, got {value}")


def _finite_number(name: str, value: Any, optional: bool = False) -> None:
    """A float field: an int or float (not a bool, not a string read from YAML), finite."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, f"must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ConfigError(name, f"must be finite, got {value}")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclass(frozen=True)
class Config:
    """Shape and policy of one family of routed-expert layers.

    Shape (per rank):
        num_local_input_tokens  T, the maximum physical token rows a rank passes per call.
        hidden_dim              D, token width.
        intermediate_dim        F, expert intermediate width (W13 produces 2F: gate and up).
        top_k                   K, routes per token.
        num_experts             E, global experts; E = E_local x EP must hold at context creation.

    Policy:
        precision     "bf16" | "fp8_block" (E4M3 operands with fp32 scales per 1 x 128
                      activation / gradient block and per 128 x 128 weight tile: DeepSeek-V3's
                      recipe, TransformerEngine's Float8BlockScaling; quant/fp8_block.py; bf16
                      inputs and weights, D and F multiples of 128) | "mxfp8" (E4M3 with one
                      E8M0 scale per 32 values, weights per 32 x 32 tile: OCP MX as
                      TransformerEngine's MXFP8BlockScaling computes it; quant/mxfp8.py) |
                      "nvfp4" (inference only, on prepared weights: E2M1 values, E4M3 scales per
                      16, fp32 global scales; quant/nvfp4.py, prepared.py). execution.RUNS lists
                      which backend runs which precision.
        fp8_power_2_scales  fp8_block: scales rounded down to powers of two (TE's default).
        fp8_amax_epsilon    fp8_block: floor of a block's amax before its scale (TE's default 0).
        pipeline      "standard" | "staged" | "mega" (the CUDA kernel sequence: separate
                      launches / W13 and W2 DGRAD gathering their own rows / the forward in one
                      persistent launch; the reference backend runs one algorithm for all).
                      execution.RUNS lists which precision runs with which pipeline.
        inference     True: no backward state is kept; no activation slots are needed.
        num_activation_slots                 saved-state slots (>= 1 when training).
        max_moe_layers_per_activation_slot   layers that may stack in one slot.
        activation_slot_capacity_factor      slot bytes = minimum + factor x (balanced - minimum).
        activation_slot_bytes                explicit slot bytes (exclusive with the factor).
        device_scratch_capacity_factor       device scratch rows = factor x T x K (capped by
                                             the routing topology T x EP x min(K, E_local)).
        host_scratch_capacity_factor         optional total (device + pinned host, VMM) factor.
        wgrad_dtype   "bf16" | "fp32": stored dtype of the expert weight gradients, which the
                      op returns in the weights' dtype: it matters for fp32 weights (reference
                      backend). On bf16 weights both give the same bits (fp32 sums rounded once)
                      and the CUDA backend stores bf16 directly.
        save_route_outputs  False (default): the expert side computes each route's score
                      gradient from its W2 DGRAD row, grad_s = <W2^T grad_y, h2>, so the full
                      state is x_g and h1 only (a third smaller at the guide shape) and a
                      replay skips the W2 GEMM; measured 0.15 ms faster per guide-load fwd+bwd
                      on 2xH200. True: a full-save layer keeps its route outputs h3 [T, K, D]
                      for the score gradients (the design guide's layout).
        activation    "swiglu" | "swiglu_clamped" (GPT-OSS form, uses swiglu_alpha and
                      swiglu_limit: g = min(g, limit), u = clamp(u, -limit, limit),
                      h2 = g * sigmoid(alpha * g) * (u + 1)).
        backend       "auto" (cuda when a capable GPU is present, else reference) |
                      "reference" | "cuda".
        wait_timeout_s  how long a device-side wait of ours (a peer at a device barrier, a
                      claimed row copy) may last before it traps naming what it waited for;
                      the default matches torch.distributed's collective timeout.
    """

    num_local_input_tokens: int
    hidden_dim: int
    intermediate_dim: int
    top_k: int
    num_experts: int
    precision: str = "bf16"
    pipeline: str = "standard"
    inference: bool = False
    num_activation_slots: int = 1
    max_moe_layers_per_activation_slot: int = 1
    activation_slot_capacity_factor: float | None = None
    activation_slot_bytes: int | None = None
    device_scratch_capacity_factor: float = 2.0
    host_scratch_capacity_factor: float | None = None
    wgrad_dtype: str = "fp32"
    save_route_outputs: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    backend: str = "auto"
    wait_timeout_s: float = 600.0
    fp8_power_2_scales: bool = True
    fp8_amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_local_input_tokens", "hidden_dim", "intermediate_dim", "top_k",
                     "num_experts", "max_moe_layers_per_activation_slot"):
            _positive_int(name, getattr(self, name))
        _choice("precision", self.precision, PRECISIONS)
        _choice("pipeline", self.pipeline, PIPELINES)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("backend", self.backend, BACKENDS)
        _choice("wgrad_dtype", self.wgrad_dtype, WGRAD_DTYPES)
        for name in ("device_scratch_capacity_factor", "swiglu_alpha", "swiglu_limit"):
            _finite_number(name, getattr(self, name))
        for name in ("activation_slot_capacity_factor", "host_scratch_capacity_factor"):
            _finite_number(name, getattr(self, name), optional=True)
        if not isinstance(self.inference, bool):
            raise ConfigError("inference", f"must be a bool, got {self.inference!r}")
        if not isinstance(self.save_route_outputs, bool):
            raise ConfigError("save_route_outputs",
                              f"must be a bool, got {self.save_route_outputs!r}")
        if self.top_k > self.num_experts:
            raise ConfigError("top_k", f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        mult = feature_multiple(self.precision)
        for name in ("hidden_dim", "intermediate_dim"):
            v = getattr(self, name)
            if v % mult:
                raise ConfigError(name, f"{name}={v} must be a multiple of {mult} for "
                                  f"precision={self.precision!r}")
        if self.precision == "nvfp4" and not self.inference:
            raise ConfigError("precision", "nvfp4 supports inference only: set inference=True "
                              "or choose precision='bf16', 'fp8_block' or 'mxfp8' for training")
        if isinstance(self.num_activation_slots, bool) or not isinstance(self.num_activation_slots, int):
            raise ConfigError("num_activation_slots", f"must be an int, got {self.num_activation_slots!r}")
        if self.num_activation_slots < 0:
            raise ConfigError("num_activation_slots", f"must be >= 0, got {self.num_activation_slots}")
        if not self.inference and self.num_activation_slots == 0:
            raise ConfigError("num_activation_slots", "training (inference=False) needs at least "
                              "one activation slot to keep saved state until backward")
        if self.activation_slot_capacity_factor is not None and self.activation_slot_bytes is not None:
            raise ConfigError("activation_slot_bytes", "set either activation_slot_bytes or "
                              "activation_slot_capacity_factor, not both")
        if self.activation_slot_capacity_factor is not None and not self.activation_slot_capacity_factor >= 0:
            raise ConfigError("activation_slot_capacity_factor",
                              f"must be >= 0, got {self.activation_slot_capacity_factor}")
        if self.activation_slot_bytes is not None:
            if isinstance(self.activation_slot_bytes, bool) or not isinstance(self.activation_slot_bytes, int):
                raise ConfigError("activation_slot_bytes", f"must be an int, got {self.activation_slot_bytes!r}")
            if self.activation_slot_bytes < 0:
                raise ConfigError("activation_slot_bytes", f"must be >= 0, got {self.activation_slot_bytes}")
        if not self.device_scratch_capacity_factor > 0:
            raise ConfigError("device_scratch_capacity_factor",
                              f"must be > 0, got {self.device_scratch_capacity_factor}")
        if self.host_scratch_capacity_factor is not None and not (
                self.host_scratch_capacity_factor >= self.device_scratch_capacity_factor):
            raise ConfigError("host_scratch_capacity_factor",
                              f"total scratch factor {self.host_scratch_capacity_factor} must be >= "
                              f"device_scratch_capacity_factor={self.device_scratch_capacity_factor}")
        if self.activation == "swiglu_clamped" and not (self.swiglu_limit > 0):
            raise ConfigError("swiglu_limit", f"must be > 0, got {self.swiglu_limit}")
        if isinstance(self.wait_timeout_s, bool) or not isinstance(self.wait_timeout_s, (int, float)) \
                or not self.wait_timeout_s > 0:
            raise ConfigError("wait_timeout_s", f"must be a number > 0, got {self.wait_timeout_s!r}")
        if not isinstance(self.fp8_power_2_scales, bool):
            raise ConfigError("fp8_power_2_scales",
                              f"must be a bool, got {self.fp8_power_2_scales!r}")
        if isinstance(self.fp8_amax_epsilon, bool) or not isinstance(
                self.fp8_amax_epsilon, (int, float)) or not self.fp8_amax_epsilon >= 0:
            raise ConfigError("fp8_amax_epsilon",
                              f"must be a number >= 0, got {self.fp8_amax_epsilon!r}")
        self._check_runs()
        if self.num_local_input_tokens * self.top_k >= 2**31:
            raise ConfigError("num_local_input_tokens", "T x K must stay below 2**31 route slots")

    def _check_runs(self) -> None:
        """Refuse a precision / pipeline that no backend (or not the chosen one) runs."""
        from .execution import RUNS, runs, runs_precision, what_runs

        backends = list(RUNS) if self.backend == "auto" else [self.backend]
        if any(runs(b, self.precision, self.pipeline) for b in backends):
            return
        where = "no backend runs" if self.backend == "auto" else f"the {self.backend} backend " \
            "does not run"
        field = "precision" if not any(runs_precision(self.precision, b)
                                       for b in backends) else "pipeline"
        raise ConfigError(field, f"{where} precision={self.precision!r} with pipeline="
                          f"{self.pipeline!r} yet; what runs: {what_runs()}")

    # -- derived shape helpers -------------------------------------------------------------
    def num_local_experts(self, ep_size: int) -> int:
        """E_local for an EP group of `ep_size` ranks; raises if E is not divisible."""
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size <= 0:
            raise ValueError(f"ep_size must be a positive int, got {ep_size!r}")
        if self.num_experts % ep_size:
            raise ConfigError("num_experts", f"num_experts={self.num_experts} is not divisible by "
                              f"the expert-parallel size {ep_size}")
        return self.num_experts // ep_size

    def replace(self, **changes: Any) -> "Config":
        """A validated copy with `changes` applied."""
        _check_known(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Config":
        _check_known(data)
        return cls(**dict(data))


def _check_known(names) -> None:
    """ConfigError naming the first field name that Config does not have (with the closest
    known names), instead of the TypeError of the dataclass constructor."""
    import difflib

    known = sorted(f.name for f in dataclasses.fields(Config))
    unknown = sorted(set(names) - set(known))
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), known, n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ConfigError(unknown[0], f"unknown field(s) {unknown}{hint}; known fields: {known}")


def load_config(path: str | Path, **overrides: Any) -> Config:
    """Read a YAML preset from configs/ (top-level mapping, or under a `dist_moe:` key)."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping of Config fields")
    if "dist_moe" in data and isinstance(data["dist_moe"], dict):
        data = data["dist_moe"]
    data = {k: v for k, v in data.items() if k != "name" and k != "description"}
    data.update(overrides)
    return Config.from_dict(data)

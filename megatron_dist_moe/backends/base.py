"""The interface every backend implements; ops.py and Context only talk to this."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Backend(Protocol):
    name: str
    supported_dtypes: tuple[torch.dtype, ...]

    def check_collective(self, x_TD: torch.Tensor, local_error: Exception | None = None,
                         training: bool | None = None) -> None:
        """Cross-rank input agreement (equal T; whether any rank's validation failed, given as
        `local_error` on that rank; whether the call trains and, if so, the selected activation
        slot and its planned layer count, which every rank's planner must share). Raise a
        ValueError naming the argument on every rank alike; return normally on the failing rank
        (the caller raises its own error)."""

    def forward(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, scores_TK: torch.Tensor,
                w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor, training: bool,
                weight_cache: bool | None = None) -> tuple[torch.Tensor, Any]:
        """y_TD and an opaque `saved` object for backward (None when not training).

        weight_cache: routed_experts' is_first_microbatch (weight_cache.py): the quantized
        weights come from the context's WeightCache (refreshed first when True) instead of
        this call's own quantization; the backward uses the same weights.

        w13 arrives as [E_local, 2F, D]. When `training`, the backend runs planner.plan_forward
        for this layer (using the context's selected slot) and keeps the LayerRecord in `saved`.
        When not training it uses scratch only and leaves the planner state untouched.
        """

    def backward(self, grad_y_TD: torch.Tensor, saved: Any
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(grad_x [T,D], grad_scores [T,K] fp32, grad_w13 [E_local,2F,D], grad_w2 [E_local,D,F]).

        Runs planner.plan_backward first (rewinds the slot), replays the forward when the
        record says need_recompute. Weight gradients are in Config.wgrad_dtype. When
        `saved.wgrad_into` is set (routed_experts(wgrad_into=...)), the fp32 weight gradients
        are added into those tensors instead and grad_w13 and grad_w2 are None.
        """

    def reset(self) -> None: ...

    def close(self) -> None: ...

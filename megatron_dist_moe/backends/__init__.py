"""Backends serving routed_experts: `reference` (pure torch + torch.distributed) and `cuda`.

`make_backend(ctx, execution)` builds the one the context's Execution names; both implement
`base.Backend`.
"""

from __future__ import annotations

__all__ = ["make_backend"]


def make_backend(ctx, execution):
    if execution.backend == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend(ctx)
    from .cuda import CudaBackend

    return CudaBackend(ctx, execution)

"""Routing math of one call, written once: owners, row counts, the expert-major row order.

Input: every rank's expert IDs of the call, flattened route-major: ids_N [EP * T * K] (route
(r, t, k) at position n = (r * T + t) * K + k), -1 for an inactive route. A route belongs to the
rank owning its expert (global expert g lives on rank g // E_local). A rank's experts receive
their routes in expert-major order: local expert, then source rank, token, route, i.e. sorted by
(local expert, n).

Pure tensor functions with no host read, so the same code serves the reference backend (CPU or
GPU tensors), the CUDA backend's torch routing tables (backends/cuda/routing.py, which adds the
peer addresses) and the planner's row counts; kernels/routing.py is their Triton twin (held
bit-equal by tests/cpu/test_kernels_routing_interp.py through the torch tables).
"""

from __future__ import annotations

import torch

__all__ = ["owner_ranks", "rows_per_rank", "expert_major_order"]


def owner_ranks(ids_N: torch.Tensor, E_local: int, num_experts: int) -> torch.Tensor:
    """int64 [N]: the rank owning each route's expert, -1 for an inactive (or out-of-range)
    route."""
    ids = ids_N.to(torch.int64)
    active = (ids >= 0) & (ids < num_experts)
    return torch.where(active, ids // E_local, -1)


def rows_per_rank(ids_N: torch.Tensor, E_local: int, EP: int, num_experts: int) -> torch.Tensor:
    """int64 [EP]: routed rows each rank's experts receive (the planner's rows_EP)."""
    owner = owner_ranks(ids_N, E_local, num_experts)
    counts = torch.zeros(EP + 1, dtype=torch.int64, device=ids_N.device)
    counts.scatter_add_(0, torch.where(owner >= 0, owner, EP), torch.ones_like(owner))
    return counts[:EP]


def expert_major_order(ids_N: torch.Tensor, rank: int, E_local: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [N] int64, expert_offsets [E_local + 1] int32) for `rank`'s experts.

    order[i] for i < R = expert_offsets[-1] is the route position n of expert-major row i (sorted
    by local expert, then n); the positions of routes that are not this rank's follow, in order.
    expert_offsets are the cumulative row ends per local expert (offsets[0] = 0)."""
    dev = ids_N.device
    N = ids_N.numel()
    local = ids_N.to(torch.int64) - rank * E_local
    mine = (local >= 0) & (local < E_local)
    pos = torch.arange(N, device=dev, dtype=torch.int64)
    key = torch.where(mine, local * N + pos, E_local * N + pos)
    order = torch.sort(key).indices
    counts = torch.zeros(E_local + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, torch.where(mine, local, E_local), torch.ones_like(local))
    offsets = torch.zeros(E_local + 1, dtype=torch.int32, device=dev)
    offsets[1:] = torch.cumsum(counts[:E_local], 0).to(torch.int32)
    return order, offsets

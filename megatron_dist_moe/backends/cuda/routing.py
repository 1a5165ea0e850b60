"""Peer row-address tables of a call (the routing math itself: megatron_dist_moe/routing.py).

Input: every rank's published expert IDs (read from the peers' routing headers) as
ids_all [EP, T, K]. Output (`RoutingTables`): for the R rows this rank's experts receive, in
expert-major order (expert, then source rank, token, route), the peer addresses each kernel
reads from or writes to. All sizes are host bounds (R_max = the plan's scratch rows); the actual
R stays on the device. No host synchronisation: only sort / scatter / gather / where.

    fwd_gather_ptrs[i]  = dispatch_base[r] + t * D * 2            x row the expert reads
    combine_ptrs[i]     = combine_base[r] + (t*K + k) * D * 2     where W2 returns the route
                                                                  (and where grad_h3 is read)
    dispatch_route_ptrs[i] = dispatch_base[r] + (t*K + k) * D * 2 where W13 DGRAD returns the
                                                                  route input gradient
Rows i >= R hold address 0 (gathers read zeros, scatters skip). With fan-out gathers
the tables also carry, for every route (r, t, k) of every rank, the row
it lands in here or -1 (`FanoutTable`): `rows.fanout_rows` then reads each token row once over
NVLink and writes it into all of its rows, where `gather_rows` reads it once per route.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels import checks as K_checks
from ...routing import expert_major_order, rows_per_rank

__all__ = ["FanoutTable", "RoutingTables", "build_routing_tables", "routing_tables_ref_order"]


@dataclass
class FanoutTable:
    dest_rows: torch.Tensor           # [EP * T * K] int32: row of route (r, t, k) here, or -1
    T: int
    K: int
    dispatch_base_EP: torch.Tensor    # [EP] int64: where x rows live (token t at t * D * 2)
    combine_base_EP: torch.Tensor     # [EP] int64: where grad_y rows live (published per token)


@dataclass
class RoutingTables:
    expert_offsets: torch.Tensor      # [E_local + 1] int32 cumulative row ends
    num_rows: torch.Tensor            # [1] int32, R (device)
    rows_EP: torch.Tensor             # [EP] int64 rows received by every rank (planner input)
    fwd_gather_ptrs: torch.Tensor     # [R_max] int64
    combine_ptrs: torch.Tensor        # [R_max] int64
    dispatch_route_ptrs: torch.Tensor  # [R_max] int64
    max_rows: int
    fanout: FanoutTable | None = None


def build_routing_tables(ids_all_EPTK: torch.Tensor, T_all_EP: torch.Tensor, T: int, rank: int,
                         num_local_experts: int, num_experts: int, max_rows: int,
                         dispatch_base_EP: torch.Tensor, combine_base_EP: torch.Tensor,
                         row_bytes: int, own_scores_TK: torch.Tensor | None = None,
                         device_checks: bool = True, fanout: bool = False,
                         sched_all_EP: torch.Tensor | None = None) -> RoutingTables:
    """Build the expert-major tables for this rank (see module docstring).

    device_checks: trap (message + numbers) on unequal T across ranks, on schedule words
    (`sched_all_EP`, every rank's, when given) that differ from this rank's, on more received
    rows than `max_rows`, and — for this rank's own routes — on out-of-range IDs and nonzero
    scores on inactive routes (host checks are skipped inside graph capture).
    """
    dev = ids_all_EPTK.device
    EP, _, K = ids_all_EPTK.shape
    E_local = num_local_experts
    N = EP * T * K
    flat = ids_all_EPTK[:, :T].reshape(-1).to(torch.int64)
    order, offsets = expert_major_order(flat, rank, E_local)
    num_rows = offsets[E_local:].clone()
    rows_EP = rows_per_rank(flat, E_local, EP, num_experts)

    if max_rows <= N:
        sel = order[:max_rows]
    else:
        sel = torch.cat([order, torch.zeros(max_rows - N, dtype=torch.int64, device=dev)])
    i = torch.arange(max_rows, device=dev, dtype=torch.int64)
    live = i < num_rows.to(torch.int64)
    TK = max(T * K, 1)   # T = 0: no live row; keep the (unused) arithmetic defined
    src_rank = sel // TK
    tk = sel - src_rank * TK
    t = tk // K
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    fwd = torch.where(live, dispatch_base_EP[src_rank] + t * row_bytes, zero)
    comb = torch.where(live, combine_base_EP[src_rank] + tk * row_bytes, zero)
    disp = torch.where(live, dispatch_base_EP[src_rank] + tk * row_bytes, zero)

    if device_checks:
        # NOTE: no tensor-valued Python indexing here (it would .item() and break capture).
        def pick(v: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            return v.reshape(-1).to(torch.int64).index_select(0, i.view(1)).view(())

        checks = []   # (code, a, b) as 0-d tensors
        T_all = T_all_EP.to(torch.int64)
        bad_T = T_all != T
        first_bad = torch.argmax(bad_T.to(torch.int32))
        T_bad = pick(T_all, first_bad)
        # T = -1: that peer's own validation failed (CudaBackend.check_collective)
        code_T = torch.where(T_bad == -1, K_checks.CHECK_PEER_REJECTED, K_checks.CHECK_UNEQUAL_T)
        checks.append((bad_T.any(), code_T, first_bad, T_bad))
        if sched_all_EP is not None:
            S_all = sched_all_EP.to(torch.int64)
            bad_S = S_all != pick(S_all, torch.tensor(rank, device=dev))
            first_S = torch.argmax(bad_S.to(torch.int32))
            checks.append((bad_S.any(), K_checks.CHECK_SCHEDULE_MISMATCH, first_S,
                           pick(S_all, first_S)))
        R = num_rows.to(torch.int64).view(())
        checks.append((R > max_rows, K_checks.CHECK_SCRATCH_OVERFLOW, R,
                       torch.full_like(R, max_rows)))
        own = ids_all_EPTK[rank, :T].reshape(-1).to(torch.int64)
        if own.numel():
            bad_id = (own < -1) | (own >= num_experts)
            j = torch.argmax(bad_id.to(torch.int32))
            checks.append((bad_id.any(), K_checks.CHECK_BAD_EXPERT_ID, j, pick(own, j)))
            if own_scores_TK is not None:
                sc = own_scores_TK.reshape(-1).to(torch.float32)
                bad_s = (own == -1) & (sc != 0)
                j2 = torch.argmax(bad_s.to(torch.int32))
                checks.append((bad_s.any(), K_checks.CHECK_INACTIVE_SCORE, j2,
                               pick(sc.view(torch.int32), j2)))
        codes = torch.stack([torch.where(c, code, 0) for c, code, _, _ in checks])
        a = torch.stack([x for _, _, x, _ in checks])
        b = torch.stack([y for _, _, _, y in checks])
        K_checks.device_check(codes, a, b)

    fan = None
    if fanout:
        # route (r, t, k) at flat position sel[i] lands in row i; the rest stay -1 (slot N
        # takes the writes of the rows past R)
        dest = torch.full((N + 1,), -1, dtype=torch.int32, device=dev)
        dest.scatter_(0, torch.where(live, sel, N), i.to(torch.int32))
        fan = FanoutTable(dest_rows=dest[:N], T=T, K=K, dispatch_base_EP=dispatch_base_EP,
                          combine_base_EP=combine_base_EP)
    return RoutingTables(expert_offsets=offsets, num_rows=num_rows, rows_EP=rows_EP,
                         fwd_gather_ptrs=fwd, combine_ptrs=comb, dispatch_route_ptrs=disp,
                         max_rows=max_rows, fanout=fan)


def routing_tables_ref_order(ids_all_EPTK: torch.Tensor, rank: int, E_local: int):
    """Plain-python twin of the row order: list of (expert, src_rank, t, k) for this rank."""
    EP, T, K = ids_all_EPTK.shape
    rows = []
    ids = ids_all_EPTK.tolist()
    for e in range(E_local):
        g = rank * E_local + e
        for r in range(EP):
            for t in range(T):
                for k in range(K):
                    if ids[r][t][k] == g:
                        rows.append((e, r, t, k))
    return rows

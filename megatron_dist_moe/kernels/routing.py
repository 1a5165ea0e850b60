"""Routing tables in one or two Triton launches, read straight from every rank's routing header.

Same result as the torch version (`backends/cuda/routing.py: build_routing_tables`, the oracle
these kernels are tested against) without its ~40 small launches: expert-major rows (expert,
then source rank, token, route) of the routes this rank's experts receive, and for each row the
peer addresses the expert kernels read from and write to.

    one    grid (G,), where all ranks' routes fit one tile (EP_PAD * next_pow2(T*K) <= ONE_MAX,
           decode, and its one-hot tiles within ONE_HOT_MAX elements): every program loads
           every rank's IDs as one flat tile (a single load round trip), counts and checks
           them; program 0 writes the status word, the counts and the rows, and all G programs
           share the zero tail. Half the launches of count + place, and no tile wider than the
           call's routes.

Otherwise two launches:

    count  grid (EP, C): program (r, c) reads chunk c (CHUNK flat routes t*K + k) of rank r's
           int16 IDs from rank r's header and counts its routes per local expert and per
           owner rank; on this rank's own chunks it also finds the first out-of-range ID and the
           first nonzero score on an inactive route.
    place  grid (EP, C): every program reads all counts (small), so it knows the expert
           offsets, R, and how many rows of each expert earlier chunks hold; it checks equal T
           and equal schedule words across ranks and R <= max_rows, then writes its chunk's rows in order (an in-block
           scan per expert) and a share of the zero tail [R, max_rows). With fanout it also
           writes, for every route (r, t, k), the row it lands in here or -1
           (`rows.fanout_rows` reads each token once and writes all its rows). Program (0, 0) writes
           expert_offsets, num_rows, rows_EP and the status word, and traps (TRAP) on a failed
           check after printing the cause and the numbers.

The status word [3] int64 = (code, a, b) uses the codes, numbers and messages of
`checks.trap_on_code` (0 = all good; a peer whose header says T = -1 rejected its own inputs:
CHECK_PEER_REJECTED; a peer whose schedule word, header[1] (rows.schedule_args), differs from this
rank's: CHECK_SCHEDULE_MISMATCH). On a failed T, schedule or overflow check no table row is
written and the published row counts and offsets are zero (what a context that did not trap would
then read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import checks as _checks
from .checks import trap_on_code

__all__ = ["RouteWorkspace", "route_tables", "ONE_MAX"]

_NONE = tl.constexpr(2 ** 63 - 1)   # "no failure" in a per-chunk first-failure slot
_UNEQUAL_T = tl.constexpr(_checks.CHECK_UNEQUAL_T)
_OVERFLOW = tl.constexpr(_checks.CHECK_SCRATCH_OVERFLOW)
_BAD_ID = tl.constexpr(_checks.CHECK_BAD_EXPERT_ID)
_BAD_SCORE = tl.constexpr(_checks.CHECK_INACTIVE_SCORE)
_PEER_REJECTED = tl.constexpr(_checks.CHECK_PEER_REJECTED)
_SCHEDULE = tl.constexpr(_checks.CHECK_SCHEDULE_MISMATCH)
# flat routes per program of the two launches (count, place): the smallest power of two from
# CHUNK_MIN whose per-chunk count table ([EP * chunks, E_PAD], every place program reads it
# whole) stays within CHUNK_TABLE_MAX elements. Fewer routes per program: more programs, each
# with a shorter serial loop (at the guide load 12,288 routes: 12 programs, not 3)
CHUNK_MIN = 1024
CHUNK_TABLE_MAX = 16384
ONE_MAX = 2048                      # flat route slots (EP_PAD * N_PAD) of the one-launch tile
# ... and elements of its one-hot tiles ([slots, E_PAD] over experts, [slots, EP_PAD] over
# owners): the largest the GPU tests ran ([1024, 32]); many local experts take the two launches,
# whose one-hots stay at 8192 elements per block (2048 x 1024 does not compile)
ONE_HOT_MAX = 32768
TAIL_ROWS = 4096                    # zero-tail rows per program of the one-launch kernel


@triton.jit
def _peer_ptr(base_ptr, r, offset_bytes, DT: tl.constexpr):
    """Typed pointer into rank r's routing region; the region and both offsets used (0 and the
    128-byte header) are 16-byte aligned, which the hint tells the compiler (vector loads)."""
    return tl.multiple_of((tl.load(base_ptr + r) + offset_bytes).to(tl.pointer_type(DT)), 16)


@triton.jit
def _route_count_kernel(base_ptr, scores_ptr, counts_ptr, owners_ptr, bad_ptr,
                        T, K, rank, E_local, num_experts, n_chunks,
                        HEADER_BYTES: tl.constexpr, HAS_SCORES: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, E_PAD: tl.constexpr,
                        EP_PAD: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    n = T * K
    ids_base = _peer_ptr(base_ptr, r, HEADER_BYTES, tl.int16)
    e_idx = tl.arange(0, E_PAD)
    p_idx = tl.arange(0, EP_PAD)
    cnt = tl.zeros((E_PAD,), dtype=tl.int32)
    own = tl.zeros((EP_PAD,), dtype=tl.int32)
    first_bad_id = tl.full((), _NONE, tl.int64)
    first_bad_score = tl.full((), _NONE, tl.int64)
    lo = rank * E_local
    for j0 in range(c * CHUNK, tl.minimum(n, (c + 1) * CHUNK), BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < tl.minimum(n, (c + 1) * CHUNK)
        g = tl.load(ids_base + j, mask=ok, other=-1).to(tl.int32)
        local = g - lo
        mine = ok & (local >= 0) & (local < E_local)
        cnt += tl.sum(((local[:, None] == e_idx[None, :]) & mine[:, None]).to(tl.int32), 0)
        active = ok & (g >= 0) & (g < num_experts)
        owner = tl.where(active, g // E_local, -1)
        own += tl.sum((owner[:, None] == p_idx[None, :]).to(tl.int32), 0)
        if r == rank:
            bad = ok & ((g < -1) | (g >= num_experts))
            packed = j.to(tl.int64) * 65536 + (g + 32768).to(tl.int64)
            first_bad_id = tl.minimum(first_bad_id, tl.min(tl.where(bad, packed, _NONE), 0))
            if HAS_SCORES:
                s = tl.load(scores_ptr + j, mask=ok, other=0.0).to(tl.float32)
                bits = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
                bad_s = ok & (g == -1) & (s != 0.0)
                packed_s = j.to(tl.int64) * 4294967296 + bits
                first_bad_score = tl.minimum(first_bad_score,
                                             tl.min(tl.where(bad_s, packed_s, _NONE), 0))
    lin = r * n_chunks + c
    tl.store(counts_ptr + lin * E_PAD + e_idx, cnt)
    tl.store(owners_ptr + lin * EP_PAD + p_idx, own)
    tl.store(bad_ptr + lin * 2, first_bad_id)
    tl.store(bad_ptr + lin * 2 + 1, first_bad_score)


@triton.jit
def _peer_headers(base_ptr, T, rank, EP, EP_PAD: tl.constexpr):
    """Every rank's routing header against this rank's: (T_peer, bad_T, S_peer, bad_S) over
    EP_PAD slots: its T (bad where it is not this call's) and its schedule word (bad where it
    is not this rank's: rows.schedule_args)."""
    p_idx = tl.arange(0, EP_PAD)
    live = p_idx < EP
    hdr = _peer_ptr(base_ptr, p_idx % EP, 0, tl.int32)
    T_peer = tl.load(hdr, mask=live, other=0)
    S_peer = tl.load(hdr + 1, mask=live, other=0)
    S_own = tl.sum(tl.where(p_idx == rank, S_peer, 0), 0)
    return T_peer, live & (T_peer != T), S_peer, live & (S_peer != S_own)


@triton.jit
def _verdict(status_ptr, offsets_ptr, num_rows_ptr, rows_ep_ptr, bad_id, bad_s, T_peer, bad_T,
             S_peer, bad_S, overflow, R, max_rows, ends, owners_EP, E_local, EP,
             E_PAD: tl.constexpr, EP_PAD: tl.constexpr, TRAP: tl.constexpr):
    """The status word (the first failure by priority: unequal T / a rejecting peer, another
    schedule, overflow, a bad ID, an inactive score), the expert offsets, R and rows_EP; trap
    on a failure."""
    e_idx = tl.arange(0, E_PAD)
    p_idx = tl.arange(0, EP_PAD)
    any_bad_T = tl.sum(bad_T.to(tl.int32), 0) > 0
    any_bad_S = tl.sum(bad_S.to(tl.int32), 0) > 0
    code = tl.full((), 0, tl.int64)
    a = tl.full((), 0, tl.int64)
    b = tl.full((), 0, tl.int64)
    first_T = tl.min(tl.where(bad_T, p_idx, EP_PAD), 0)
    if bad_s != _NONE:
        code = tl.full((), _BAD_SCORE, tl.int64)
        a = bad_s // 4294967296
        bits = bad_s & 0xFFFFFFFF
        b = tl.where(bits >= 2147483648, bits - 4294967296, bits)
    if bad_id != _NONE:
        code = tl.full((), _BAD_ID, tl.int64)
        a = bad_id // 65536
        b = (bad_id & 0xFFFF) - 32768
    if overflow:
        code = tl.full((), _OVERFLOW, tl.int64)
        a = R.to(tl.int64)
        b = tl.full((), 0, tl.int64) + max_rows
    if any_bad_S:
        first_S = tl.min(tl.where(bad_S, p_idx, EP_PAD), 0)
        code = tl.full((), _SCHEDULE, tl.int64)
        a = first_S.to(tl.int64)
        b = tl.sum(tl.where(p_idx == first_S, S_peer, 0), 0).to(tl.int64)
    if any_bad_T:
        a = first_T.to(tl.int64)
        b = tl.sum(tl.where(p_idx == first_T, T_peer, 0), 0).to(tl.int64)
        # T = -1: that peer's own validation failed (CudaBackend.check_collective)
        code = tl.where(b == -1, tl.full((), _PEER_REJECTED, tl.int64),
                        tl.full((), _UNEQUAL_T, tl.int64))
    tl.store(status_ptr + 0, code)
    tl.store(status_ptr + 1, a)
    tl.store(status_ptr + 2, b)
    # On a failed T, schedule or overflow check no table row is written: publish zero rows, so
    # that nothing downstream reads the unwritten tables even where no trap stops the stream.
    ok = ~(any_bad_T | any_bad_S | overflow)
    tl.store(rows_ep_ptr + p_idx, tl.where(ok, owners_EP.to(tl.int64), 0), mask=p_idx < EP)
    tl.store(offsets_ptr + 1 + e_idx, tl.where(ok, ends, 0), mask=e_idx < E_local)
    tl.store(offsets_ptr + e_idx, tl.zeros((E_PAD,), tl.int32), mask=e_idx == 0)
    tl.store(num_rows_ptr + e_idx, tl.zeros((E_PAD,), tl.int32) + tl.where(ok, R, 0),
             mask=e_idx == 0)
    if TRAP:
        trap_on_code(code, a, b)


@triton.jit
def _place(row, mine, ok, r, j, K, n, d_base, c_base, row_bytes, fwd_ptr, comb_ptr, disp_ptr,
           fan_ptr, FANOUT: tl.constexpr):
    """Rows of routes j (flat t*K + k) of ranks r (d_base, c_base: their dispatch and combine
    bases) that land here (mine) at `row`; with FANOUT every live route's row or -1."""
    t = (j // K).to(tl.int64)
    tk = j.to(tl.int64)
    tl.store(fwd_ptr + row, d_base + t * row_bytes, mask=mine)
    tl.store(comb_ptr + row, c_base + tk * row_bytes, mask=mine)
    tl.store(disp_ptr + row, d_base + tk * row_bytes, mask=mine)
    if FANOUT:   # every route: its row here, or -1
        tl.store(fan_ptr + r.to(tl.int64) * n + tk, tl.where(mine, row, -1), mask=ok)


@triton.jit
def _zero_tail(fwd_ptr, comb_ptr, disp_ptr, start, stop, step, TAIL_BLOCK: tl.constexpr):
    """Rows [start + i*step, ... + TAIL_BLOCK) below stop: address 0 (gathers read zeros,
    scatters skip)."""
    zero = tl.zeros((TAIL_BLOCK,), tl.int64)
    for i0 in range(start, stop, step):
        i = i0 + tl.arange(0, TAIL_BLOCK)
        m = i < stop
        tl.store(fwd_ptr + i, zero, mask=m)
        tl.store(comb_ptr + i, zero, mask=m)
        tl.store(disp_ptr + i, zero, mask=m)


@triton.jit
def _route_place_kernel(base_ptr, dispatch_base_ptr, combine_base_ptr, counts_ptr, owners_ptr,
                        bad_ptr, offsets_ptr, num_rows_ptr, rows_ep_ptr, fwd_ptr, comb_ptr,
                        disp_ptr, fan_ptr, status_ptr,
                        T, K, rank, E_local, EP, max_rows, row_bytes, n_chunks,
                        HEADER_BYTES: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        TAIL_BLOCK: tl.constexpr, E_PAD: tl.constexpr, EP_PAD: tl.constexpr,
                        NC_PAD: tl.constexpr, TRAP: tl.constexpr, FANOUT: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    n = T * K
    lin = r * n_chunks + c
    e_idx = tl.arange(0, E_PAD)
    p_idx = tl.arange(0, EP_PAD)
    q = tl.arange(0, NC_PAD)
    nq = EP * n_chunks
    counts = tl.load(counts_ptr + q[:, None] * E_PAD + e_idx[None, :], mask=(q < nq)[:, None],
                     other=0)
    totals = tl.sum(counts, 0)                                   # rows per local expert
    ends = tl.cumsum(totals, 0)
    R = tl.sum(totals, 0)
    base = ends - totals + tl.sum(tl.where((q < lin)[:, None], counts, 0), 0)

    # checks every program takes the same way (so none writes a table row on failure)
    T_peer, bad_T, S_peer, bad_S = _peer_headers(base_ptr, T, rank, EP, EP_PAD)
    stop = (tl.sum((bad_T | bad_S).to(tl.int32), 0) > 0) | (R > max_rows)
    overflow = R > max_rows
    if (r == 0) & (c == 0):
        own_q = (q >= rank * n_chunks) & (q < (rank + 1) * n_chunks)
        bad_id = tl.min(tl.load(bad_ptr + q * 2, mask=own_q, other=_NONE), 0)
        bad_s = tl.min(tl.load(bad_ptr + q * 2 + 1, mask=own_q, other=_NONE), 0)
        owners = tl.load(owners_ptr + q[:, None] * EP_PAD + p_idx[None, :],
                         mask=(q < nq)[:, None], other=0)
        _verdict(status_ptr, offsets_ptr, num_rows_ptr, rows_ep_ptr, bad_id, bad_s, T_peer,
                 bad_T, S_peer, bad_S, overflow, R, max_rows, ends, tl.sum(owners, 0), E_local,
                 EP, E_PAD, EP_PAD, TRAP)
    if stop:
        return

    ids_base = _peer_ptr(base_ptr, r, HEADER_BYTES, tl.int16)
    d_base = tl.load(dispatch_base_ptr + r)
    c_base = tl.load(combine_base_ptr + r)
    lo = rank * E_local
    end = tl.minimum(n, (c + 1) * CHUNK)
    for j0 in range(c * CHUNK, end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < end
        g = tl.load(ids_base + j, mask=ok, other=-1).to(tl.int32)
        local = g - lo
        mine = ok & (local >= 0) & (local < E_local)
        hot = ((local[:, None] == e_idx[None, :]) & mine[:, None]).to(tl.int32)
        rank_in_block = tl.cumsum(hot, 0) - hot                  # earlier same-expert routes
        row = tl.sum(hot * (base[None, :] + rank_in_block), 1)   # only the expert's column
        base += tl.sum(hot, 0)
        _place(row, mine, ok, r, j, K, n, d_base, c_base, row_bytes, fwd_ptr, comb_ptr,
               disp_ptr, fan_ptr, FANOUT)

    # zero tail: rows [R, max_rows), shared by all programs
    _zero_tail(fwd_ptr, comb_ptr, disp_ptr, R + lin * TAIL_BLOCK, max_rows, nq * TAIL_BLOCK,
               TAIL_BLOCK)


@triton.jit
def _route_one_kernel(base_ptr, scores_ptr, dispatch_base_ptr, combine_base_ptr, offsets_ptr,
                      num_rows_ptr, rows_ep_ptr, fwd_ptr, comb_ptr, disp_ptr, fan_ptr,
                      status_ptr, T, K, rank, E_local, num_experts, EP, max_rows, row_bytes,
                      HEADER_BYTES: tl.constexpr, HAS_SCORES: tl.constexpr,
                      N_PAD: tl.constexpr, E_PAD: tl.constexpr, EP_PAD: tl.constexpr,
                      TAIL_BLOCK: tl.constexpr, TRAP: tl.constexpr, FANOUT: tl.constexpr):
    pid = tl.program_id(0)
    n = T * K
    e_idx = tl.arange(0, E_PAD)
    p_idx = tl.arange(0, EP_PAD)
    f = tl.arange(0, EP_PAD * N_PAD)          # flat (rank r, route j): rank-major, as the rows
    r = f // N_PAD
    j = f % N_PAD
    ok = (r < EP) & (j < n)
    region = tl.load(base_ptr + r, mask=r < EP, other=0)
    g = tl.load((region + HEADER_BYTES).to(tl.pointer_type(tl.int16)) + j, mask=ok,
                other=-1).to(tl.int32)
    local = g - rank * E_local
    mine = ok & (local >= 0) & (local < E_local)
    hot = ((local[:, None] == e_idx[None, :]) & mine[:, None]).to(tl.int32)   # [F, E_PAD]
    totals = tl.sum(hot, 0)                                      # rows per local expert
    ends = tl.cumsum(totals, 0)
    R = tl.sum(totals, 0)

    T_peer, bad_T, S_peer, bad_S = _peer_headers(base_ptr, T, rank, EP, EP_PAD)
    overflow = R > max_rows
    stop = (tl.sum((bad_T | bad_S).to(tl.int32), 0) > 0) | overflow
    if pid == 0:
        active = ok & (g >= 0) & (g < num_experts)
        owner = tl.where(active, g // E_local, -1)
        owners_EP = tl.sum((owner[:, None] == p_idx[None, :]).to(tl.int32), 0)
        own = ok & (r == rank)
        bad = own & ((g < -1) | (g >= num_experts))
        packed = j.to(tl.int64) * 65536 + (g + 32768).to(tl.int64)
        bad_id = tl.min(tl.where(bad, packed, _NONE), 0)
        bad_s = tl.full((), _NONE, tl.int64)
        if HAS_SCORES:
            s = tl.load(scores_ptr + j, mask=own, other=0.0).to(tl.float32)
            bits = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
            bad_sc = own & (g == -1) & (s != 0.0)
            bad_s = tl.min(tl.where(bad_sc, j.to(tl.int64) * 4294967296 + bits, _NONE), 0)
        _verdict(status_ptr, offsets_ptr, num_rows_ptr, rows_ep_ptr, bad_id, bad_s, T_peer,
                 bad_T, S_peer, bad_S, overflow, R, max_rows, ends, owners_EP, E_local, EP,
                 E_PAD, EP_PAD, TRAP)
    if stop:
        return
    if pid == 0:
        rank_in_tile = tl.cumsum(hot, 0) - hot                   # earlier same-expert routes
        row = tl.sum(hot * ((ends - totals)[None, :] + rank_in_tile), 1)
        d_base = tl.load(dispatch_base_ptr + r, mask=r < EP, other=0)
        c_base = tl.load(combine_base_ptr + r, mask=r < EP, other=0)
        _place(row, mine, ok, r, j, K, n, d_base, c_base, row_bytes, fwd_ptr, comb_ptr,
               disp_ptr, fan_ptr, FANOUT)
    _zero_tail(fwd_ptr, comb_ptr, disp_ptr, R + pid * TAIL_BLOCK, max_rows,
               tl.num_programs(0) * TAIL_BLOCK, TAIL_BLOCK)


def _one_launch_width(T: int, K: int) -> int:
    return max(16, triton.next_power_of_2(max(1, T * K)))


class RouteWorkspace:
    """Per-context scratch of the two routing launches (counts per chunk, first failures)."""

    def __init__(self, ep_size: int, max_tokens: int, top_k: int, num_local_experts: int,
                 device):
        self.ep_size, self.E_local = ep_size, num_local_experts
        self.E_PAD = max(2, triton.next_power_of_2(num_local_experts))
        self.EP_PAD = max(2, triton.next_power_of_2(ep_size))
        self.chunk = CHUNK_MIN
        while True:
            self.n_chunks = max(1, triton.cdiv(max_tokens * top_k, self.chunk))
            self.NC_PAD = max(2, triton.next_power_of_2(ep_size * self.n_chunks))
            if self.NC_PAD * max(self.E_PAD, self.EP_PAD) <= CHUNK_TABLE_MAX or self.n_chunks == 1:
                break
            self.chunk *= 2
        nq = ep_size * self.n_chunks
        self.counts = torch.zeros(nq, self.E_PAD, dtype=torch.int32, device=device)
        self.owners = torch.zeros(nq, self.EP_PAD, dtype=torch.int32, device=device)
        self.bad = torch.zeros(nq, 2, dtype=torch.int64, device=device)
        self.status = torch.zeros(3, dtype=torch.int64, device=device)

    def launches(self, T: int, K: int) -> int:
        """1 where every rank's T*K routes fit the one-launch tile and its one-hot tiles stay
        within ONE_HOT_MAX elements, else 2 (count, place)."""
        slots = self.EP_PAD * _one_launch_width(T, K)
        one_hot = slots * max(self.E_PAD, self.EP_PAD)
        return 1 if slots <= ONE_MAX and one_hot <= ONE_HOT_MAX else 2


def route_tables(ws: RouteWorkspace, base_EP: torch.Tensor, T: int, K: int, rank: int,
                 num_experts: int, max_rows: int, dispatch_base_EP: torch.Tensor,
                 combine_base_EP: torch.Tensor, row_bytes: int,
                 own_scores_TK: torch.Tensor | None = None, header_bytes: int = 128,
                 trap: bool = True, fanout: bool = False):
    """Build this rank's routing tables from the peers' routing headers (one launch where all
    ranks' routes fit one tile, else two).

    base_EP   int64 [EP]: every rank's routing-region base (int32 T at byte 0, int16 IDs [T, K]
              at `header_bytes`). Returns (expert_offsets int32 [E_local+1], num_rows int32 [1],
              rows_EP int64 [EP], fwd_gather_ptrs, combine_ptrs, dispatch_route_ptrs (int64
              [max_rows] each), status int64 [3]).
    trap      trap on a failed check (GPU); False leaves the verdict in `status` only (tests,
              the CPU interpreter, which has no trap).
    fanout    also return the fan-out table (int32 [EP * T * K]: route (r, t, k) -> its row
              here, or -1) as an eighth value. Not written on a failed T or overflow check,
              where num_rows is 0 (`rows.fanout_rows` writes rows below num_rows only).
    """
    dev = base_EP.device
    E_local, EP = ws.E_local, ws.ep_size
    for name, t in (("base_EP", base_EP), ("dispatch_base_EP", dispatch_base_EP),
                    ("combine_base_EP", combine_base_EP)):
        assert t.numel() == EP, f"{name}: {t.numel()} entries for EP={EP}"
    assert T * K <= ws.n_chunks * ws.chunk, "more routes than the workspace was sized for"
    offsets = torch.empty(E_local + 1, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    rows_EP = torch.empty(EP, dtype=torch.int64, device=dev)
    fwd = torch.empty(max_rows, dtype=torch.int64, device=dev)
    comb = torch.empty(max_rows, dtype=torch.int64, device=dev)
    disp = torch.empty(max_rows, dtype=torch.int64, device=dev)
    fan = torch.empty(EP * T * K if fanout else 1, dtype=torch.int32, device=dev)
    scores = own_scores_TK.contiguous() if own_scores_TK is not None else ws.status
    n_pad = _one_launch_width(T, K)
    if ws.launches(T, K) == 1:
        _route_one_kernel[(max(1, min(64, triton.cdiv(max_rows, TAIL_ROWS))),)](
            base_EP, scores, dispatch_base_EP, combine_base_EP, offsets, num_rows, rows_EP, fwd,
            comb, disp, fan, ws.status, T, K, rank, E_local, num_experts, EP, max_rows,
            row_bytes, HEADER_BYTES=header_bytes, HAS_SCORES=own_scores_TK is not None,
            N_PAD=n_pad, E_PAD=ws.E_PAD, EP_PAD=ws.EP_PAD, TAIL_BLOCK=1024, TRAP=trap,
            FANOUT=fanout, num_warps=4 if ws.EP_PAD * n_pad <= 512 else 8)
    else:
        # one-hot tiles are [BLOCK, E_PAD] and [BLOCK, EP_PAD]: keep each at <= 8192 elements
        block = max(16, min(1024, 8192 // max(ws.E_PAD, ws.EP_PAD)))
        grid = (EP, ws.n_chunks)
        _route_count_kernel[grid](
            base_EP, scores, ws.counts, ws.owners, ws.bad, T, K, rank, E_local, num_experts,
            ws.n_chunks, HEADER_BYTES=header_bytes, HAS_SCORES=own_scores_TK is not None,
            CHUNK=ws.chunk, BLOCK=block, E_PAD=ws.E_PAD, EP_PAD=ws.EP_PAD, num_warps=4)
        _route_place_kernel[grid](
            base_EP, dispatch_base_EP, combine_base_EP, ws.counts, ws.owners, ws.bad, offsets,
            num_rows, rows_EP, fwd, comb, disp, fan, ws.status, T, K, rank, E_local, EP,
            max_rows, row_bytes, ws.n_chunks, HEADER_BYTES=header_bytes, CHUNK=ws.chunk,
            BLOCK=block, TAIL_BLOCK=1024, E_PAD=ws.E_PAD, EP_PAD=ws.EP_PAD, NC_PAD=ws.NC_PAD,
            TRAP=trap, FANOUT=fanout, num_warps=4)
    if fanout:
        return offsets, num_rows, rows_EP, fwd, comb, disp, ws.status, fan
    return offsets, num_rows, rows_EP, fwd, comb, disp, ws.status

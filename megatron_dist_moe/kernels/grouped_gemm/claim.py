"""The claim protocol of the staged pipeline: the programs that reach an m-tile copy its rows once.

In claim mode a grouped GEMM gathers its own A rows: the m-tile's rows are read from their
(peer) addresses into a dense copy (`a_copy_out`: x_g, or grad_h3 in the W2 DGRAD) and every
n-tile program of that m-tile then reads A densely from the copy (TMA when the config says so).
The copy is cut into column slices that the programs reaching the m-tile claim one at a time,
so it is spread over them instead of stalling one (`claim_slices_phase`).

Flags (`ClaimFlags`), per global m-tile, reused by every launch and never reset on the host:
`claimed` counts the slices handed out, `copied` the slices whose rows are stored. In the launch
that reads epoch p both hold (p << SLICE_SHIFT) + count; a value below p << SLICE_SHIFT is
stale and counts as 0 (`atomic_max` with the base lifts it first). The epoch advances on the
device before every launch, so CUDA-graph replays stay correct.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import STATUS_WORDS, wait_until_at_least
from .config import MIN_BLOCK_M

__all__ = ["ClaimFlags", "claim_slices_phase", "claim_ahead_phase", "fence_proxy_async"]


class ClaimFlags:
    """Per-m-tile slice counters of the claim mode (see the module docstring).

    claimed, copied  int64 [capacity], one entry per global m-tile: m-tile i of expert e has
                     index sum_{e' < e} cdiv(len_e', BM) + i < cdiv(R, BM) + E <= capacity,
                     capacity = cdiv(max_rows, block_m) + num_experts (block_m: the smallest
                     block_m of the configs it will serve; default the smallest this package
                     uses).
    epoch            int64 [1], advanced on the device by `next_epoch()` (a tensor op: no host
                     sync; a captured CUDA graph advances it on every replay).
    status           int64 [4]: where a wait that timed out records (code, what, rank, polls);
                     zeros otherwise. On the GPU the launcher traps on it after the kernel
                     (checks.check_status); in the CPU interpreter the caller reads it.
    Launches that may run concurrently (different streams) need separate ClaimFlags; launches
    ordered on one stream may share one (e.g. the W13 forward and the W2 DGRAD of every layer).
    """

    SLICE_SHIFT = 20  # counts stay far below 2^20: slices + 2 claims per visiting program

    def __init__(self, max_rows: int, block_m: int | None = None, num_experts: int = 1,
                 device=None):
        block_m = block_m or MIN_BLOCK_M
        assert max_rows >= 0 and num_experts >= 1 and block_m >= 1
        self.max_rows, self.block_m, self.num_experts = max_rows, block_m, num_experts
        self.capacity = triton.cdiv(max_rows, block_m) + num_experts
        self.claimed = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self.copied = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.status = torch.zeros(STATUS_WORDS, dtype=torch.int64, device=device)

    def next_epoch(self) -> None:
        """Advance the epoch on the device (stream-ordered before the next launch)."""
        self.epoch.add_(1)

    def check(self, *, max_rows: int, block_m: int, num_experts: int, device) -> None:
        need = triton.cdiv(max_rows, block_m) + num_experts
        assert self.capacity >= need, (
            f"ClaimFlags holds {self.capacity} flags, this launch may touch {need} m-tiles "
            f"(max_rows={max_rows}, block_m={block_m}, E={num_experts}): build it with these")
        assert self.epoch.device == device and self.claimed.device == device \
            and self.copied.device == device, "ClaimFlags must live on the weights' device"


@triton.jit
def fence_proxy_async():
    """fence.proxy.async.global in every thread: orders this thread's generic-proxy global
    accesses with its async-proxy (TMA) ones (see the NOTE in `claim_slices_phase`)."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _copy_mtile_cols(a_rows_ptr, dst_base, row0, row_end, Kd, col0, width, DT: tl.constexpr,
                     BLOCK_M: tl.constexpr, COPY_K: tl.constexpr):
    """dst[r, col0:col0+width] = the row at address a_rows[r] (zeros for address 0) for r in
    [row0, min(row0 + BLOCK_M, row_end)); 16-byte vectors (col0, width multiples of COPY_K)."""
    rows = row0 + tl.arange(0, BLOCK_M)
    ok = rows < row_end
    src = tl.load(a_rows_ptr + rows, mask=ok, other=0)
    load_ok = (ok & (src != 0))[:, None]
    cols = col0 + tl.arange(0, COPY_K)
    src_ptrs = tl.multiple_of(src.to(tl.pointer_type(DT)), [16])[:, None] + cols[None, :]
    dst_ptrs = dst_base + rows.to(tl.int64)[:, None] * Kd + cols[None, :]
    # num_stages=1: a plain register copy; pipelining it would stage it through shared memory,
    # which the GEMM's own stages already fill.
    for _k in tl.range(0, width, COPY_K, num_stages=1):
        v = tl.load(src_ptrs, mask=load_ok, other=0.0)
        tl.store(dst_ptrs, v, mask=ok[:, None])
        src_ptrs += COPY_K
        dst_ptrs += COPY_K


@triton.jit
def _claim_slice(claimed_ptr, base, num_slices):
    """Hand out the next slice of an m-tile: its index, or >= num_slices when none is left.
    atomic_max lifts a stale counter to this launch's base (count 0) and leaves a current one
    alone; the add then hands out distinct counts. Counts past num_slices are harmless."""
    tl.atomic_max(claimed_ptr, base, sem="relaxed", scope="gpu")
    return tl.atomic_add(claimed_ptr, 1, sem="relaxed", scope="gpu") - base


@triton.jit
def _count_copied(copied_ptr, base, PROXY_FENCE: tl.constexpr):
    """Release one copied slice: every thread's row stores, then one release increment."""
    if PROXY_FENCE:
        fence_proxy_async()
    tl.debug_barrier()
    tl.atomic_max(copied_ptr, base, sem="relaxed", scope="gpu")
    tl.atomic_add(copied_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _copy_claimed_slices(claimed_ptr, copied_ptr, base, num_slices, max_slices, a_rows_ptr,
                         a_copy_base, row0, row_end, Kd, SLICE_K: tl.constexpr, DT: tl.constexpr,
                         BLOCK_M: tl.constexpr, COPY_K: tl.constexpr,
                         PROXY_FENCE: tl.constexpr):
    """Claim and copy up to max_slices slices of one m-tile; stops early when none is left."""
    n = 0
    c = _claim_slice(claimed_ptr, base, num_slices)
    while c < num_slices:
        _copy_mtile_cols(a_rows_ptr, a_copy_base, row0, row_end, Kd, c * SLICE_K, SLICE_K, DT,
                         BLOCK_M, COPY_K)
        _count_copied(copied_ptr, base, PROXY_FENCE)
        n += 1
        if n < max_slices:
            c = _claim_slice(claimed_ptr, base, num_slices)
        else:
            c = c - c + num_slices  # stop (same dtype as the claimed index)


@triton.jit
def claim_slices_phase(row0, row_end, m_index, claimed_ptr, copied_ptr, base, a_rows_ptr,
                       a_copy_base, Kd, polls_max, rank, status_ptr, DT: tl.constexpr,
                       BLOCK_M: tl.constexpr, COPY_K: tl.constexpr, SLICE_K: tl.constexpr,
                       PROXY_FENCE: tl.constexpr, SLEEP: tl.constexpr):
    """Make rows [row0, row0 + BLOCK_M) of a_copy_out valid before this tile reads them.

    The m-tile is cut into S = Kd / SLICE_K column slices. Every program that reaches it
    1. (before this, `claim_ahead_phase`: a few slices of the m-tile of the tile it processes
       next, so the programs that will read that m-tile share its copy a wave before they need
       it)
    2. claims and copies slices of its own m-tile until none is left (helping any straggler);
    3. waits (acquire) until all S slices are counted as copied, giving up after polls_max
       polls of about a microsecond (checks.wait_until_at_least: the status word names the
       m-tile and the rank, and the launcher traps on it after the kernel).

    NOTE deadlock freedom: a program waits only in step 3, after every slice it claimed is copied
    and counted, and only once every slice of that m-tile has been claimed, i.e. is being copied
    by a running program that waits for nothing (loads, stores, a barrier of its own CTA). So
    every wait ends, for any grid size, without assuming that all programs are co-resident. In
    the CPU interpreter, programs run one after another: a program copies every slice that nobody
    copied before it and never spins.

    NOTE memory ordering. Writer: row stores (all threads) -> [fence.proxy.async.global, all
    threads] -> bar.sync -> release increment (one thread). Reader: acquire load (one thread;
    Triton broadcasts scalar atomics through shared memory + bar.sync) -> [fence.proxy.async.
    global, all threads] -> A loads. The bar.sync's synchronize-with within the CTA and the
    release/acquire pair across CTAs chain into causality order (PTX memory model), so the
    reader's generic loads (cp.async / ld) see the rows. TMA loads are async-proxy accesses,
    which causality order does not cover: the writer's proxy fence makes its generic stores
    visible to the async proxy before the release, the reader's orders its acquire before its
    TMA loads (a proxy fence on each side of the generic -> async hand-off). PROXY_FENCE =
    TMA on a GPU (the interpreter has no inline asm). Plain loads cannot hit a stale L1 line:
    the pipelined 16-byte A loads are cp.async.cg (L2 only), and the gpu-scope acquire orders
    them after the rows in any case. TMA tiles may overhang row_end into the next expert's rows,
    which may be mid-copy: those rows only feed accumulator rows that the epilogue masks off.
    """
    num_slices = Kd // SLICE_K
    _copy_claimed_slices(claimed_ptr + m_index, copied_ptr + m_index, base, num_slices,
                         num_slices, a_rows_ptr, a_copy_base, row0, row_end, Kd, SLICE_K, DT,
                         BLOCK_M, COPY_K, PROXY_FENCE)
    what = tl.full((), 1, tl.int64) * 4294967296 + m_index   # checks.WAIT_CLAIM_SLICES
    wait_until_at_least(copied_ptr + m_index, base + num_slices, polls_max, what, rank,
                        status_ptr, SLEEP)
    if PROXY_FENCE:
        fence_proxy_async()  # the acquire above, before this tile's TMA reads of the rows


@triton.jit
def claim_ahead_phase(row0, row_end, m_index, claimed_ptr, copied_ptr, base, a_rows_ptr,
                      a_copy_base, Kd, DT: tl.constexpr, BLOCK_M: tl.constexpr,
                      COPY_K: tl.constexpr, SLICE_K: tl.constexpr, AHEAD_SLICES: tl.constexpr,
                      PROXY_FENCE: tl.constexpr):
    """Claim and copy up to AHEAD_SLICES slices of the m-tile at rows [row0, row0 + BLOCK_M)
    that this program reads in a later tile (no wait). The caller finds that tile only when
    there is one: computing its coordinates unconditionally costs the claimed W13 ~0.09 ms at
    the guide's shapes (docs/decisions.md)."""
    _copy_claimed_slices(claimed_ptr + m_index, copied_ptr + m_index, base, Kd // SLICE_K,
                         AHEAD_SLICES, a_rows_ptr, a_copy_base, row0, row_end, Kd, SLICE_K, DT,
                         BLOCK_M, COPY_K, PROXY_FENCE)

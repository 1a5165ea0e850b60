"""The Mega forward: W13 + SwiGLU and W2 + scatter in one persistent launch, bf16.

One device work list per launch: every W13 tile (expert, m-tile, n-tile over F) first, then every
W2 tile (expert, m-tile, n-tile over D), both in tiles.py's group-M order. Programs claim items
one at a time from a device counter, so they are claimed in list order:

    W13 item   h1 = x_g W13[e]^T for its rows and F columns (gate and up), h2 = act(h1) stored
               (and h1 when asked); then one release increment of its m-tile's ready counter
    W2 item    waits (acquire) until its m-tile's ready counter says all of the m-tile's W13
               n-tiles are stored, then h3 = h2 W2[e]^T for its D columns, rows stored at their
               scatter addresses (the owners' combine rows; skipped where 0)

An m-tile's W2 items start while other programs still run later W13 items: no launch boundary
and no tail between the GEMMs (guide §05).

NOTE deadlock freedom: a W2 item waits only for W13 items, which come earlier in the list, so
they were claimed before it by running programs, which compute them without waiting for
anything. So every wait ends for any grid size and without co-residency (in the interpreter the
one running program claims every W13 item before any W2 item). The waits are bounded
(checks.wait_until_at_least: a verdict in the status word; the launcher traps after the kernel).

NOTE memory ordering as the claim protocol's (claim.py): writer h2 stores (all threads) ->
[fence.proxy.async.global, all threads] -> bar.sync -> release increment; reader acquire ->
[fence.proxy.async.global, all threads] -> TMA loads of h2. TMA reads are async-proxy accesses,
which the release/acquire pair alone does not order: a proxy fence on each side of the generic
-> async hand-off (on a GPU; the interpreter loads h2 with plain loads and has no inline asm).
A W2 item's h2 box may overhang its expert's last row into the next expert's rows, which may
still be being written: those rows feed only accumulator rows that the scatter masks off.

Counters are epoch-based (`MegaFlags`): each launch takes a new base, atomic_max lifts a stale
counter to it, so CUDA-graph replays need no reset.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..checks import STATUS_WORDS, check_status, max_polls, wait_until_at_least
from ..checks import WAIT_MEGA_READY
from ..common import (as_device_ptr, check_offsets, check_rows, default_num_programs,
                      ensure_tma_allocator, interpreting, load_ptr)
from ..rows import _act_fwd
from .config import MIN_BLOCK_M, GroupedGemmConfig, select_config
from .claim import fence_proxy_async
from .mm import _dot   # fp32 products in the interpreter
from .tiles import expert_segments, tile_bound, tile_coords, tile_list

__all__ = ["MegaFlags", "mega_fwd", "mega_config"]

SHIFT = 20           # per-launch counts stay below 2^20 (n-tiles of one m-tile; claimed items)
_SHIFT = tl.constexpr(SHIFT)
_WAIT_WHAT = tl.constexpr(WAIT_MEGA_READY << 32)    # checks: what a timed-out wait names


class MegaFlags:
    """Device counters of the Mega forward: the work-list counter, one ready counter per global
    m-tile (capacity as ClaimFlags'), the epoch, and the status word of a timed-out wait."""

    def __init__(self, max_rows: int, num_experts: int, device, block_m: int | None = None):
        block_m = block_m or MIN_BLOCK_M
        self.capacity = triton.cdiv(max_rows, block_m) + num_experts
        self.max_rows, self.num_experts, self.block_m = max_rows, num_experts, block_m
        self.queue = torch.zeros(1, dtype=torch.int64, device=device)
        self.ready = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.status = torch.zeros(STATUS_WORDS, dtype=torch.int64, device=device)

    def next_epoch(self) -> None:
        self.epoch.add_(1)


def mega_config(F2: int, D: int, device: torch.device, max_rows: int | None = None,
                num_experts: int | None = None) -> GroupedGemmConfig:
    """The Mega forward's default tiles for W13 [E, F2, D], which its W2 items share (the W13-only
    replay of the Mega pipeline runs them too, so its h1 and h2 are the bits the Mega forward
    stored). With the host bound max_rows over num_experts experts given, few rows per expert
    pick the FPROP table's decode tiles, as the standard W13 launch does; both contractions (D
    and F) must then be multiples of their block_k."""
    rows = -(-max_rows // num_experts) if max_rows is not None and num_experts else None
    return select_config("fwd", n=F2, kd=math.gcd(D, F2 // 2), device=device,
                         rows_per_expert=rows)


@triton.jit
def _mega_fwd_kernel(xg_addr, w13_ptr, w2_ptr, offsets_ptr, h1_addr, h2_addr, out_rows_ptr,
                     queue_ptr, ready_ptr, epoch_ptr, status_ptr, D, F, alpha, limit,
                     polls_max, rank, xg_tail, h2_tail, E: tl.constexpr, E_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BN13: tl.constexpr, BN2: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ACT: tl.constexpr,
                     STORE_H1: tl.constexpr, IEEE: tl.constexpr, SLEEP: tl.constexpr,
                     USE_TMA: tl.constexpr):
    DT: tl.constexpr = w13_ptr.dtype.element_ty
    e_idx, starts, ends, m_tiles = expert_segments(offsets_ptr, E, E_PAD, BLOCK_M)
    n13 = tl.cdiv(F, BN13)
    n2 = tl.cdiv(D, BN2)
    tiles13, cum13, total13 = tile_list(m_tiles, n13)
    tiles2, cum2, total2 = tile_list(m_tiles, n2)
    total = total13 + total2
    base = tl.load(epoch_ptr) << _SHIFT
    tl.atomic_max(queue_ptr, base, sem="relaxed", scope="gpu")
    xg = load_ptr(xg_addr, DT)
    h2 = load_ptr(h2_addr, DT)
    offs_k = tl.arange(0, BLOCK_K)
    if USE_TMA:   # every operand through TMA (h2 after proxy fences: the ordering note above)
        # xg_tail / h2_tail rows past R are readable: boxes stay off TMA's out-of-bounds path
        # (mm.py)
        num_rows = tl.load(offsets_ptr + E)
        xg_desc = tl.make_tensor_descriptor(xg, shape=[tl.maximum(num_rows + xg_tail, 1), D],
                                            strides=[D, 1], block_shape=[BLOCK_M, BLOCK_K])
        h2_desc = tl.make_tensor_descriptor(h2, shape=[tl.maximum(num_rows + h2_tail, 1), F],
                                            strides=[F, 1], block_shape=[BLOCK_M, BLOCK_K])
        w13_desc = tl.make_tensor_descriptor(w13_ptr, shape=[E * 2 * F, D], strides=[D, 1],
                                             block_shape=[BN13, BLOCK_K])
        w2_desc = tl.make_tensor_descriptor(w2_ptr, shape=[E * D, F], strides=[F, 1],
                                            block_shape=[BN2, BLOCK_K])
    item = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu") - base
    while item < total:
        if item < total13:
            e, row_start, row_end, m_first, pid_m, pid_n = tile_coords(
                item, e_idx, cum13, tiles13, starts, ends, m_tiles, n13, GROUP_M)
            rows = row_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < row_end
            rows_ld = tl.minimum(rows, row_end - 1).to(tl.int64)
            cols = pid_n * BN13 + tl.arange(0, BN13)
            col_ok = cols < F
            cols_ld = tl.minimum(cols, F - 1).to(tl.int64)
            a_ptrs = xg + rows_ld[:, None] * D + offs_k[None, :]
            w_e = w13_ptr + e.to(tl.int64) * 2 * F * D
            g_ptrs = w_e + cols_ld[None, :] * D + offs_k[:, None]
            u_ptrs = g_ptrs + F * D
            acc_g = tl.zeros((BLOCK_M, BN13), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BN13), dtype=tl.float32)
            row0 = (row_start + pid_m * BLOCK_M).to(tl.int32)      # TMA offsets are 32-bit
            wrow = (e * 2 * F + pid_n * BN13).to(tl.int32)
            for k in tl.range(0, D, BLOCK_K):
                if USE_TMA:
                    a = xg_desc.load([row0, k])
                    bg = w13_desc.load([wrow, k]).T
                    bu = w13_desc.load([wrow + F, k]).T
                else:
                    a = tl.load(a_ptrs + k)
                    bg = tl.load(g_ptrs + k)
                    bu = tl.load(u_ptrs + k)
                acc_g = _dot(a, bg, acc_g, IEEE)
                acc_u = _dot(a, bu, acc_u, IEEE)
            mask = row_ok[:, None] & col_ok[None, :]
            rows64 = rows.to(tl.int64)
            g = acc_g.to(DT)
            u = acc_u.to(DT)
            if STORE_H1:
                h1_ptrs = load_ptr(h1_addr, DT) + rows64[:, None] * (2 * F) + cols[None, :]
                tl.store(h1_ptrs, g, mask=mask)
                tl.store(h1_ptrs + F, u, mask=mask)
            # the activation reads the rounded h1, as mm.py's
            h = _act_fwd(g.to(tl.float32), u.to(tl.float32), ACT == 1, alpha, limit)
            tl.store(h2 + rows64[:, None] * F + cols[None, :], h.to(DT), mask=mask)
            if USE_TMA:
                fence_proxy_async()      # the h2 stores, before W2 items' TMA reads of them
            tl.debug_barrier()           # every thread's h2 stores before the release
            m = m_first + pid_m
            tl.atomic_max(ready_ptr + m, base, sem="relaxed", scope="gpu")
            tl.atomic_add(ready_ptr + m, 1, sem="release", scope="gpu")
        else:
            e, row_start, row_end, m_first, pid_m, pid_n = tile_coords(
                item - total13, e_idx, cum2, tiles2, starts, ends, m_tiles, n2, GROUP_M)
            m = m_first + pid_m
            what = tl.full((), _WAIT_WHAT, tl.int64) + m
            wait_until_at_least(ready_ptr + m, base + n13, polls_max, what, rank, status_ptr,
                                SLEEP)
            if USE_TMA:
                fence_proxy_async()      # the acquire above, before the TMA reads of h2
            # (names apart from the W13 branch's: Triton types a name alike in both branches)
            r2 = row_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            r2_ok = r2 < row_end
            r2_ld = tl.minimum(r2, row_end - 1).to(tl.int64)
            c2 = pid_n * BN2 + tl.arange(0, BN2)
            c2_ok = c2 < D
            c2_ld = tl.minimum(c2, D - 1).to(tl.int64)
            h_ptrs = h2 + r2_ld[:, None] * F + offs_k[None, :]
            b_ptrs = w2_ptr + e.to(tl.int64) * D * F + c2_ld[None, :] * F + offs_k[:, None]
            acc3 = tl.zeros((BLOCK_M, BN2), dtype=tl.float32)
            w2row = (e * D + pid_n * BN2).to(tl.int32)
            h2row = (row_start + pid_m * BLOCK_M).to(tl.int32)
            for k in tl.range(0, F, BLOCK_K):
                if USE_TMA:
                    a3 = h2_desc.load([h2row, k])
                    b3 = w2_desc.load([w2row, k]).T
                else:
                    a3 = tl.load(h_ptrs + k)
                    b3 = tl.load(b_ptrs + k)
                acc3 = _dot(a3, b3, acc3, IEEE)
            o_addr = tl.load(out_rows_ptr + r2, mask=r2_ok, other=0)
            o_row = tl.multiple_of(o_addr.to(tl.pointer_type(DT)), [16])
            tl.store(o_row[:, None] + c2[None, :], acc3.to(DT),
                     mask=(r2_ok & (o_addr != 0))[:, None] & c2_ok[None, :])
        item = tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu") - base


def mega_fwd(*, xg, w13: torch.Tensor, w2: torch.Tensor, expert_offsets: torch.Tensor,
             max_rows: int, h2, out_row_ptrs: torch.Tensor, flags: MegaFlags, h1=None,
             activation: str = "swiglu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
             config: Optional[GroupedGemmConfig] = None, num_programs: Optional[int] = None,
             timeout_s: float = 600.0, rank: int = 0, xg_tail_rows: int = 0,
             h2_tail_rows: int = 0) -> None:
    """The routed experts' forward on gathered rows in one launch (see the module docstring).

    xg              bf16 [R, D] gathered rows (tensor or device pointer), expert-major
    w13, w2         [E, 2F, D] (gate rows, then up rows) and [E, D, F], contiguous
    expert_offsets  int32 [E+1] device; R = expert_offsets[E]
    h2              [R, F] scratch (device pointer or tensor); h1 [R, 2F] stored when given
    out_row_ptrs    int64 [>= max_rows]: each row's destination (0: skip)
    flags           a MegaFlags built for max_rows and E (its epoch advances here)
    xg_tail_rows    rows readable past R at xg (grouped_mm_fwd's a_tail_rows)
    h2_tail_rows    rows readable past R at h2 (the W2 items' TMA boxes span them)
    """
    E, F2, D = w13.shape
    F = F2 // 2
    assert w13.is_contiguous() and w2.is_contiguous() and tuple(w2.shape) == (E, D, F)
    assert activation in ("swiglu", "swiglu_clamped")
    dev = w13.device
    check_offsets(expert_offsets, E, dev)
    for name, t, tail in (("xg", xg, xg_tail_rows), ("h2", h2, h2_tail_rows)):
        assert isinstance(tail, int) and tail >= 0, (
            f"{name}_tail_rows={tail!r}: rows readable past R at {name}, an int >= 0")
        if tail and not (t.dtype == torch.int64 and t.numel() == 1):
            assert t.dim() == 2 and t.shape[0] >= max_rows + tail, (
                f"{name}_tail_rows={tail}: {name} {tuple(t.shape)} must hold max_rows + "
                f"{name}_tail_rows = {max_rows + tail} rows")
    check_rows(out_row_ptrs, "out_row_ptrs", max_rows, dev)
    assert flags.capacity >= triton.cdiv(max_rows, MIN_BLOCK_M) + E, "MegaFlags too small"
    cfg = config or mega_config(F2, D, dev, max_rows, E)
    bn13, bn2 = cfg.block_n // 2, cfg.block_n
    assert D % cfg.block_k == 0 and F % cfg.block_k == 0, (
        f"D={D} and F={F} must be multiples of block_k={cfg.block_k}")
    on_gpu = dev.type == "cuda" and not interpreting()
    progs = num_programs or default_num_programs(dev)
    items = (tile_bound(max_rows, cfg.block_m, E, triton.cdiv(F, bn13))
             + tile_bound(max_rows, cfg.block_m, E, triton.cdiv(D, bn2)))
    assert items < 2 ** SHIFT // 2, f"{items} work items exceed the counters' range"
    grid = (max(1, min(progs, items)),)
    use_tma = bool(cfg.tma) and on_gpu and w13.dtype != torch.float32
    if use_tma:
        ensure_tma_allocator()
    flags.next_epoch()
    h1_addr = as_device_ptr(h1, "h1", w13.dtype) if h1 is not None else expert_offsets
    _mega_fwd_kernel[grid](
        as_device_ptr(xg, "xg", w13.dtype), w13, w2, expert_offsets, h1_addr,
        as_device_ptr(h2, "h2", w13.dtype), out_row_ptrs, flags.queue, flags.ready,
        flags.epoch, flags.status, D, F, float(swiglu_alpha), float(swiglu_limit),
        max_polls(timeout_s), rank, xg_tail_rows, h2_tail_rows, E=E, E_PAD=max(2, triton.next_power_of_2(E)),
        BLOCK_M=cfg.block_m, BN13=bn13, BN2=bn2, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        ACT=0 if activation == "swiglu" else 1, STORE_H1=h1 is not None,
        IEEE=w13.dtype == torch.float32 or not on_gpu, SLEEP=on_gpu, USE_TMA=use_tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if on_gpu:
        check_status(flags.status)

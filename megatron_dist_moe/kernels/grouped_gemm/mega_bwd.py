"""The Mega backward: each direction's DGRAD and WGRAD tiles as work records of one persistent
launch, bf16 (guide §05: "a work record selects DGRAD or WGRAD operands on shared roles").

Two launches, each one device work list that programs claim from a counter in list order:

    W2 launch   DGRAD record  an (m-tile, F column tile) of grad_h2 = g3 W2[e]; the SwiGLU
                              backward in its epilogue (grad_h1 written over h1, h2 rebuilt,
                              score-gradient parts without saved route outputs: mm.py's
                              dgrad_epilogue), then one release increment of expert e's ready
                              counter
                WGRAD record  a tile of grad_W2[e] = g3_e^T h2_e over the expert's rows, after
                              (acquire) all of expert e's DGRAD records stored their h2
    W13 launch  DGRAD record  an (m-tile, D column tile) of grad_x = grad_h1 W13[e], rows
                              scattered to the owners' dispatch rows
                WGRAD record  a tile of grad_W13[e] = grad_h1_e^T x_g_e
                              (both read what the W2 launch finished: no waits)

In both launches a record's A operand is the same rows (g3, then grad_h1): a DGRAD record reads
an [m-tile, k] block of them, a WGRAD record a [rows, m] block.

Work list: per expert a DGRAD range and a WGRAD range, group-M order inside each. The W2 launch
lists D_0, D_1, W_0, D_2, W_1, ..., D_{E-1}, W_{E-2}, W_{E-1}: expert e's WGRAD range follows
expert e+1's DGRAD range, so when its records are claimed the DGRAD records they wait for were
claimed a range earlier and have (nearly always) finished. The W13 launch lists D_0, W_0, D_1,
W_1, ...: an expert's two ranges read its grad_h1 rows while they are in L2.

NOTE deadlock freedom as in the Mega forward (mega.py): a WGRAD record waits only for DGRAD
records earlier in the list, which running programs claimed before it and compute without
waiting. An expert without rows has no DGRAD records; its WGRAD records do not wait (they store
zeros, or leave an accumulated output as it is).

NOTE memory ordering (claim.py's protocol; the WGRAD reads h2 through TMA, the async proxy):
writer h2 stores (all threads) -> fence.proxy.async.global -> bar.sync -> release increment;
reader acquire -> fence.proxy.async.global -> TMA loads.

Counters are epoch-based (`mega.MegaFlags`): each launch takes a new base, so CUDA-graph replays
need no reset.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..checks import WAIT_MEGA_BWD_READY, check_status, max_polls, wait_until_at_least
from ..common import (TL_DTYPES, as_device_ptr, check_offsets, check_rows,
                      default_num_programs, ensure_tma_allocator, interpreting, load_ptr)
from .claim import fence_proxy_async
from .config import GroupedGemmConfig, select_config
from .mega import SHIFT, MegaFlags
from .mm import ACTIVATIONS, _dot, dgrad_epilogue
from .tiles import expert_segments, swizzle, tile_bound
from .wgrad import ExpertOutTable, _dot_t, _store_wgrad_tile

__all__ = ["mega_bwd_w2", "mega_bwd_w13"]

_SHIFT = tl.constexpr(SHIFT)
_WAIT_WHAT = tl.constexpr(WAIT_MEGA_BWD_READY << 32)   # checks: what a timed-out wait names
_EPI_SCATTER, _EPI_SWIGLU_BWD = 2, 3                    # mm.EPILOGUES' indices
# The list order per launch (`lag`, see mega_bwd_w2): measured by benchmarks/bench_mega_bwd.py
W2_LAG = 1
W13_LAG = 0


@triton.jit
def _list_total(offsets_ptr, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, n_dg, w_t):
    """Records of the work list: every expert's DGRAD m-tiles x n_dg, and w_t WGRAD tiles each."""
    e_idx, starts, ends, m_tiles = expert_segments(offsets_ptr, E, E_PAD, BLOCK_M)
    return tl.sum(m_tiles * n_dg, 0) + E * w_t


@triton.jit
def _record(item, offsets_ptr, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, n_dg, w_t, lag):
    """What list position `item` holds: (DGRAD?, expert e, position in e's range, e's m-tiles,
    e's DGRAD records, e's rows [row_start, row_end)). Expert e's DGRAD range follows the DGRAD
    ranges of experts < e and the WGRAD ranges of experts < e - lag; its WGRAD range follows
    the DGRAD ranges of experts <= e + lag and the WGRAD ranges of experts < e. Recomputed from
    the offsets (L1 hits) per record rather than held across the loop: registers the epilogues
    need."""
    e_idx, starts, ends, m_tiles = expert_segments(offsets_ptr, E, E_PAD, BLOCK_M)
    live = e_idx < E
    d_t = m_tiles * n_dg
    d_start = tl.cumsum(d_t, 0) - d_t + w_t * tl.maximum(e_idx - lag, 0)
    before = e_idx[None, :] <= e_idx[:, None] + lag          # [e, e']: D_e' precedes W_e
    w_start = tl.sum(tl.where(before, d_t[None, :], 0), 1) + w_t * e_idx
    in_d = live & (item >= d_start) & (item < d_start + d_t)
    in_w = live & (item >= w_start) & (item < w_start + w_t)
    e = tl.sum(tl.where(in_d | in_w, e_idx, 0), 0)
    sel = e_idx == e
    is_d = tl.sum(in_d.to(tl.int32), 0) > 0
    local = item - tl.sum(tl.where(sel, tl.where(is_d, d_start, w_start), 0), 0)
    return (is_d, e, local, tl.sum(tl.where(sel, m_tiles, 0), 0),
            tl.sum(tl.where(sel, d_t, 0), 0), tl.sum(tl.where(sel, starts, 0), 0),
            tl.sum(tl.where(sel, ends, 0), 0))


@triton.jit
def _mega_bwd_kernel(
        a_addr, b_addr, w_ptr, offsets_ptr, out_addr, out2_addr, out_rows_ptr, wg_out_ptr,
        queue_ptr, ready_ptr, epoch_ptr, status_ptr,
        N, Kd, NB, alpha, limit, score_grad_delta, part_stride, polls_max, rank, lag,
        E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EPILOGUE: tl.constexpr,
        SCORE_GRADS: tl.constexpr, STORE_AUX: tl.constexpr, ACT: tl.constexpr,
        WAIT: tl.constexpr, ACCUMULATE: tl.constexpr, OUT_TABLE: tl.constexpr,
        OUT_DT: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr, ON_GPU: tl.constexpr):
    # DGRAD: out[r] = a[r] @ w[e] (w[e] is [Kd, N]); WGRAD: wg_out[e] [Kd, NB] = a_e^T @ b_e
    DT: tl.constexpr = w_ptr.dtype.element_ty
    n_dg = tl.cdiv(N, BLOCK_N)
    num_m_wg = tl.cdiv(Kd, BLOCK_M)
    num_n_wg = tl.cdiv(NB, BLOCK_N)
    total = _list_total(offsets_ptr, E, E_PAD, BLOCK_M, n_dg, num_m_wg * num_n_wg)
    base = tl.load(epoch_ptr) << _SHIFT
    tl.atomic_max(queue_ptr, base, sem="relaxed", scope="gpu")
    a_base = load_ptr(a_addr, DT)
    b_base = load_ptr(b_addr, DT)
    offs_k = tl.arange(0, BLOCK_K)
    if USE_TMA:
        num_rows = tl.maximum(tl.load(offsets_ptr + E), 1)
        a_desc = tl.make_tensor_descriptor(a_base, shape=[num_rows, Kd], strides=[Kd, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * Kd, N], strides=[N, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
        at_desc = tl.make_tensor_descriptor(a_base, shape=[num_rows, Kd], strides=[Kd, 1],
                                            block_shape=[BLOCK_K, BLOCK_M])
        b_desc = tl.make_tensor_descriptor(b_base, shape=[num_rows, NB], strides=[NB, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    # list positions stay below 2^19 (the launcher checks): 32-bit, as TMA offsets must be.
    # With waits, records are claimed from the counter in list order (deadlock freedom for any
    # grid); without, each program walks its own stride (no claim latency per record).
    if WAIT:
        item = (tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu") - base).to(tl.int32)
    else:
        item = tl.program_id(0)
    while item < total:
        is_d, e, local, num_m, need, row_start, row_end = _record(
            item, offsets_ptr, E, E_PAD, BLOCK_M, n_dg, num_m_wg * num_n_wg, lag)
        if is_d:
            # DGRAD record (names apart from the WGRAD branch's: Triton types a name alike in
            # both branches)
            pid_m, pid_n = swizzle(local, num_m, n_dg, GROUP_M)
            row0 = row_start + pid_m * BLOCK_M
            rows = row0 + tl.arange(0, BLOCK_M)
            row_ok = rows < row_end
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if USE_TMA:
                for k in tl.range(0, Kd, BLOCK_K):
                    acc = _dot(a_desc.load([row0, k]),
                               w_desc.load([e * Kd + k, pid_n * BLOCK_N]), acc, IEEE)
            else:
                rows_ld = tl.minimum(rows, row_end - 1).to(tl.int64)
                a_ptrs = a_base + rows_ld[:, None] * Kd + offs_k[None, :]
                w_ptrs = w_ptr + e.to(tl.int64) * Kd * N + offs_k[:, None] * N + cols[None, :]
                for k in tl.range(0, Kd, BLOCK_K):
                    acc = _dot(tl.load(a_ptrs), tl.load(w_ptrs, mask=col_ok[None, :], other=0.0),
                               acc, IEEE)
                    a_ptrs += BLOCK_K
                    w_ptrs += BLOCK_K * N
            dgrad_epilogue(acc, rows, row_ok, cols, col_ok, pid_n, out_addr, out2_addr,
                           out_rows_ptr, N, alpha, limit, score_grad_delta, part_stride, DT,
                           BLOCK_M, BLOCK_N, EPILOGUE, SCORE_GRADS, STORE_AUX, ACT, ON_GPU)
            if WAIT:
                if ON_GPU:
                    fence_proxy_async()   # this thread's h2 stores, before the WGRAD's TMA reads
                tl.debug_barrier()        # every thread's stores before the release
                tl.atomic_max(ready_ptr + e, base, sem="relaxed", scope="gpu")
                tl.atomic_add(ready_ptr + e, 1, sem="release", scope="gpu")
        else:
            # WGRAD record
            wm, wn = swizzle(local, num_m_wg, num_n_wg, GROUP_M)
            if WAIT:
                if need > 0:
                    wait_until_at_least(ready_ptr + e, base + need, polls_max,
                                        tl.full((), _WAIT_WHAT, tl.int64) + e, rank,
                                        status_ptr, ON_GPU)
                    if ON_GPU:
                        fence_proxy_async()   # the acquire above, before the TMA reads of h2
            offs_m = wm * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = wn * BLOCK_N + tl.arange(0, BLOCK_N)
            m_ok = offs_m < Kd
            n_ok = offs_n < NB
            n_full = (row_end - row_start) // BLOCK_K
            acc_w = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if USE_TMA:
                for i in tl.range(0, n_full):
                    r = row_start + i * BLOCK_K
                    acc_w = _dot_t(at_desc.load([r, wm * BLOCK_M]),
                                   b_desc.load([r, wn * BLOCK_N]), acc_w, IEEE)
            else:
                rk = row_start + offs_k
                at_ptrs = a_base + rk.to(tl.int64)[:, None] * Kd + offs_m[None, :]
                b_ptrs = b_base + rk.to(tl.int64)[:, None] * NB + offs_n[None, :]
                for i in tl.range(0, n_full):
                    acc_w = _dot_t(tl.load(at_ptrs, mask=m_ok[None, :], other=0.0),
                                   tl.load(b_ptrs, mask=n_ok[None, :], other=0.0), acc_w, IEEE)
                    at_ptrs += BLOCK_K * Kd
                    b_ptrs += BLOCK_K * NB
            r_tail = row_start + n_full * BLOCK_K
            if r_tail < row_end:
                rt = r_tail + offs_k
                rt_ok = rt < row_end
                at_t = tl.load(a_base + rt.to(tl.int64)[:, None] * Kd + offs_m[None, :],
                               mask=rt_ok[:, None] & m_ok[None, :], other=0.0)
                b_t = tl.load(b_base + rt.to(tl.int64)[:, None] * NB + offs_n[None, :],
                              mask=rt_ok[:, None] & n_ok[None, :], other=0.0)
                acc_w = _dot_t(at_t, b_t, acc_w, IEEE)
            _store_wgrad_tile(acc_w, wg_out_ptr, e, offs_m, wn * BLOCK_N, Kd, NB, row_start,
                              row_end, ACCUMULATE, OUT_TABLE, OUT_DT, BLOCK_N)
        if WAIT:
            item = (tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu") - base).to(tl.int32)
        else:
            item += tl.num_programs(0)


def _wgrad_out(out, name: str, shape: tuple, device) -> tuple:
    """(pointer argument, dtype, table?) of a WGRAD output: [E, M, N] tensor or ExpertOutTable."""
    if isinstance(out, ExpertOutTable):
        assert out.shape == shape and out.dtype == torch.float32, (
            f"{name}: an ExpertOutTable of {shape[0]} fp32 {shape[1]} x {shape[2]} matrices "
            f"(it is added into), got {out.shape} {out.dtype}")
        return out.addrs, out.dtype, True
    assert tuple(out.shape) == shape and out.is_contiguous() and out.device == device, (
        f"{name}: a contiguous {list(shape)} tensor on {device}, got {list(out.shape)} on "
        f"{out.device}")
    assert out.dtype in (torch.bfloat16, torch.float32) or (
        interpreting() and out.dtype in TL_DTYPES), f"{name}: bf16 or fp32, got {out.dtype}"
    return out, out.dtype, False


def _launch(*, a, w, b, nb, expert_offsets, max_rows, wgrad_out, flags, epilogue, out, out2,
            out_rows, score_grads, score_grad_delta, part_stride, activation, swiglu_alpha,
            swiglu_limit, wait, lag, config, num_programs, timeout_s, rank) -> None:
    """One launch of `_mega_bwd_kernel`: DGRAD records out = a @ w[e] ([R, Kd] x [Kd, N]) with
    `epilogue`, WGRAD records wgrad_out[e] = a_e^T b_e ([Kd, nb]); `wait`: the WGRAD records read
    b = h2 that the DGRAD records' epilogue writes (the W2 direction)."""
    E, Kd, N = w.shape
    NB = nb
    dev = w.device
    assert lag >= 0, f"lag={lag}: an expert's WGRAD range must follow its DGRAD range"
    assert w.is_contiguous(), "w must be contiguous"
    assert activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}"
    check_offsets(expert_offsets, E, dev)
    assert isinstance(flags, MegaFlags) and flags.capacity >= E, (
        "flags: a MegaFlags with a ready counter per local expert")
    cfg = config or select_config("dgrad", n=N, kd=Kd, device=dev)
    assert Kd % cfg.block_k == 0, f"Kd={Kd} must be a multiple of block_k={cfg.block_k}"
    on_gpu = dev.type == "cuda" and not interpreting()
    tab_ptr, out_dt, table = wgrad_out
    items = (tile_bound(max_rows, cfg.block_m, E, triton.cdiv(N, cfg.block_n))
             + E * triton.cdiv(Kd, cfg.block_m) * triton.cdiv(NB, cfg.block_n))
    assert items < 2 ** SHIFT // 2, f"{items} work records exceed the counters' range"
    use_tma = bool(cfg.tma) and on_gpu and w.dtype != torch.float32
    if use_tma:
        ensure_tma_allocator()
    flags.next_epoch()
    _mega_bwd_kernel[(max(1, min(num_programs or default_num_programs(dev), items)),)](
        as_device_ptr(a, "a", w.dtype), as_device_ptr(b, "b", w.dtype), w, expert_offsets,
        out, out2, out_rows, tab_ptr, flags.queue, flags.ready, flags.epoch, flags.status,
        N, Kd, NB, float(swiglu_alpha), float(swiglu_limit), int(score_grad_delta),
        int(part_stride), max_polls(timeout_s), rank, min(int(lag), E), E=E,
        E_PAD=max(2, triton.next_power_of_2(E)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EPILOGUE=epilogue, SCORE_GRADS=score_grads, STORE_AUX=epilogue == _EPI_SWIGLU_BWD,
        ACT=ACTIVATIONS.index(activation), WAIT=wait, ACCUMULATE=table, OUT_TABLE=table,
        OUT_DT=TL_DTYPES[out_dt], USE_TMA=use_tma,
        IEEE=w.dtype == torch.float32 or not on_gpu, ON_GPU=on_gpu,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if on_gpu and wait:
        check_status(flags.status)   # a wait that timed out traps here, with its numbers


def _rows(t, name: str, width: int, dtype: torch.dtype):
    """A [R, width] row operand: a tensor of that width, or an int64 [1] device address."""
    if isinstance(t, torch.Tensor) and t.dtype != torch.int64:
        assert t.dim() == 2 and t.shape[1] == width and t.is_contiguous(), (
            f"{name}: dense [R, {width}] rows, got {list(t.shape)}")
    return as_device_ptr(t, name, dtype)


def mega_bwd_w2(*, g3, w2: torch.Tensor, h1, h2, expert_offsets: torch.Tensor, max_rows: int,
                grad_w2, flags: MegaFlags, score_ptrs: Optional[torch.Tensor] = None,
                score_grad_delta: int = 0, part_stride: int = 0, activation: str = "swiglu",
                swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, lag: int = W2_LAG,
                config: Optional[GroupedGemmConfig] = None, num_programs: Optional[int] = None,
                timeout_s: float = 600.0, rank: int = 0) -> None:
    """The W2 direction of the backward in one launch: grouped_mm_dgrad(epilogue="swiglu_bwd")
    and grouped_mm_wgrad(g3, h2) as work records (see the module docstring), the same bits.

    g3          bf16 [R, D] gathered output-gradient rows (tensor or device pointer)
    w2          [E, D, F] contiguous
    h1          [R, 2F] saved h1 = [g | u]; becomes grad_h1 = [dg | du] in place
    h2          [R, F] scratch: h2 = act(h1) (times the route's score with score_ptrs), the
                WGRAD's operand
    grad_w2     [E, D, F] bf16 / fp32 tensor (stored), or an fp32 ExpertOutTable (added into)
    score_ptrs  as grouped_mm_dgrad's (Config.save_route_outputs=False)
    flags       a MegaFlags for max_rows and E (its epoch advances here)
    lag         expert e's WGRAD range follows expert (e + lag)'s DGRAD range in the list (0:
                adjacent; >= E: every DGRAD record first)
    """
    E, D, F = w2.shape
    dev = w2.device
    if score_ptrs is not None:
        check_rows(score_ptrs, "score_ptrs", max_rows, dev)
    h2_addr = _rows(h2, "h2", F, w2.dtype)
    _launch(a=_rows(g3, "g3", D, w2.dtype), w=w2, b=h2_addr, nb=F, expert_offsets=expert_offsets,
            max_rows=max_rows, wgrad_out=_wgrad_out(grad_w2, "grad_w2", (E, D, F), dev),
            flags=flags, epilogue=_EPI_SWIGLU_BWD, out=_rows(h1, "h1", 2 * F, w2.dtype),
            out2=h2_addr, out_rows=score_ptrs if score_ptrs is not None else expert_offsets,
            score_grads=score_ptrs is not None, score_grad_delta=score_grad_delta,
            part_stride=part_stride, activation=activation, swiglu_alpha=swiglu_alpha,
            swiglu_limit=swiglu_limit, wait=True, lag=lag, config=config,
            num_programs=num_programs,
            timeout_s=timeout_s, rank=rank)


def mega_bwd_w13(*, grad_h1, w13: torch.Tensor, x_g, expert_offsets: torch.Tensor,
                 max_rows: int, grad_x_row_ptrs: torch.Tensor, grad_w13, flags: MegaFlags,
                 lag: int = W13_LAG, config: Optional[GroupedGemmConfig] = None,
                 num_programs: Optional[int] = None,
                 timeout_s: float = 600.0, rank: int = 0) -> None:
    """The W13 direction of the backward in one launch: grouped_mm_dgrad(epilogue="scatter")
    and grouped_mm_wgrad(grad_h1, x_g) as work records, the same bits.

    grad_h1          bf16 [R, 2F] (what mega_bwd_w2 wrote over h1)
    w13              [E, 2F, D] contiguous
    x_g              bf16 [R, D] the gathered input rows of the forward
    grad_x_row_ptrs  int64 [>= max_rows]: each row's grad_x destination (0: skip)
    grad_w13         [E, 2F, D] bf16 / fp32 tensor, or an fp32 ExpertOutTable (added into)
    lag              as mega_bwd_w2's
    """
    E, F2, D = w13.shape
    dev = w13.device
    check_rows(grad_x_row_ptrs, "grad_x_row_ptrs", max_rows, dev)
    _launch(a=_rows(grad_h1, "grad_h1", F2, w13.dtype), w=w13, b=_rows(x_g, "x_g", D, w13.dtype),
            nb=D, expert_offsets=expert_offsets, max_rows=max_rows,
            wgrad_out=_wgrad_out(grad_w13, "grad_w13", (E, F2, D), dev), flags=flags,
            epilogue=_EPI_SCATTER, out=expert_offsets, out2=expert_offsets,
            out_rows=grad_x_row_ptrs, score_grads=False, score_grad_delta=0, part_stride=0,
            activation="swiglu", swiglu_alpha=1.702, swiglu_limit=7.0, wait=False, lag=lag,
            config=config, num_programs=num_programs, timeout_s=timeout_s, rank=rank)

"""Row-movement and owner-side Triton kernels of the CUDA backend.

Every kernel here is memory-bound and takes device-valued sizes (row counts, byte offsets) so it
runs inside CUDA graphs without host reads. Operands whose address is chosen on the device
(activation-slot offsets, peer buffers) arrive as int64 addresses; see `device_ptr`.
Plain-torch twins live in rows_ref.py.

Kernels:
    publish_tokens  a source rank's call header in one launch: T, its expert IDs as int16 and
                    its token rows into the dispatch buffer
    gather_rows     dst[i, :] = *row_ptrs[i]      (peer reads; 0 = zero row), i < num_rows
    scatter_rows    *row_ptrs[i] = src[i, :]      (peer writes; 0 = skip),    i < num_rows
    copy_rows       dst_addr[i, :] = src_addr[i, :] for i < num_rows (slot <-> scratch)
    combine_routes  y[t] = sum_k [id>=0] s[t,k] * routes[t,k]  (fp32 sum, owner side)
    publish_grad_routes  grad_routes[t,k] = s[t,k] * gy[t]; grad_s[t,k] = <gy[t], routes[t,k]>
    reduce_routes   gx[t] = sum_k [id>=0] grad_routes_in[t,k]     (fp32 sum, owner side)
  expert-side score gradients (Config.save_route_outputs=False):
    publish_grad_y    gy[t] once per token (unscaled) at the start of the owner's combine
                      region; the owner's published scores
    route_score_ptrs  per received row: the addresses of its route's score in the owner's
                      routing region and of its token's gy row (from the row's combine address)
    score_grad_rows   per row: grad_s = <u, h2> stored to the owner, then u *= s, h2 *= s
    sum_score_parts   owner side: grad_s[t, k] = the ordered sum of the experts' parts
    swiglu_fwd / swiglu_bwd   elementwise activation on h1 = [g | u] rows
Device checks and their trap messages live in checks.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import TL_DTYPES as _TL_DTYPE
from .common import device_ptr, load_ptr


__all__ = ["device_ptr", "publish_tokens", "publish_ids", "check_publish_ids", "gather_rows",
           "fanout_rows", "scatter_rows", "copy_rows",
           "combine_routes", "publish_grad_routes", "reduce_routes", "swiglu_fwd", "swiglu_bwd",
           "swiglu_grad", "publish_grad_y", "route_score_ptrs", "score_grad_rows",
           "sum_score_parts"]


# -- publication: what a source rank's peers read ------------------------------------------
@triton.jit
def publish_ids(t, T, ids_ptr, header_ptr, ids16_ptr, sched_ptr, sched_mul, K: tl.constexpr,
                K_PAD: tl.constexpr):
    """The routing header of program t of a per-token grid: T and the schedule word (program 0;
    `schedule_args`) and token t's IDs as int16 (shared with quant_nvfp4's publishing
    quantizer)."""
    if t == 0:
        tl.store(header_ptr, T)
        word = tl.full((), -1, tl.int64)
        if sched_mul > 0:
            word = (tl.load(sched_ptr) * sched_mul + tl.load(sched_ptr + 1)).to(tl.int64)
        tl.store(header_ptr + 1, word.to(tl.int32))
    kk = tl.arange(0, K_PAD)
    live = (kk < K) & (t < T)
    ids = tl.load(ids_ptr + t * K + kk, mask=live, other=0)
    tl.store(ids16_ptr + t * K + kk, ids.to(tl.int16), mask=live)


@triton.jit
def _publish_tokens_kernel(x_ptr, ids_ptr, header_ptr, ids16_ptr, dst_ptr, sched_ptr, sched_mul,
                           T, D: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if c == 0:
        publish_ids(t, T, ids_ptr, header_ptr, ids16_ptr, sched_ptr, sched_mul, K, K_PAD)
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    m = (d < D) & (t < T)
    tl.store(dst_ptr + t * D + d, tl.load(x_ptr + t * D + d, mask=m), mask=m)


def check_publish_ids(T: int, ids_TK: torch.Tensor, header: torch.Tensor,
                      ids16: torch.Tensor) -> None:
    """What the publishing launchers (publish_tokens, quant_nvfp4.publish_quantized) need of the
    routing header's operands before `publish_ids` writes them."""
    assert ids_TK.is_contiguous() and ids_TK.shape[0] == T, (
        f"ids_TK: dense [T={T}, K], got {list(ids_TK.shape)}")
    assert header.dtype == torch.int32 and ids16.dtype == torch.int16, "header int32, ids int16"
    assert header.numel() >= 2, "header: [T, schedule word]"
    K = ids_TK.shape[1]
    assert ids16.numel() >= T * K, f"ids16: {ids16.numel()} entries < T*K = {T * K}"


def schedule_args(sched, header: torch.Tensor) -> tuple:
    """(pointer, multiplier) from which publish_ids writes header[1], the schedule word that the
    routing check compares across ranks: sched = (the planner's selection [slot, planned layers]
    int64 device tensor, max layers per slot + 1) for a training forward: slot x (max + 1) +
    layers; None for a call that keeps no state: -1."""
    return (header, 0) if sched is None else sched


def publish_tokens(x_TD: torch.Tensor, ids_TK: torch.Tensor, header: torch.Tensor,
                   ids16: torch.Tensor, dispatch: torch.Tensor, sched=None) -> None:
    """header = [T, schedule word] (`schedule_args`), ids16[:T*K] = ids_TK as int16,
    dispatch[:T*D] = x_TD (bf16), in one launch instead of four (fills, a conversion, a copy):
    what the peers read after the call's first barrier. Tensors are taken as they are (dense,
    on one device)."""
    T, D = x_TD.shape
    K = ids_TK.shape[1]
    assert x_TD.is_contiguous(), "x_TD: a dense tensor"
    check_publish_ids(T, ids_TK, header, ids16)
    assert dispatch.dtype == x_TD.dtype and dispatch.numel() >= T * D, "dispatch: x's dtype, T*D"
    block = min(4096, triton.next_power_of_2(D))
    _publish_tokens_kernel[(max(1, T), triton.cdiv(D, block))](
        x_TD, ids_TK, header, ids16, dispatch, *schedule_args(sched, header), T, D=D, K=K,
        K_PAD=max(2, triton.next_power_of_2(K)), BLOCK_D=block, num_warps=4)


# -- gather / scatter / copy ----------------------------------------------------------------
@triton.jit
def _gather_rows_kernel(row_ptrs, dst_addr, num_rows_ptr, W: tl.constexpr, DT: tl.constexpr,
                        BLOCK_W: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.load(num_rows_ptr).to(tl.int64)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n
    src = tl.load(row_ptrs + rows, mask=live, other=0)
    dst = tl.load(dst_addr).to(tl.pointer_type(DT))
    cols = tl.arange(0, BLOCK_W)
    for c0 in range(0, W, BLOCK_W):
        c = c0 + cols
        cm = c < W
        sp = src[:, None].to(tl.pointer_type(DT)) + c[None, :]
        v = tl.load(sp, mask=(src[:, None] != 0) & cm[None, :] & live[:, None], other=0.0)
        tl.store(dst + rows[:, None] * W + c[None, :], v, mask=live[:, None] & cm[None, :])


def gather_rows(row_ptrs: torch.Tensor, dst_addr: torch.Tensor, num_rows: torch.Tensor,
                width: int, dtype: torch.dtype, max_rows: int) -> None:
    """dst[i, :width] = row at address row_ptrs[i] (zeros when 0) for i < num_rows (device)."""
    ROWS = 4
    grid = (triton.cdiv(max_rows, ROWS),)
    if grid[0]:
        _gather_rows_kernel[grid](row_ptrs, dst_addr, num_rows, W=width, DT=_TL_DTYPE[dtype],
                                  BLOCK_W=min(1024, triton.next_power_of_2(width)), ROWS=ROWS,
                                  num_warps=4)


@triton.jit
def _fanout_rows_kernel(src_base_ptr, dest_ptr, dst_addr, num_rows_ptr, n_tokens, T,
                        src_stride_bytes, K: tl.constexpr, K_PAD: tl.constexpr, W: tl.constexpr,
                        DT: tl.constexpr, BLOCK_W: tl.constexpr):
    tok = tl.program_id(0)            # flat (source rank r, token t)
    c0 = tl.program_id(1) * BLOCK_W   # its columns [c0, c0 + BLOCK_W)
    if tok >= n_tokens:
        return
    n = tl.load(num_rows_ptr).to(tl.int64)
    kk = tl.arange(0, K_PAD)
    d = tl.load(dest_ptr + tok.to(tl.int64) * K + kk, mask=kk < K, other=-1).to(tl.int64)
    ok = (d >= 0) & (d < n)
    if tl.sum(ok.to(tl.int32), 0) == 0:
        return                        # no route of this token lands here: no peer read
    r = tok // T
    src = (tl.load(src_base_ptr + r) + (tok - r * T).to(tl.int64) * src_stride_bytes).to(
        tl.pointer_type(DT))
    dst = tl.load(dst_addr).to(tl.pointer_type(DT))
    c = c0 + tl.arange(0, BLOCK_W)
    cm = c < W
    v = tl.load(src + c, mask=cm)     # read once ...
    for k in tl.static_range(K_PAD):
        dk = tl.sum(tl.where(kk == k, d, 0), 0)
        okk = tl.sum(tl.where(kk == k, ok.to(tl.int32), 0), 0) > 0
        tl.store(dst + dk * W + c, v, mask=cm & okk)   # ... written to every row


def fanout_rows(src_base_EP: torch.Tensor, src_stride_bytes: int, dest_rows: torch.Tensor,
                T: int, K: int, dst_addr: torch.Tensor, num_rows: torch.Tensor, width: int,
                dtype: torch.dtype) -> None:
    """dst[dest_rows[(r*T + t)*K + k], :width] = row t of rank r (at src_base_EP[r] + t *
    src_stride_bytes) for every route whose row is in [0, num_rows) (device). Each token row is
    read once and written to all of its rows; tokens with no row here are not read at all. The
    same result as `gather_rows` over the matching row addresses, with a token's peer row read
    once instead of once per route (a program per token and column block: a decode step's few
    tokens still fill the GPU)."""
    EP = src_base_EP.numel()
    assert dest_rows.numel() == EP * T * K, (
        f"dest_rows has {dest_rows.numel()} entries, expected EP*T*K = {EP}*{T}*{K}")
    assert dest_rows.dtype == torch.int32, f"dest_rows must be int32, got {dest_rows.dtype}"
    if EP * T == 0:
        return
    block = min(1024, triton.next_power_of_2(width))
    _fanout_rows_kernel[(EP * T, triton.cdiv(width, block))](
        src_base_EP, dest_rows, dst_addr, num_rows, EP * T, T, src_stride_bytes, K=K,
        K_PAD=max(2, triton.next_power_of_2(K)), W=width, DT=_TL_DTYPE[dtype],
        BLOCK_W=block, num_warps=4)


@triton.jit
def _scatter_rows_kernel(src_addr, row_ptrs, num_rows_ptr, W: tl.constexpr, DT: tl.constexpr,
                         BLOCK_W: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.load(num_rows_ptr).to(tl.int64)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n
    dst = tl.load(row_ptrs + rows, mask=live, other=0)
    # 16-byte aligned rows (W a feature width: Config holds it to a multiple of 16 bytes), so
    # the copies vectorize; the hints sit on the int -> pointer casts (common.load_ptr)
    src = load_ptr(src_addr, DT)
    dst_rows = tl.multiple_of(dst.to(tl.pointer_type(DT)), [16])
    cols = tl.arange(0, BLOCK_W)
    ok = live & (dst != 0)
    for c0 in range(0, W, BLOCK_W):
        c = c0 + cols
        cm = c < W
        v = tl.load(src + rows[:, None] * W + c[None, :], mask=ok[:, None] & cm[None, :])
        tl.store(dst_rows[:, None] + c[None, :], v, mask=ok[:, None] & cm[None, :])


def scatter_rows(src_addr: torch.Tensor, row_ptrs: torch.Tensor, num_rows: torch.Tensor,
                 width: int, dtype: torch.dtype, max_rows: int) -> None:
    """Row i of src (i < num_rows) stored to address row_ptrs[i]; rows with address 0 skipped."""
    ROWS = 4
    grid = (triton.cdiv(max_rows, ROWS),)
    if grid[0]:
        _scatter_rows_kernel[grid](src_addr, row_ptrs, num_rows, W=width, DT=_TL_DTYPE[dtype],
                                   BLOCK_W=min(1024, triton.next_power_of_2(width)), ROWS=ROWS,
                                   num_warps=4)


@triton.jit
def _copy_rows_kernel(src_addr, dst_addr, num_rows_ptr, W: tl.constexpr, BLOCK: tl.constexpr):
    # Copies num_rows * W int16 words (bf16 bit patterns) as a flat range.
    pid = tl.program_id(0)
    total = tl.load(num_rows_ptr).to(tl.int64) * W
    src = tl.load(src_addr).to(tl.pointer_type(tl.int16))
    dst = tl.load(dst_addr).to(tl.pointer_type(tl.int16))
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def copy_rows(src_addr: torch.Tensor, dst_addr: torch.Tensor, num_rows: torch.Tensor,
              width: int, max_rows: int) -> None:
    """Copy num_rows (device) rows of `width` 2-byte elements between device addresses."""
    BLOCK = 4096
    grid = (triton.cdiv(max_rows * width, BLOCK),)
    if grid[0]:
        _copy_rows_kernel[grid](src_addr, dst_addr, num_rows, W=width, BLOCK=BLOCK, num_warps=4)


# -- owner side: combine, backward publication, reduction ------------------------------------
@triton.jit
def _combine_routes_kernel(routes_ptr, ids_ptr, scores_ptr, y_ptr, save_addr, save_flag_ptr,
                           src_addr, src_rows_ptr, src_n_ptr, T, D: tl.constexpr,
                           K: tl.constexpr,
                           BLOCK_D: tl.constexpr, ODT: tl.constexpr, SAVE: tl.constexpr,
                           PULL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dblk = tl.program_id(1)
    d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if SAVE:
        keep = tl.load(save_flag_ptr) != 0
        save = tl.load(save_addr).to(tl.pointer_type(tl.bfloat16))
    if PULL:
        src = load_ptr(src_addr, tl.bfloat16)
        n_src = tl.load(src_n_ptr).to(tl.int64)
    for k in tl.static_range(K):
        eid = tl.load(ids_ptr + t * K + k).to(tl.int32)
        s = tl.load(scores_ptr + t * K + k).to(tl.float32)
        if PULL:    # the route's row where the W2 GEMM stored it (rows < n_src only: a call
            # whose routing check failed has n_src = 0 and unwritten route -> row entries)
            row = tl.load(src_rows_ptr + t * K + k).to(tl.int64)
            r = tl.load(src + row * D + d, mask=dm & (eid >= 0) & (row >= 0) & (row < n_src),
                        other=0.0)
        else:
            r = tl.load(routes_ptr + (t * K + k) * D + d, mask=dm & (eid >= 0), other=0.0)
        acc += tl.where(eid >= 0, s * r.to(tl.float32), 0.0)
        if SAVE:   # keep the route outputs for the score gradients (full-save layers)
            tl.store(save + (t * K + k) * D + d, r, mask=dm & (eid >= 0) & keep)
    tl.store(y_ptr + t * D + d, acc.to(ODT), mask=dm)


def combine_routes(routes_TKD: torch.Tensor | None, ids_TK: torch.Tensor,
                   scores_TK: torch.Tensor, y_TD: torch.Tensor,
                   save_addr: torch.Tensor | None = None, save_flag: torch.Tensor | None = None,
                   pull: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """y[t] = sum over active k of scores[t,k] * routes[t,k] in fp32 (inactive routes ignored).

    save_addr/save_flag (device pointer, device int): when save_flag != 0, the active route rows
    are also stored to save_addr [T, K, D] (one read of the routes serves both).
    pull = (src_addr, src_rows, num_rows): route (t, k) is row src_rows[t*K + k] (int32 [T*K],
    -1: none) of the bf16 rows [num_rows (device int), D] at the device pointer src_addr, where
    the expert GEMM stored it (routes_TKD then unused: None); rows >= num_rows read as zeros.
    """
    T, D = y_TD.shape
    K = ids_TK.shape[1]
    if T == 0:
        return
    if pull is not None:
        assert pull[1].dtype == torch.int32 and pull[1].numel() >= T * K, (
            f"pull rows: int32 [>= T*K = {T * K}], got {pull[1].dtype} [{pull[1].numel()}]")
    BLOCK_D = 1024
    grid = (T, triton.cdiv(D, BLOCK_D))
    save = save_addr is not None
    _combine_routes_kernel[grid](routes_TKD if pull is None else ids_TK, ids_TK, scores_TK, y_TD,
                                 save_addr if save else ids_TK, save_flag if save else ids_TK,
                                 *(pull if pull is not None else (ids_TK, ids_TK, ids_TK)), T,
                                 D=D, K=K, BLOCK_D=BLOCK_D, ODT=_TL_DTYPE[y_TD.dtype], SAVE=save,
                                 PULL=pull is not None, num_warps=4)


@triton.jit
def _publish_grad_routes_kernel(gy_ptr, routes_addr, ids_ptr, scores_ptr, grad_routes_ptr,
                                grad_scores_ptr, D: tl.constexpr, K: tl.constexpr,
                                BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d0 = tl.arange(0, BLOCK_D)
    routes_ptr = tl.load(routes_addr).to(tl.pointer_type(tl.bfloat16))
    for k in tl.static_range(K):
        eid = tl.load(ids_ptr + t * K + k).to(tl.int32)
        s = tl.load(scores_ptr + t * K + k).to(tl.float32)
        dot = tl.zeros([BLOCK_D], dtype=tl.float32)
        for c0 in range(0, D, BLOCK_D):
            d = c0 + d0
            dm = (d < D) & (eid >= 0)
            gy = tl.load(gy_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
            r = tl.load(routes_ptr + (t * K + k) * D + d, mask=dm, other=0.0).to(tl.float32)
            dot += gy * r
            tl.store(grad_routes_ptr + (t * K + k) * D + d, (s * gy).to(tl.bfloat16), mask=dm)
        tl.store(grad_scores_ptr + t * K + k, tl.sum(dot, axis=0))


def publish_grad_routes(gy_TD: torch.Tensor, routes_addr: torch.Tensor, ids_TK: torch.Tensor,
                        scores_TK: torch.Tensor, grad_routes_TKD: torch.Tensor,
                        grad_scores_TK: torch.Tensor) -> None:
    """grad_routes[t,k] = bf16(s * gy[t]) and grad_scores[t,k] = <gy[t], routes[t,k]> (fp32) for
    active routes; inactive routes get grad_score 0 and no grad_routes row. The route outputs
    [T, K, D] bf16 are read at the device address routes_addr (slot or combine buffer; may be
    grad_routes itself: each element is read before it is overwritten)."""
    T, D = gy_TD.shape
    K = ids_TK.shape[1]
    if T == 0:
        return
    _publish_grad_routes_kernel[(T,)](gy_TD, routes_addr, ids_TK, scores_TK, grad_routes_TKD,
                                      grad_scores_TK, D=D, K=K, BLOCK_D=1024, num_warps=4)


@triton.jit
def _publish_grad_y_kernel(gy_ptr, scores_ptr, out_ptr, own_scores_ptr,
                           D: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr,
                           K_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, K_PAD)
    km = k < K
    tl.store(own_scores_ptr + t * K + k, tl.load(scores_ptr + t * K + k, mask=km).to(tl.float32),
             mask=km)
    for c0 in range(0, D, BLOCK_D):
        d = c0 + tl.arange(0, BLOCK_D)
        dm = d < D
        gy = tl.load(gy_ptr + t * D + d, mask=dm, other=0.0)
        tl.store(out_ptr + t * D + d, gy.to(tl.bfloat16), mask=dm)


def publish_grad_y(gy_TD: torch.Tensor, scores_TK: torch.Tensor, out_TD: torch.Tensor,
                   own_scores_TK: torch.Tensor) -> None:
    """Owner side of the expert-side score gradients: out[t] = bf16(gy[t]) once per token (the
    experts read it for each of the token's routes; not scaled); own_scores[t,k] = scores[t,k]
    (fp32, for the experts to read); the experts write the score-gradient parts of every
    active route, and `sum_score_parts` skips the inactive ones."""
    T, D = gy_TD.shape
    K = scores_TK.shape[1]
    if T == 0:
        return
    _publish_grad_y_kernel[(T,)](gy_TD, scores_TK, out_TD, own_scores_TK,
                                 D=D, K=K, BLOCK_D=1024, K_PAD=max(2, triton.next_power_of_2(K)),
                                 num_warps=4)


@triton.jit
def _route_score_ptrs_kernel(combine_ptrs, num_rows_ptr, combine_base_ptr, routing_base_ptr,
                             score_out_ptr, gy_out_ptr, n, region_bytes, scores_offset,
                             EP: tl.constexpr, K: tl.constexpr, ROW_BYTES: tl.constexpr,
                             BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < tl.load(num_rows_ptr)
    c = tl.load(combine_ptrs + i, mask=live, other=0)
    score = tl.zeros([BLOCK], dtype=tl.int64)
    gy = tl.zeros([BLOCK], dtype=tl.int64)
    for r in tl.static_range(EP):
        base = tl.load(combine_base_ptr + r)
        inside = (c >= base) & (c < base + region_bytes) & (c != 0)
        route = (c - base) // ROW_BYTES
        score = tl.where(inside, tl.load(routing_base_ptr + r) + scores_offset + route * 4, score)
        gy = tl.where(inside, base + (route // K) * ROW_BYTES, gy)
    tl.store(score_out_ptr + i, score, mask=i < n)
    tl.store(gy_out_ptr + i, gy, mask=i < n)


def route_score_ptrs(combine_ptrs: torch.Tensor, num_rows: torch.Tensor,
                     combine_base_EP: torch.Tensor, combine_region_bytes: int,
                     routing_base_EP: torch.Tensor, scores_offset: int, row_bytes: int, K: int,
                     score_out: torch.Tensor, gy_out: torch.Tensor) -> None:
    """For received row i (route t*K + k of owner r, found from combine_ptrs[i]: r is the rank
    whose combine region holds it): score_out[i] = address of the owner's published score of
    that route; gy_out[i] = address of grad_y row t, which the owner publishes once per token
    at the start of its combine region (`publish_grad_y`). Both 0 for rows at or past num_rows
    or with combine address 0."""
    n = score_out.numel()
    if n == 0:
        return
    BLOCK = 256
    _route_score_ptrs_kernel[(triton.cdiv(n, BLOCK),)](
        combine_ptrs, num_rows, combine_base_EP, routing_base_EP, score_out, gy_out, n,
        combine_region_bytes, scores_offset, EP=combine_base_EP.numel(), K=K,
        ROW_BYTES=row_bytes, BLOCK=BLOCK, num_warps=4)


@triton.jit
def _score_grad_rows_kernel(u_addr, h2_addr, score_ptrs, num_rows_ptr, grad_delta,
                            F: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if row >= tl.load(num_rows_ptr):
        return
    sp = tl.load(score_ptrs + row)
    u_row = tl.load(u_addr).to(tl.pointer_type(tl.bfloat16)) + row * F
    h2_row = tl.load(h2_addr).to(tl.pointer_type(tl.bfloat16)) + row * F
    s = tl.load(sp.to(tl.pointer_type(tl.float32)), mask=sp != 0, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, F, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < F
        u = tl.load(u_row + c, mask=m, other=0.0).to(tl.float32)
        h = tl.load(h2_row + c, mask=m, other=0.0).to(tl.float32)
        acc += u * h
        tl.store(u_row + c, (s * u).to(tl.bfloat16), mask=m)
        tl.store(h2_row + c, (s * h).to(tl.bfloat16), mask=m)
    tl.store((sp + grad_delta).to(tl.pointer_type(tl.float32)), tl.sum(acc, axis=0),
             mask=sp != 0)


def score_grad_rows(u_addr: torch.Tensor, h2_addr: torch.Tensor, score_ptrs: torch.Tensor,
                    num_rows: torch.Tensor, F: int, grad_delta: int, max_rows: int) -> None:
    """Expert side, one program per row i < num_rows: with s = *score_ptrs[i] (fp32, the owner's
    score of the row's route), store grad_s = <u[i], h2[i]> (fp32) at score_ptrs[i] + grad_delta
    (the owner's score-gradient slot), then u[i] = bf16(s * u[i]) (grad_h2) and
    h2[i] = bf16(s * h2[i]) (the W2 WGRAD operand) in place. u, h2: bf16 [R, F] at device
    addresses."""
    if max_rows == 0:
        return
    _score_grad_rows_kernel[(max_rows,)](u_addr, h2_addr, score_ptrs, num_rows, grad_delta, F=F,
                                         BLOCK=min(1024, triton.next_power_of_2(F)), num_warps=4)


@triton.jit
def _sum_score_parts_kernel(parts_ptr, ids_ptr, out_ptr, n, n_parts, part_stride,
                            BLOCK: tl.constexpr, P_PAD: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    active = live & (tl.load(ids_ptr + i, mask=live, other=-1).to(tl.int32) >= 0)
    p = tl.arange(0, P_PAD).to(tl.int64)
    v = tl.load(parts_ptr + p[None, :] * part_stride + i[:, None],
                mask=active[:, None] & (p < n_parts)[None, :], other=0.0)
    # a fixed-shape tree over the parts: the same order on every run
    tl.store(out_ptr + i, tl.sum(v, axis=1), mask=live)


def sum_score_parts(parts: torch.Tensor, n_parts: int, ids_TK: torch.Tensor,
                    out_TK: torch.Tensor) -> None:
    """Owner side: out[t, k] = sum_j parts[j][t, k] (fp32) over the n_parts parts the experts
    wrote for route (t, k) (their W2 DGRAD n-tiles, or one from the torch engine); 0 for an
    inactive route (expert id -1: no expert wrote it). parts: the fp32 [P, T_max*K]-strided
    view of the routing region (first slice at its start), only slices < n_parts are read. A
    fixed summation order, so the score gradients are the same bits on every run."""
    T, K = out_TK.shape
    n = T * K
    if n == 0:
        return
    assert parts.dim() == 2 and parts.stride(1) == 1 and parts.shape[0] >= n_parts
    BLOCK = 128
    _sum_score_parts_kernel[(triton.cdiv(n, BLOCK),)](
        parts, ids_TK, out_TK, n, n_parts, parts.stride(0), BLOCK=BLOCK,
        P_PAD=max(2, triton.next_power_of_2(n_parts)), num_warps=4)


@triton.jit
def _reduce_routes_kernel(routes_ptr, ids_ptr, out_ptr, src_addr, src_rows_ptr, src_n_ptr,
                          D: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr,
                          ODT: tl.constexpr, PULL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if PULL:
        src = load_ptr(src_addr, tl.bfloat16)
        n_src = tl.load(src_n_ptr).to(tl.int64)
    for k in tl.static_range(K):
        eid = tl.load(ids_ptr + t * K + k).to(tl.int32)
        if PULL:    # the route's row where the DGRAD GEMM stored it (as combine_routes')
            row = tl.load(src_rows_ptr + t * K + k).to(tl.int64)
            r = tl.load(src + row * D + d, mask=dm & (eid >= 0) & (row >= 0) & (row < n_src),
                        other=0.0)
        else:
            r = tl.load(routes_ptr + (t * K + k) * D + d, mask=dm & (eid >= 0), other=0.0)
        acc += r.to(tl.float32)
    tl.store(out_ptr + t * D + d, acc.to(ODT), mask=dm)


def reduce_routes(routes_TKD: torch.Tensor | None, ids_TK: torch.Tensor, out_TD: torch.Tensor,
                  pull: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """out[t] = sum over active k of routes[t,k] in fp32 (input gradients returned per route).
    pull = (src_addr, src_rows, num_rows): as combine_routes' (routes_TKD then unused: None)."""
    T, D = out_TD.shape
    K = ids_TK.shape[1]
    if T == 0:
        return
    if pull is not None:
        assert pull[1].dtype == torch.int32 and pull[1].numel() >= T * K, (
            f"pull rows: int32 [>= T*K = {T * K}], got {pull[1].dtype} [{pull[1].numel()}]")
    BLOCK_D = 1024
    _reduce_routes_kernel[(T, triton.cdiv(D, BLOCK_D))](
        routes_TKD if pull is None else ids_TK, ids_TK, out_TD,
        *(pull if pull is not None else (ids_TK, ids_TK, ids_TK)), D=D, K=K, BLOCK_D=BLOCK_D,
        ODT=_TL_DTYPE[out_TD.dtype], PULL=pull is not None, num_warps=4)


# -- activation ------------------------------------------------------------------------------
@triton.jit
def _act_fwd(g, u, CLAMPED: tl.constexpr, alpha, limit):
    if CLAMPED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return g * tl.sigmoid(alpha * g) * (u + 1.0)
    else:
        return g * tl.sigmoid(g) * u


@triton.jit
def _swiglu_fwd_kernel(h1_addr, h2_addr, num_rows_ptr, F: tl.constexpr, CLAMPED: tl.constexpr,
                       alpha, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if row >= tl.load(num_rows_ptr):
        return
    h1 = tl.load(h1_addr).to(tl.pointer_type(tl.bfloat16))
    h2 = tl.load(h2_addr).to(tl.pointer_type(tl.bfloat16))
    for c0 in range(0, F, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < F
        g = tl.load(h1 + row * 2 * F + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(h1 + row * 2 * F + F + c, mask=m, other=0.0).to(tl.float32)
        tl.store(h2 + row * F + c, _act_fwd(g, u, CLAMPED, alpha, limit).to(tl.bfloat16), mask=m)


def swiglu_fwd(h1_addr: torch.Tensor, h2_addr: torch.Tensor, num_rows: torch.Tensor, F: int,
               max_rows: int, clamped: bool, alpha: float, limit: float) -> None:
    """h2[i] = act(h1[i, :F], h1[i, F:]) (bf16 in and out, fp32 math) for i < num_rows."""
    if max_rows:
        _swiglu_fwd_kernel[(max_rows,)](h1_addr, h2_addr, num_rows, F=F, CLAMPED=clamped,
                                        alpha=alpha, limit=limit,
                                        BLOCK=min(2048, triton.next_power_of_2(F)), num_warps=4)


@triton.jit
def swiglu_grad(g, u, dh, CLAMPED: tl.constexpr, alpha, limit):
    """(d act/dg * dh, d act/du * dh, act(g, u)) in fp32; shared by the row kernel below and
    the fused DGRAD epilogue of grouped_gemm.py, so both give the same bits."""
    if CLAMPED:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sg = tl.sigmoid(alpha * gc)
        glu = gc * sg
        dg = dh * (uc + 1.0) * (sg + alpha * gc * sg * (1.0 - sg))
        dg = tl.where(g < limit, dg, 0.0)  # torch.clamp convention: 0 at the bound
        du = dh * glu
        du = tl.where((u > -limit) & (u < limit), du, 0.0)
        h2v = glu * (uc + 1.0)
    else:
        sg = tl.sigmoid(g)
        silu = g * sg
        dg = dh * u * (sg + g * sg * (1.0 - sg))
        du = dh * silu
        h2v = silu * u
    return dg, du, h2v


@triton.jit
def _swiglu_bwd_kernel(h1_addr, gh2_addr, gh1_addr, h2_addr, num_rows_ptr, F: tl.constexpr,
                       CLAMPED: tl.constexpr, alpha, limit, STORE_H2: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if row >= tl.load(num_rows_ptr):
        return
    h1 = tl.load(h1_addr).to(tl.pointer_type(tl.bfloat16))
    gh2 = tl.load(gh2_addr).to(tl.pointer_type(tl.bfloat16))
    gh1 = tl.load(gh1_addr).to(tl.pointer_type(tl.bfloat16))
    for c0 in range(0, F, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < F
        g = tl.load(h1 + row * 2 * F + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(h1 + row * 2 * F + F + c, mask=m, other=0.0).to(tl.float32)
        dh = tl.load(gh2 + row * F + c, mask=m, other=0.0).to(tl.float32)
        dg, du, h2v = swiglu_grad(g, u, dh, CLAMPED, alpha, limit)
        tl.store(gh1 + row * 2 * F + c, dg.to(tl.bfloat16), mask=m)
        tl.store(gh1 + row * 2 * F + F + c, du.to(tl.bfloat16), mask=m)
        if STORE_H2:
            h2 = tl.load(h2_addr).to(tl.pointer_type(tl.bfloat16))
            tl.store(h2 + row * F + c, h2v.to(tl.bfloat16), mask=m)


def swiglu_bwd(h1_addr: torch.Tensor, grad_h2_addr: torch.Tensor, grad_h1_addr: torch.Tensor,
               num_rows: torch.Tensor, F: int, max_rows: int, clamped: bool, alpha: float,
               limit: float, h2_addr: torch.Tensor | None = None) -> None:
    """grad_h1 = d act / d h1 * grad_h2 (bf16 out). Optionally also rebuilds h2 from h1."""
    if max_rows:
        _swiglu_bwd_kernel[(max_rows,)](h1_addr, grad_h2_addr, grad_h1_addr,
                                        h2_addr if h2_addr is not None else h1_addr, num_rows,
                                        F=F, CLAMPED=clamped, alpha=alpha, limit=limit,
                                        STORE_H2=h2_addr is not None,
                                        BLOCK=min(1024, triton.next_power_of_2(F)), num_warps=4)

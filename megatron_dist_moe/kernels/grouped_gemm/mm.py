"""FPROP and DGRAD persistent grouped GEMMs with fused epilogues (Triton, Hopper first).

    grouped_mm_fwd    out[r, :] = a[r, :] @ w[e].T       w [E, N, Kd]  (FPROP: W13, W2 forward)
    grouped_mm_dgrad  out[r, :] = a[r, :] @ w[e]         w [E, Kd, N]  (DGRAD: W2, W13 backward)

A operand: dense `a` [R, Kd] (TMA or plain loads), or claim mode (`a_row_ptrs` + `a_copy_out` +
`claim_flags`, claim.py): the programs that reach an m-tile copy its rows from their addresses
into a_copy_out once and all its n-tiles read A densely from there.

Epilogues:
    store       out [R, N] dense at a device pointer
    swiglu      (W13 FPROP) h1 = [gate | up] rounded to the compute dtype (bf16 with
                nvfp4_scales), h2 = act(h1)
    scatter     row r to the address out_row_ptrs[r] (a peer's combine or dispatch row; 0: skip)
    swiglu_bwd  (W2 DGRAD) the grad_h2 tile never leaves the kernel: grad_h1 = act'(h1) grad_h2
                is written over h1 in place, h2 = act(h1) rebuilt for the W2 WGRAD; with
                `score_ptrs` also the expert-side score gradients (see grouped_mm_dgrad)

The compute dtype is the dtype of `w` (bf16 in production; fp32/fp16 in the kernel tests).
Accumulation is always fp32. In the CPU interpreter, whose bf16 `tl.dot` is broken, operands are
widened to fp32 before the dot (`_dot`), which forms the same exact products.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..checks import max_polls
from ..common import (as_device_ptr, check_offsets, check_rows, default_num_programs,
                      ensure_tma_allocator, interpreting, load_ptr)
from ...memory_plan import SCORE_PART_COLS
from ..quant_fp8 import round_bf16
from ..rows import _act_fwd, swiglu_grad
from ..checks import check_status
from .claim import ClaimFlags, claim_ahead_phase, claim_slices_phase
from .config import GroupedGemmConfig, select_config
from .tiles import expert_segments, tile_bound, tile_coords, tile_list

__all__ = ["grouped_mm_fwd", "grouped_mm_dgrad", "EPILOGUES", "ACTIVATIONS",
           "score_parts_count"]

EPILOGUES = ("store", "swiglu", "scatter", "swiglu_bwd")
ACTIVATIONS = ("swiglu", "swiglu_clamped")
_EPI_SWIGLU = 1


def score_parts_count(F: int, config: GroupedGemmConfig) -> int:
    """Partial score-gradient sums per route that the swiglu_bwd epilogue writes (one per n-tile
    of the W2 DGRAD, whose output width is F): at most memory_plan.score_parts_count(F)."""
    return triton.cdiv(F, config.block_n)


@dataclass(frozen=True)
class _MMArgs:
    """Validated arguments of one `_grouped_mm_kernel` launch (tensors plus constexprs)."""

    a_addr: torch.Tensor  # int64 [1] device pointer: dense A, or the claim copy
    a_rows: torch.Tensor  # claim mode: int64 [>= R] row addresses; else a dummy
    w: torch.Tensor
    offsets: torch.Tensor
    out_addr: torch.Tensor
    out2_addr: torch.Tensor
    out_rows: torch.Tensor
    n: int  # output width per half (F for swiglu)
    kd: int
    num_experts: int
    max_rows: int
    claim: Optional[ClaimFlags]
    w_kn: bool  # DGRAD orientation w [E, Kd, N]
    epilogue: int
    store_aux: bool  # swiglu: also store h1 (pre-activation); swiglu_bwd: also store h2
    activation: int
    alpha: float
    limit: float
    score_grads: bool = False  # swiglu_bwd: expert-side score gradients (out_rows = score ptrs)
    score_grad_delta: int = 0  # bytes from a route's score to its first score-gradient part
    part_stride: int = 0       # bytes between consecutive parts of one route
    a_tail: int = 0            # rows readable past R at A (its TMA descriptor spans them)
    # NVFP4 operands decoded to fp16 (nvfp4_dense.py): the store / scatter / swiglu epilogue
    # multiplies row r by the fp32 S_dec at byte nv_offset of byte row r of nv_rows (nv_stride
    # bytes apart) and by 1 / S_enc[e] (nv_senc; set: NV_SCALE), and stores bf16
    nv_rows: Optional[torch.Tensor] = None
    nv_stride: int = 0
    nv_offset: int = 0
    nv_senc: Optional[torch.Tensor] = None


def _prepare(*, w_kn, w, expert_offsets, max_rows, a, a_row_ptrs, a_copy_out, epilogue, out,
             out_row_ptrs, h1, h2, activation, swiglu_alpha, swiglu_limit,
             claim_flags=None, score_ptrs=None, score_grad_delta=0, part_stride=0,
             a_tail_rows=0, nvfp4_scales=None) -> _MMArgs:
    assert w.dim() == 3 and w.is_contiguous(), "w must be a contiguous [E, *, *] tensor"
    dev, dt = w.device, w.dtype
    num_experts = w.shape[0]
    check_offsets(expert_offsets, num_experts, dev)
    assert epilogue in EPILOGUES, f"epilogue must be one of {EPILOGUES}, got {epilogue!r}"
    assert activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}"
    assert max_rows >= 0, "max_rows is a host upper bound on R"
    if w_kn:
        kd, n = w.shape[1], w.shape[2]
        assert epilogue != "swiglu", "the swiglu epilogue is an FPROP (W13) epilogue"
    elif epilogue == "swiglu":
        assert w.shape[1] % 2 == 0, "swiglu: w must be W13 [E, 2F, D]"
        kd, n = w.shape[2], w.shape[1] // 2
    else:
        kd, n = w.shape[2], w.shape[1]
    assert kd % 16 == 0 and n % 8 == 0, f"Kd={kd} must be a multiple of 16 and N={n} of 8"
    assert isinstance(a_tail_rows, int) and a_tail_rows >= 0, (
        f"a_tail_rows={a_tail_rows!r}: rows readable past R at A, an int >= 0")
    dense_a = a if claim_flags is None else a_copy_out
    if a_tail_rows and dense_a is not None and not (dense_a.dtype == torch.int64
                                                     and dense_a.numel() == 1):
        assert dense_a.dim() == 2 and dense_a.shape[0] >= max_rows + a_tail_rows, (
            f"a_tail_rows={a_tail_rows}: A {tuple(dense_a.shape)} must hold max_rows + "
            f"a_tail_rows = {max_rows + a_tail_rows} rows")

    dummy = expert_offsets  # never dereferenced when its constexpr path is off
    a_rows = dummy
    if claim_flags is not None:
        assert isinstance(claim_flags, ClaimFlags), "claim_flags must be a ClaimFlags"
        assert a is None and a_row_ptrs is not None and a_copy_out is not None, (
            "claim mode needs a_row_ptrs (rows to gather) and a_copy_out (where they land; the "
            "GEMM then reads A from there), and no dense a")
        check_rows(a_row_ptrs, "a_row_ptrs", max_rows, dev)
        a_addr, a_rows = as_device_ptr(a_copy_out, "a_copy_out", dt), a_row_ptrs
    else:
        assert a is not None and a_row_ptrs is None and a_copy_out is None, (
            "give a dense `a`, or claim mode (a_row_ptrs + a_copy_out + claim_flags)")
        a_addr = as_device_ptr(a, "a", dt)

    out_addr = out2_addr = out_rows = dummy
    store_aux = False
    nv = {}
    out_dt = dt
    if nvfp4_scales is not None:
        nv_rows, nv_stride, nv_senc = nvfp4_scales
        assert epilogue in ("store", "scatter", "swiglu") and not w_kn and claim_flags is None, (
            "nvfp4_scales go with a dense FPROP's store, scatter or swiglu epilogue")
        assert dt == torch.float16, "nvfp4_scales: the decoded operands are fp16"
        assert (nv_senc.dtype == torch.float32 and nv_senc.is_contiguous()
                and nv_senc.numel() == num_experts and nv_senc.device == dev), (
            f"nvfp4_scales: S_enc must be a contiguous fp32 [{num_experts}] on the weights' device")
        nv = dict(nv_rows=as_device_ptr(nv_rows, "nvfp4_scales rows"), nv_stride=int(nv_stride),
                  nv_offset=kd // 2 + kd // 16, nv_senc=nv_senc)
        out_dt = torch.bfloat16
    if epilogue == "store":
        assert out is not None, "epilogue='store' needs out (device pointer to [R, N])"
        out_addr = as_device_ptr(out, "out", out_dt)
    elif epilogue == "swiglu":
        assert h2 is not None, "epilogue='swiglu' needs h2 (device pointer to [R, F])"
        out2_addr = as_device_ptr(h2, "h2", out_dt)
        if h1 is not None:
            out_addr, store_aux = as_device_ptr(h1, "h1", out_dt), True
    elif epilogue == "swiglu_bwd":
        assert w_kn, "the swiglu_bwd epilogue is a W2 DGRAD epilogue"
        assert h1 is not None, "epilogue='swiglu_bwd' needs h1 (device pointer to [R, 2F])"
        out_addr = as_device_ptr(h1, "h1", dt)
        if h2 is not None:  # also rebuild h2 = act(h1) for the W2 WGRAD
            out2_addr, store_aux = as_device_ptr(h2, "h2", dt), True
        if score_ptrs is not None:
            check_rows(score_ptrs, "score_ptrs", max_rows, dev)
            out_rows = score_ptrs
    else:
        assert out_row_ptrs is not None, "epilogue='scatter' needs out_row_ptrs"
    assert score_ptrs is None or epilogue == "swiglu_bwd", (
        "score_ptrs (expert-side score gradients) go with epilogue='swiglu_bwd' only")
    if epilogue == "scatter":
        check_rows(out_row_ptrs, "out_row_ptrs", max_rows, dev)
        out_rows = out_row_ptrs
    return _MMArgs(
        a_addr=a_addr, a_rows=a_rows, w=w, offsets=expert_offsets, out_addr=out_addr,
        out2_addr=out2_addr, out_rows=out_rows, n=n, kd=kd, num_experts=num_experts,
        max_rows=max_rows, claim=claim_flags, w_kn=w_kn,
        epilogue=EPILOGUES.index(epilogue), store_aux=store_aux,
        activation=ACTIVATIONS.index(activation), alpha=float(swiglu_alpha),
        limit=float(swiglu_limit), score_grads=score_ptrs is not None,
        score_grad_delta=int(score_grad_delta), part_stride=int(part_stride),
        a_tail=a_tail_rows, **nv)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _swiglu_bwd_tile(dh, rows64, row_ok, cols, h1_base, h2_addr_ptr, N, alpha, limit,
                     DT: tl.constexpr, CLAMPED: tl.constexpr, STORE_H2: tl.constexpr):
    """grad_h1 = [dg | du] over h1 = [g | u] in place for one column block of a grad_h2 tile
    (dh, already rounded to DT); optionally h2 = act(g, u) too (`rows.swiglu_grad` math)."""
    mask = row_ok[:, None] & (cols < N)[None, :]
    g_ptrs = h1_base + rows64[:, None] * (2 * N) + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    dg, du, h2v = swiglu_grad(g, u, dh.to(tl.float32), CLAMPED, alpha, limit)
    tl.store(g_ptrs, dg.to(DT), mask=mask)
    tl.store(g_ptrs + N, du.to(DT), mask=mask)
    if STORE_H2:  # the same bits as rows.swiglu_fwd
        h2_base = load_ptr(h2_addr_ptr, DT)
        tl.store(h2_base + rows64[:, None] * N + cols[None, :], h2v.to(DT), mask=mask)


@triton.jit
def _swiglu_bwd_tile_scored(gu, s, rows64, row_ok, cols, h1_base, h2_addr_ptr, N, alpha, limit,
                            DT: tl.constexpr, CLAMPED: tl.constexpr, STORE_H2: tl.constexpr):
    """Expert-side score gradients (Config.save_route_outputs=False) for one column block of
    u = W2^T grad_y (fp32, unscaled): grad_h2 = s u (rounded to DT) goes through the SwiGLU
    backward in place over h1 as in `_swiglu_bwd_tile`; h2 is stored scaled (s h2, the W2
    WGRAD operand against the unscaled grad_y rows). Returns this block's <u, h2> per row."""
    mask = row_ok[:, None] & (cols < N)[None, :]
    g_ptrs = h1_base + rows64[:, None] * (2 * N) + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    dh = (s[:, None] * gu).to(DT).to(tl.float32)
    dg, du, h2v = swiglu_grad(g, u, dh, CLAMPED, alpha, limit)
    tl.store(g_ptrs, dg.to(DT), mask=mask)
    tl.store(g_ptrs + N, du.to(DT), mask=mask)
    if STORE_H2:
        h2_base = load_ptr(h2_addr_ptr, DT)
        tl.store(h2_base + rows64[:, None] * N + cols[None, :], (s[:, None] * h2v).to(DT),
                 mask=mask)
    return tl.sum(tl.where(mask, gu * h2v.to(DT).to(tl.float32), 0.0), axis=1)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 operands, or the CPU interpreter: exact fp32 products, no tf32 rounding
        # NOTE: the interpreter's bf16 dot returns garbage; bf16 (and fp16) operands are widened
        # to fp32 first there, which is exactly the products the tensor cores form.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _quarters(x, BLOCK_M: tl.constexpr, Q: tl.constexpr):
    """The four Q-wide column quarters of a [BLOCK_M, 4Q] tile."""
    x4 = tl.reshape(x, (BLOCK_M, 2, 2, Q))
    lo, hi = tl.split(tl.permute(x4, (0, 2, 3, 1)))     # column halves
    x0, x1 = tl.split(tl.permute(lo, (0, 2, 1)))        # quarters of each
    x2, x3 = tl.split(tl.permute(hi, (0, 2, 1)))
    return x0, x1, x2, x3


@triton.jit
def _grouped_mm_kernel(
    a_addr_ptr, a_rows_ptr, w_ptr, offsets_ptr,
    out_addr_ptr, out2_addr_ptr, out_rows_ptr, claimed_ptr, copied_ptr, epoch_ptr, status_ptr,
    N, Kd, alpha, limit, score_grad_delta, part_stride, polls_max, rank, a_tail,
    nv_rows_ptr, nv_stride, nv_offset, nv_senc_ptr,
    E: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_KN: tl.constexpr, EPILOGUE: tl.constexpr, STORE_AUX: tl.constexpr, ACT: tl.constexpr,
    USE_TMA: tl.constexpr, IEEE: tl.constexpr,
    A_CLAIM: tl.constexpr = False, CLAIM_AHEAD: tl.constexpr = 0, COPY_K: tl.constexpr = 64,
    PROXY_FENCE: tl.constexpr = False, SLICE_K: tl.constexpr = 512,
    AHEAD_SLICES: tl.constexpr = 1, SCORE_GRADS: tl.constexpr = False,
    ON_GPU: tl.constexpr = False, NV_SCALE: tl.constexpr = False):
    # A_CLAIM: a_addr_ptr is a_copy_out, read as a dense A once `claim_slices_phase` made the
    # tile's rows valid; a_rows_ptr gives the rows to copy there (claim.py).
    DT: tl.constexpr = w_ptr.dtype.element_ty
    ODT: tl.constexpr = tl.bfloat16 if NV_SCALE else DT   # the store / scatter / swiglu output
    SWIGLU: tl.constexpr = EPILOGUE == 1
    BN: tl.constexpr = BLOCK_N // 2 if SWIGLU else BLOCK_N  # width of each accumulator
    W_ROWS = 2 * N if SWIGLU else N  # FPROP: rows of w[e]
    pid = tl.program_id(0)

    # Tile list from the device offsets: expert e owns tiles [cum[e] - tiles[e], cum[e]).
    e_idx, starts, ends, m_tiles = expert_segments(offsets_ptr, E, E_PAD, BLOCK_M)
    num_n = tl.cdiv(N, BN)
    tiles, cum, total = tile_list(m_tiles, num_n)
    nprog = tl.num_programs(0)
    if A_CLAIM:
        slice_base = tl.load(epoch_ptr) << 20  # ClaimFlags.SLICE_SHIFT

    a_base = load_ptr(a_addr_ptr, DT)
    if USE_TMA:
        # a_tail rows past R are readable (the caller's promise, e.g. the per-call layout's
        # GEMM_A_TAIL_ROWS): a box over them reads rows never stored instead of taking the
        # out-of-bounds path, which is slower the more of the box lies outside
        num_rows = tl.maximum(tl.load(offsets_ptr + E) + a_tail, 1)
        a_desc = tl.make_tensor_descriptor(a_base, shape=[num_rows, Kd], strides=[Kd, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        if W_KN:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * Kd, N], strides=[N, 1],
                                               block_shape=[BLOCK_K, BN])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * W_ROWS, Kd], strides=[Kd, 1],
                                               block_shape=[BN, BLOCK_K])
    offs_k = tl.arange(0, BLOCK_K)

    for t in tl.range(pid, total, nprog):
        e, row_start, row_end, m_first, pid_m, pid_n = tile_coords(
            t, e_idx, cum, tiles, starts, ends, m_tiles, num_n, GROUP_M)
        row0 = row_start + pid_m * BLOCK_M
        if A_CLAIM:
            if CLAIM_AHEAD > 0:
                t2 = t + CLAIM_AHEAD * nprog
                if t2 < total:
                    _e2, row_start2, row_end2, m_first2, pid_m2, _n2 = tile_coords(
                        t2, e_idx, cum, tiles, starts, ends, m_tiles, num_n, GROUP_M)
                    claim_ahead_phase(row_start2 + pid_m2 * BLOCK_M, row_end2,
                                      m_first2 + pid_m2, claimed_ptr, copied_ptr, slice_base,
                                      a_rows_ptr, a_base, Kd, DT, BLOCK_M, COPY_K, SLICE_K,
                                      AHEAD_SLICES, PROXY_FENCE)
            claim_slices_phase(row0, row_end, m_first + pid_m, claimed_ptr, copied_ptr,
                               slice_base, a_rows_ptr, a_base, Kd, polls_max, rank, status_ptr,
                               DT, BLOCK_M, COPY_K, SLICE_K, PROXY_FENCE, ON_GPU)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        cols = pid_n * BN + tl.arange(0, BN)
        col_ok = cols < N
        # NOTE: clamped indices keep dense-A and FPROP weight loads in bounds without masks (the
        # extra rows/cols compute values that the epilogue never stores). Clamping breaks
        # contiguity, so it is only used along non-contiguous dims; DGRAD weights use a mask.
        cols_ld = tl.minimum(cols, N - 1)
        if not USE_TMA:
            rows_ld = tl.minimum(rows, row_end - 1).to(tl.int64)
            a_ptrs = a_base + rows_ld[:, None] * Kd + offs_k[None, :]

        w_e = w_ptr + e.to(tl.int64) * W_ROWS * Kd
        if W_KN:  # w[e] is [Kd, N], contiguous along N
            b_ptrs = w_e + offs_k[:, None] * N + cols[None, :]
        else:  # w[e] is [W_ROWS, Kd], contiguous along Kd; tile loaded as [BLOCK_K, BN]
            b_ptrs = w_e + cols_ld[None, :].to(tl.int64) * Kd + offs_k[:, None]
            if SWIGLU:
                b2_ptrs = b_ptrs + N * Kd  # the up half: rows F + n

        acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
        if SWIGLU:
            acc2 = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
        for k in tl.range(0, Kd, BLOCK_K):
            if USE_TMA:
                a = a_desc.load([row0, k])
            else:
                a = tl.load(a_ptrs)
                a_ptrs += BLOCK_K
            if USE_TMA:
                if W_KN:
                    b = w_desc.load([e * Kd + k, pid_n * BN])
                else:
                    b = w_desc.load([e * W_ROWS + pid_n * BN, k]).T
                    if SWIGLU:
                        b2 = w_desc.load([e * W_ROWS + N + pid_n * BN, k]).T
            elif W_KN:
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
                b_ptrs += BLOCK_K * N
            else:
                b = tl.load(b_ptrs)
                b_ptrs += BLOCK_K
                if SWIGLU:
                    b2 = tl.load(b2_ptrs)
                    b2_ptrs += BLOCK_K
            acc = _dot(a, b, acc, IEEE)
            if SWIGLU:
                acc2 = _dot(a, b2, acc2, IEEE)

        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        if NV_SCALE:
            # the two NVFP4 global decode scales, in nvfp4.py's order: (acc x S_dec(row)) x
            # S_dec(e), S_dec(e) = 1 / S_enc[e] correctly rounded, read each launch
            s_row = tl.load((load_ptr(nv_rows_ptr, tl.uint8)
                             + tl.minimum(rows, row_end - 1).to(tl.int64) * nv_stride
                             + nv_offset).to(tl.pointer_type(tl.float32)))
            if SWIGLU:
                s_e = tl.math.div_rn(1.0, tl.load(nv_senc_ptr + e))
                acc = acc * s_row[:, None] * s_e
                acc2 = acc2 * s_row[:, None] * s_e
            else:   # (this form keeps the store / scatter tile at 233 registers, not 255)
                acc = acc * s_row[:, None] * tl.math.div_rn(1.0, tl.load(nv_senc_ptr + e))
        if EPILOGUE == 0:  # dense store, row stride N
            out_base = load_ptr(out_addr_ptr, ODT)
            tl.store(out_base + rows64[:, None] * N + cols[None, :], acc.to(ODT), mask=mask)
        elif EPILOGUE == 1:  # h1 [R, 2F] (gate | up), h2 [R, F]
            # (ODT: the compute dtype, or bf16 for NVFP4's fp16 operands)
            g = acc.to(ODT)
            u = acc2.to(ODT)
            if STORE_AUX:
                h1_ptrs = (load_ptr(out_addr_ptr, ODT)
                           + rows64[:, None] * (2 * N) + cols[None, :])
                tl.store(h1_ptrs, g, mask=mask)
                tl.store(h1_ptrs + N, u, mask=mask)
            # NOTE: the activation reads the rounded h1, exactly what backward will reload (and
            # what quant_nvfp4.swiglu_quant computes from a stored bf16 h1).
            h = _act_fwd(g.to(tl.float32), u.to(tl.float32), ACT == 1, alpha, limit)
            if NV_SCALE:   # nearest even in the interpreter too, as quant_nvfp4.swiglu_quant
                h = round_bf16(h, ON_GPU)
            h2_base = load_ptr(out2_addr_ptr, ODT)
            tl.store(h2_base + rows64[:, None] * N + cols[None, :], h.to(ODT), mask=mask)
        elif EPILOGUE == 3 and SCORE_GRADS:
            # W2 DGRAD with expert-side score gradients: acc is u = W2^T grad_y (unscaled);
            # out_rows_ptr holds each row's address of its owner's score. This tile's share of
            # <u, h2> per row goes to the owner's part slot pid_n of that route (score address
            # + score_grad_delta + pid_n * part_stride bytes); the owner sums the parts in a
            # fixed order (`rows.sum_score_parts`): atomics would make it differ run to run.
            Q: tl.constexpr = BN // 4
            s_addr = tl.load(out_rows_ptr + rows, mask=row_ok, other=0)
            s_ok = row_ok & (s_addr != 0)
            s = tl.load(s_addr.to(tl.pointer_type(tl.float32)), mask=s_ok, other=0.0)
            gu_0, gu_1, gu_2, gu_3 = _quarters(acc, BLOCK_M, Q)
            h1_base = load_ptr(out_addr_ptr, DT)
            c0 = pid_n * BN + tl.arange(0, Q)
            part = _swiglu_bwd_tile_scored(gu_0, s, rows64, row_ok, c0, h1_base, out2_addr_ptr,
                                           N, alpha, limit, DT, ACT == 1, STORE_AUX)
            part += _swiglu_bwd_tile_scored(gu_1, s, rows64, row_ok, c0 + Q, h1_base,
                                            out2_addr_ptr, N, alpha, limit, DT, ACT == 1,
                                            STORE_AUX)
            part += _swiglu_bwd_tile_scored(gu_2, s, rows64, row_ok, c0 + 2 * Q, h1_base,
                                            out2_addr_ptr, N, alpha, limit, DT, ACT == 1,
                                            STORE_AUX)
            part += _swiglu_bwd_tile_scored(gu_3, s, rows64, row_ok, c0 + 3 * Q, h1_base,
                                            out2_addr_ptr, N, alpha, limit, DT, ACT == 1,
                                            STORE_AUX)
            p_addr = (s_addr + (score_grad_delta + pid_n.to(tl.int64) * part_stride)).to(
                tl.pointer_type(tl.float32))
            if ON_GPU:
                # NOTE: an exchange, not a plain store: each slot is written once either way,
                # and the store made ptxas spill 356 B here against 88 B (sm_90, this tile)
                tl.atomic_xchg(p_addr, part, mask=s_ok, sem="relaxed")
            else:   # the interpreter has no float exchange
                tl.store(p_addr, part, mask=s_ok)
        elif EPILOGUE == 3:  # W2 DGRAD + SwiGLU backward: h1 [R, 2F] -> grad_h1, in place
            # NOTE: acc is grad_h2; it is rounded to the dtype first, exactly what a separate
            # DGRAD would store and `rows.swiglu_bwd` reload, so both give the same bits. Each
            # h1 element is read and overwritten by the one program that owns its tile. The
            # tile is processed in column quarters: a whole 128x256 tile's g, u, dg, du (fp32)
            # do not fit in registers next to each other (ptxas: ~6.5 KB of spills).
            Q: tl.constexpr = BN // 4
            dh_0, dh_1, dh_2, dh_3 = _quarters(acc.to(DT), BLOCK_M, Q)
            h1_base = load_ptr(out_addr_ptr, DT)
            c0 = pid_n * BN + tl.arange(0, Q)
            _swiglu_bwd_tile(dh_0, rows64, row_ok, c0, h1_base, out2_addr_ptr, N, alpha, limit,
                             DT, ACT == 1, STORE_AUX)
            _swiglu_bwd_tile(dh_1, rows64, row_ok, c0 + Q, h1_base, out2_addr_ptr, N, alpha,
                             limit, DT, ACT == 1, STORE_AUX)
            _swiglu_bwd_tile(dh_2, rows64, row_ok, c0 + 2 * Q, h1_base, out2_addr_ptr, N, alpha,
                             limit, DT, ACT == 1, STORE_AUX)
            _swiglu_bwd_tile(dh_3, rows64, row_ok, c0 + 3 * Q, h1_base, out2_addr_ptr, N, alpha,
                             limit, DT, ACT == 1, STORE_AUX)
        else:  # scatter: row i to address out_rows[i], skipped when 0
            o_addr = tl.load(out_rows_ptr + rows, mask=row_ok, other=0)
            o_row_base = tl.multiple_of(o_addr.to(tl.pointer_type(ODT)), [16])
            o_ptrs = o_row_base[:, None] + cols[None, :]
            tl.store(o_ptrs, acc.to(ODT), mask=(o_addr != 0)[:, None] & col_ok[None, :])


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _launch_mm(args: _MMArgs, config: GroupedGemmConfig, num_programs: Optional[int],
               timeout_s: float, rank: int) -> None:
    w = args.w
    bn = config.block_n // 2 if args.epilogue == _EPI_SWIGLU else config.block_n
    assert args.kd % config.block_k == 0, (
        f"Kd={args.kd} must be a multiple of block_k={config.block_k} (the K loop is unmasked)")
    if args.epilogue == _EPI_SWIGLU:
        assert config.block_n % 32 == 0, "swiglu needs block_n >= 32 (two halves of >= 16)"
    if args.score_grads:
        assert bn >= SCORE_PART_COLS, (
            f"block_n={bn}: the score-gradient parts are counted for tiles of at least "
            f"{SCORE_PART_COLS} columns (memory_plan.score_parts_count)")
    num_n = triton.cdiv(args.n, bn)
    progs = num_programs or default_num_programs(w.device)
    grid = (max(1, min(progs, tile_bound(args.max_rows, config.block_m, args.num_experts,
                                         num_n))),)
    if config.tma and w.device.type == "cuda":
        ensure_tma_allocator()
    claimed = copied = epoch = status = args.offsets  # dummies unless claiming
    copy_k, slice_k = config.copy_k, config.slice_k
    if args.claim is not None:
        args.claim.check(max_rows=args.max_rows, block_m=config.block_m,
                         num_experts=args.num_experts, device=w.device)
        claimed, copied = args.claim.claimed, args.claim.copied
        epoch, status = args.claim.epoch, args.claim.status
        # NOTE: at most 128 elements per thread per step: 128x512 with 8 warps spills (sm_90
        # PTX, 255 registers) while 128x256 does not. Kd is a multiple of block_k (a power of
        # two >= 16), so halving reaches a divisor of Kd.
        copy_k = min(copy_k, max(16, 128 * 32 * config.num_warps // config.block_m))
        while args.kd % copy_k:
            copy_k //= 2
        slice_k = min(slice_k, args.kd)
        while args.kd % slice_k:
            slice_k //= 2
        copy_k = min(copy_k, slice_k)
        assert args.kd // slice_k < 2 ** (ClaimFlags.SLICE_SHIFT - 2)
        args.claim.next_epoch()  # stream-ordered before the kernel; captured by CUDA graphs
    on_gpu = w.device.type == "cuda" and not interpreting()
    _grouped_mm_kernel[grid](
        a_addr_ptr=args.a_addr, a_rows_ptr=args.a_rows, w_ptr=w, offsets_ptr=args.offsets,
        out_addr_ptr=args.out_addr, out2_addr_ptr=args.out2_addr, out_rows_ptr=args.out_rows,
        claimed_ptr=claimed, copied_ptr=copied, epoch_ptr=epoch, status_ptr=status,
        N=args.n, Kd=args.kd, alpha=args.alpha, limit=args.limit,
        score_grad_delta=args.score_grad_delta, part_stride=args.part_stride,
        polls_max=max_polls(timeout_s), rank=rank, a_tail=args.a_tail,
        nv_rows_ptr=args.nv_rows if args.nv_rows is not None else args.offsets,
        nv_stride=args.nv_stride, nv_offset=args.nv_offset,
        nv_senc_ptr=args.nv_senc if args.nv_senc is not None else args.offsets,
        E=args.num_experts, E_PAD=max(2, triton.next_power_of_2(args.num_experts)),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, W_KN=args.w_kn, EPILOGUE=args.epilogue,
        STORE_AUX=args.store_aux, ACT=args.activation, USE_TMA=config.tma,
        IEEE=w.dtype == torch.float32 or interpreting(),
        A_CLAIM=args.claim is not None, CLAIM_AHEAD=config.claim_ahead, COPY_K=copy_k,
        PROXY_FENCE=args.claim is not None and config.tma and on_gpu,
        SLICE_K=slice_k, AHEAD_SLICES=config.claim_ahead_slices, SCORE_GRADS=args.score_grads,
        ON_GPU=on_gpu, NV_SCALE=args.nv_senc is not None,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if args.claim is not None and on_gpu:
        check_status(args.claim.status)   # a wait that timed out traps here, with its numbers


def grouped_mm_fwd(
    *,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    max_rows: int,
    a: Optional[torch.Tensor] = None,
    a_row_ptrs: Optional[torch.Tensor] = None,
    a_copy_out: Optional[torch.Tensor] = None,
    epilogue: str = "store",
    out: Optional[torch.Tensor] = None,
    out_row_ptrs: Optional[torch.Tensor] = None,
    h1: Optional[torch.Tensor] = None,
    h2: Optional[torch.Tensor] = None,
    activation: str = "swiglu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    config: Optional[GroupedGemmConfig] = None,
    num_programs: Optional[int] = None,
    claim_flags: Optional[ClaimFlags] = None,
    timeout_s: float = 600.0,
    rank: int = 0,
    a_tail_rows: int = 0,
    nvfp4_scales: Optional[tuple] = None,
) -> None:
    """FPROP grouped GEMM: row r of expert e gets a[r] @ w[e].T (fp32 accumulation).

    w               [E, N, Kd] contiguous, compute dtype (bf16; fp32/fp16 for the interpreter).
                    For epilogue="swiglu" this is W13 [E, 2F, D] (gate rows [0, F), up [F, 2F)).
    expert_offsets  int32 [E+1] device, cumulative row ends (psum[E] = R, never read on host).
    max_rows        host upper bound on R; only sizes the grid (tiles past R do nothing).
    a               A [R, Kd] (row stride Kd): device pointer (int64 [1]) or dense tensor.
    a_row_ptrs, a_copy_out, claim_flags
                    instead of a, claim mode (claim.py): int64 [>= max_rows] absolute row
                    addresses (0 -> zero row), the device pointer of the copy [R, Kd] that the
                    GEMM then reads as A, and a `ClaimFlags` built for max_rows, this config's
                    block_m (or smaller) and E. Advances claim_flags' epoch before the kernel.
    epilogue        "store":   out (device pointer to [R, N], row stride N) = result.
                    "swiglu":  h1 (optional device pointer to [R, 2F]) = [gate | up] rounded to
                               the compute dtype; h2 (device pointer to [R, F]) = act(h1).
                    "scatter": result row r written to address out_row_ptrs[r] (int64
                               [>= max_rows]); rows whose address is 0 are skipped.
    activation      "swiglu": silu(g) * u; "swiglu_clamped": g = min(g, limit),
                    u = clamp(u, -limit, limit), h2 = g * sigmoid(alpha * g) * (u + 1).
    config          tile config; default from `select_config("fwd", ...)` (the decode tiles
                    when max_rows / E is small, outside claim mode).
    num_programs    persistent grid size; default the SM count.
    timeout_s, rank claim mode: a wait for another program's slice copy gives up after
                    timeout_s and traps naming the m-tile and `rank` (checks.py).
    a_tail_rows     rows readable past R at A (a, or a_copy_out in claim mode; a dense tensor
                    must then hold max_rows + a_tail_rows rows): TMA loads span them, so a
                    tile past R reads rows whose results are never stored instead of taking
                    TMA's slower out-of-bounds path (the per-call layout keeps
                    layout.GEMM_A_TAIL_ROWS rows there for an inference call's A operands).
    nvfp4_scales    (rows, row_bytes, S_enc): the operands are NVFP4 values decoded to fp16
                    before their global scales (a and w fp16; nvfp4_dense.py). The epilogue
                    (store, scatter or swiglu) multiplies row r by the fp32 S_dec of NVFP4 byte
                    row r of `rows` (tensor or device pointer, row_bytes apart:
                    layout.nvfp4_row_bytes(Kd)) and by 1 / S_enc[e] (fp32 [E]), and stores bf16
                    (nvfp4.py's epilogue; swiglu: h1 rounded to bf16, h2 = act(h1) in bf16).
    """
    args = _prepare(w_kn=False, w=w, expert_offsets=expert_offsets, max_rows=max_rows, a=a,
                    a_row_ptrs=a_row_ptrs, a_copy_out=a_copy_out, epilogue=epilogue, out=out,
                    out_row_ptrs=out_row_ptrs, h1=h1, h2=h2, activation=activation,
                    swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                    claim_flags=claim_flags, a_tail_rows=a_tail_rows, nvfp4_scales=nvfp4_scales)
    width = 2 * args.n if epilogue == "swiglu" else args.n
    # the claimed (staged) FPROP keeps the training tiles its claim schedule was measured with
    rows = None if claim_flags is not None else -(-max_rows // w.shape[0])
    config = config or select_config("fwd", n=width, kd=args.kd, device=w.device,
                                     rows_per_expert=rows)
    _launch_mm(args, config, num_programs, timeout_s, rank)


def grouped_mm_dgrad(
    *,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    max_rows: int,
    a: Optional[torch.Tensor] = None,
    a_row_ptrs: Optional[torch.Tensor] = None,
    a_copy_out: Optional[torch.Tensor] = None,
    epilogue: str = "store",
    out: Optional[torch.Tensor] = None,
    out_row_ptrs: Optional[torch.Tensor] = None,
    h1: Optional[torch.Tensor] = None,
    h2: Optional[torch.Tensor] = None,
    activation: str = "swiglu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    config: Optional[GroupedGemmConfig] = None,
    num_programs: Optional[int] = None,
    claim_flags: Optional[ClaimFlags] = None,
    score_ptrs: Optional[torch.Tensor] = None,
    score_grad_delta: int = 0,
    part_stride: int = 0,
    timeout_s: float = 600.0,
    rank: int = 0,
) -> None:
    """DGRAD grouped GEMM: row r of expert e gets a[r] @ w[e] (fp32 accumulation).

    w  [E, Kd, N] contiguous: W2 [E, D, F] for grad_h2 [R, F] = grad_h3 [R, D] @ W2[e], or
       W13 [E, 2F, D] for grad_x [R, D] = grad_h1 [R, 2F] @ W13[e].
    Other arguments as in `grouped_mm_fwd` (epilogues "store", "scatter" and "swiglu_bwd"),
    claim mode included: W2 DGRAD with a_row_ptrs = the grad_h3 rows, a_copy_out = the saved
    grad_h3 (WGRAD's operand), claim_flags = a `ClaimFlags`.
    epilogue="swiglu_bwd" (W2 DGRAD only): the grad_h2 tile never leaves the kernel; with the
    saved h1 = [g | u] rows at `h1` ([R, 2F]) it becomes grad_h1 = [dg | du] (the activation's
    backward, `rows.swiglu_grad`), written over h1 in place; with `h2` ([R, F]) the epilogue
    also stores h2 = act(g, u) there (the W2 WGRAD operand), so no separate SwiGLU pass runs.
    score_ptrs (with "swiglu_bwd"; Config.save_route_outputs=False): int64 [>= max_rows], each
    row's address of its route's fp32 score in the token owner's memory (0: skip). The GEMM
    then computes u = grad_y @ W2 from unscaled grad_y rows, runs the SwiGLU backward on
    grad_h2 = s u, stores h2 scaled (s h2) for the W2 WGRAD, and writes n-tile j's share of
    <u, h2> (fp32) at score_ptrs[r] + score_grad_delta + j * part_stride (the owner's part
    slots; `score_parts_count` parts per route, summed by the owner: `rows.sum_score_parts`).
    """
    args = _prepare(w_kn=True, w=w, expert_offsets=expert_offsets, max_rows=max_rows, a=a,
                    a_row_ptrs=a_row_ptrs, a_copy_out=a_copy_out, epilogue=epilogue, out=out,
                    out_row_ptrs=out_row_ptrs, h1=h1, h2=h2, activation=activation,
                    swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                    claim_flags=claim_flags, score_ptrs=score_ptrs,
                    score_grad_delta=score_grad_delta, part_stride=part_stride)
    config = config or select_config("dgrad", n=args.n, kd=args.kd, device=w.device)
    _launch_mm(args, config, num_programs, timeout_s, rank)

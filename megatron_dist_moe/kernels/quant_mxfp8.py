"""MXFP8 quantization kernels (Triton): the twins of quant/mxfp8.py, bit-equal to it.

The mxfp8 GEMMs run in bf16 over dequantized MXFP8 values (exact in bf16: quant/mxfp8.py), so
these kernels write quantized-then-dequantized bf16 copies ("fake") where a GEMM reads, and
E4M3 + E8M0 bundles where state is saved:

    quantize        bf16 rows [R, K] (dense, at a device pointer) -> any of: fake rows (1 x 32
                    blocks along K; may overwrite x), the column bundle (32 x 1 along each
                    expert's tokens, segments padded to 128 rows, stored [K, Rp]), fake columns
                    (the same values, token-major [R, K]); one launch
    swiglu_quant    h1 [R, 2F] -> fake rows of h2 = round(act(h1)) and, training, the saved h1
                    row bundle
    dequantize_rows a row bundle -> bf16 [R, K]
    dequantize_cols a column bundle -> bf16 token-major [R, K]
    fake_weight     w [E, N, K] -> bf16 [E, N, K] of its 32 x 32 tile quantization

R and the expert offsets are device values: grids are host bounds and programs past the rows
return. The [R, K] launchers take `group_rows`, their tiles' launch order (GROUP_ROWS:
128-row blocks that walk every column block together, common.grouped_tile); the default is
the measured fastest, the argument is for benchmarks/bench_quant.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.mxfp8 import BLOCK
from .common import as_device_ptr, grouped_grid, grouped_tile, interpreting, load_ptr
from .quant_fp8 import _hw, block_amax, padded_block, round_bf16, to_e4m3
from .rows import _act_fwd

__all__ = ["quantize", "swiglu_quant", "dequantize_rows", "dequantize_cols", "fake_weight",
           "e8m0", "e8m0_reciprocal", "e8m0_value"]

_MAX_NORM_RCP = tl.constexpr(1.0 / 448.0)     # fp32(1/448), TE's max_norm_rcp
# The launch order of the [R, K] kernels' tiles (common.grouped_tile): this many 128 rows walk
# every column block together. Measured on one H200 at the guide's shapes (bench_quant.py,
# docs/decisions.md): one 128-row block at a time against the plain row-block-fastest grid,
# quantize 1-5 % faster (g3 247.7 -> 234.3 us, grad_h1 214.6 -> 203.6), dequantize_cols 4 %,
# swiglu_quant 1 %; dequantize_rows is fastest with 16 (71.0 -> 67.0 us).
GROUP_ROWS = 1
GROUP_ROWS_DEQ_ROWS = 16


@triton.jit
def e8m0(amax):
    """int32 E8M0 exponents of blocks with these fp32 amaxes (quant/mxfp8.e8m0_from_amax)."""
    v = amax * _MAX_NORM_RCP
    bits = v.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + up.to(tl.int32)
    e = tl.where(v == 0.0, 0, e)
    e = tl.where(v == float("inf"), 0xFE, e)
    return tl.where(v != v, 0xFF, e)


@triton.jit
def e8m0_reciprocal(e):
    """fp32 2^(127 - e), 1 for e == 0 (TE's exp2f_rcp)."""
    r = ((254 - e) << 23).to(tl.float32, bitcast=True)
    return tl.where(e == 0, 1.0, r)


@triton.jit
def e8m0_value(e):
    """fp32 2^(e - 127) (2^-127, a subnormal, for e == 0)."""
    return tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fake(x, e, HW: tl.constexpr):
    """fp32 x with its block exponents e (broadcast to x) -> bf16 of deq(e4m3(x * r))."""
    s = x * e8m0_reciprocal(e)                     # NaN for NaN x, and for inf x (times 0)
    v = to_e4m3(s, HW).to(tl.float32) * e8m0_value(e)
    if not HW:
        v = tl.where(s != s, s, v)                 # the interpreter widens E4M3 NaN wrongly
    return round_bf16(v, HW).to(tl.bfloat16)


@triton.jit
def _e4m3_value(b, HW: tl.constexpr):
    """fp32 value of E4M3 bytes b (uint8): the hardware conversion, NaN kept explicitly for
    the interpreter (whose widening of 0x7F / 0xFF is not NaN)."""
    v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if HW:
        return v
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _quant_kernel(x_addr, row_ptrs, offsets_ptr, rf_addr, cq_addr, ce_addr, cf_addr, K, E, n_rb,
                  E_PAD: tl.constexpr, ROWS_FAKE: tl.constexpr, COLS: tl.constexpr,
                  COLS_FAKE: tl.constexpr, HW: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_C: tl.constexpr, GROUP_R: tl.constexpr, GATHER: tl.constexpr):
    # one program per BLOCK_R rows (32, 64 or 128, inside one 128-row block) of the padded row
    # space x BLOCK_C columns: the 32-row column blocks of every expert start at a multiple of
    # 32 from its first row
    rb, cb = grouped_tile(n_rb, K // BLOCK_C, GROUP_R)
    PER: tl.constexpr = 128 // BLOCK_R
    found, p0, start, n, pstart, Rp = padded_block(offsets_ptr, E, E_PAD, rb // PER)
    if not found:
        return          # past the last padded segment
    p0 += (rb % PER) * BLOCK_R
    NRB: tl.constexpr = BLOCK_R // 32
    # Each direction loads its own 3-d view of the tile (the second load mostly hits L2), so
    # the 32-value blocks are an axis of the loaded tensor: reshaping one 2-d tile into both
    # views made the kernel run at ~0.3 TB/s.
    if not GATHER:
        x_base = load_ptr(x_addr, tl.bfloat16)
    if COLS or COLS_FAKE:
        i3 = tl.arange(0, NRB)[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
        local3 = p0 - pstart + i3
        ok3 = local3 < n
        rows3 = start + local3
        c3 = (cb * BLOCK_C + tl.arange(0, BLOCK_C))[None, None, :]                  # [1, 1, BC]
        if GATHER:   # row i at the address row_ptrs[i] (0: zeros), 16-byte aligned rows
            src3 = tl.load(row_ptrs + rows3, mask=ok3, other=0)
            xc = tl.load(tl.multiple_of(src3.to(tl.pointer_type(tl.bfloat16)), [16, 16, 16])
                         + c3, mask=ok3 & (src3 != 0), other=0.0).to(tl.float32)
        else:
            xc = tl.load(x_base + rows3 * K + c3, mask=ok3, other=0.0).to(tl.float32)  # [NRB, 32, BC]
        ec = e8m0(block_amax(xc, 1))                                                # [NRB, BC]
        ec3 = tl.broadcast_to(ec[:, None, :], (NRB, 32, BLOCK_C))
        if COLS:
            q = to_e4m3(xc * e8m0_reciprocal(ec3), HW)
            qc_base = load_ptr(cq_addr, tl.float8e4nv)
            tl.store(qc_base + c3.to(tl.int64) * Rp + (p0 + i3), q)
            ce_base = load_ptr(ce_addr, tl.uint8)
            eb = p0 // 32 + tl.arange(0, NRB)
            cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
            tl.store(ce_base + eb[:, None] * K + cols[None, :], ec.to(tl.uint8))
        if COLS_FAKE:
            cf_base = load_ptr(cf_addr, tl.bfloat16)
            tl.store(cf_base + rows3 * K + c3, _fake(xc, ec3, HW), mask=ok3)
    if ROWS_FAKE:
        if COLS or COLS_FAKE:
            # rows_fake may be x itself: every thread's column-view loads before any row store
            tl.debug_barrier()
        i = tl.arange(0, BLOCK_R)
        local = p0 - pstart + i
        ok = (local < n)[:, None, None]
        rows = (start + local)[:, None, None]                                       # [BR, 1, 1]
        j3 = (cb * BLOCK_C + tl.arange(0, BLOCK_C // 32)[None, :, None] * 32
              + tl.arange(0, 32)[None, None, :])                                    # [1, BC/32, 32]
        if GATHER:
            src = tl.load(row_ptrs + rows, mask=ok, other=0)
            xr = tl.load(tl.multiple_of(src.to(tl.pointer_type(tl.bfloat16)), [16, 16, 16])
                         + j3, mask=ok & (src != 0), other=0.0).to(tl.float32)
        else:
            xr = tl.load(x_base + rows * K + j3, mask=ok, other=0.0).to(tl.float32)
        er = e8m0(block_amax(xr, 2))                                                # [BR, BC/32]
        f = _fake(xr, tl.broadcast_to(er[:, :, None], (BLOCK_R, BLOCK_C // 32, 32)), HW)
        rf_base = load_ptr(rf_addr, tl.bfloat16)
        tl.store(rf_base + rows * K + j3, f, mask=ok)


# (rows, columns, warps) of quantize's tiles. The kernel is bound by instruction issue, not by
# HBM: at 128 x 32 x 4 (the fastest 128-row tile measured on one H200) it issues 2.24 warp
# instructions per value (sm_90 SASS), ~190 us at the guide's x against 220 measured. A
# 32-row tile at one warp keeps both directions' block amaxes inside the warp (no
# shared-memory reduction, fewer shuffles per value); with the trimmed NaN handling it issues
# 0.90 per value, which should put it below the HBM time (PREDICTED, not yet timed on a GPU)
QUANT_TILE = (32, 64, 1)
# the tiles `quantize` accepts: candidates bench_quant.py times against the default (a 32-row
# tile at one warp keeps each column block's amax inside the warp: no shared-memory reduction)
QUANT_TILES = ((128, 32, 4), (128, 32, 8), (64, 32, 2), (64, 32, 4), (32, 32, 1), (32, 32, 2),
               (32, 64, 1), (32, 64, 2), (32, 128, 4))


def quantize(x, offsets: torch.Tensor, max_rows: int, K: int, *, rows_fake=None, cols=None,
             cols_fake=None, group_rows: int = GROUP_ROWS, tile: tuple | None = None,
             row_ptrs: torch.Tensor | None = None) -> None:
    """MXFP8 quantization of bf16 rows x [R, K] (tensor or device pointer; R = offsets[-1] on
    the device), in one launch (one read of x per direction). With row_ptrs (int64 [>= R]
    device addresses, 16-byte aligned; x then None): row i is read from row_ptrs[i] (zeros
    where 0), the gather fused in (quant_fp8.quantize_rows_cols likewise):

    rows_fake  bf16 [>= R, K] (may be x itself): quant/mxfp8.fake_rows(x)
    cols       (q_t, e_t): the column bundle, q_t [K, Rp] e4m3 and e_t [Rp/32, K] uint8 with
               Rp = layout.padded_rows(R, E) (zeros in each segment's padding;
               quant/mxfp8.quantize_cols; the rows past the last padded segment, which
               nothing reads, are not written)
    cols_fake  bf16 [>= R, K]: quant/mxfp8.fake_cols(x, offsets)
    max_rows: host bound on R (the grid). tile: (rows, columns, warps) of a program, one of
    QUANT_TILES (for benchmarks/bench_quant.py); None: QUANT_TILE (the predicted fastest,
    not yet timed on a GPU)."""
    assert rows_fake is not None or cols is not None or cols_fake is not None
    assert K % 128 == 0, f"K={K} must be a multiple of 128"
    assert tile is None or tuple(tile) in QUANT_TILES, (
        f"tile={tile}: expected one of {QUANT_TILES}")
    block_r, block_c, warps = QUANT_TILE if tile is None else tile
    E = offsets.numel() - 1
    from ..layout import padded_rows
    Rp = padded_rows(max_rows, E)
    dummy = offsets
    rf = as_device_ptr(rows_fake, "rows_fake", torch.bfloat16) if rows_fake is not None else dummy
    cq, ce = (as_device_ptr(cols[0], "q_t"), as_device_ptr(cols[1], "e_t")) if cols else (
        dummy, dummy)
    cf = as_device_ptr(cols_fake, "cols_fake", torch.bfloat16) if cols_fake is not None else dummy
    if interpreting() and tile is None:
        block_r, block_c = 128, 64    # the interpreter's cost is per program
    n_rb = max(1, Rp // block_r)
    assert (x is None) != (row_ptrs is None), "pass x or row_ptrs"
    xa = as_device_ptr(x, "x", torch.bfloat16) if x is not None else dummy
    _quant_kernel[grouped_grid(n_rb, K // block_c, group_rows)](
        xa, row_ptrs if row_ptrs is not None else dummy, offsets, rf, cq, ce, cf, K, E, n_rb,
        E_PAD=max(2, triton.next_power_of_2(E)), ROWS_FAKE=rows_fake is not None,
        COLS=cols is not None, COLS_FAKE=cols_fake is not None, HW=_hw(offsets),
        BLOCK_R=block_r, BLOCK_C=block_c, GROUP_R=group_rows * (128 // block_r),
        GATHER=row_ptrs is not None, num_warps=warps)


@triton.jit
def _row_blocks(x, BLOCK_R: tl.constexpr):
    """[BLOCK_R, 128] -> ([BLOCK_R, 4, 32] view, its int32 block exponents [BLOCK_R, 4])."""
    x3 = tl.reshape(x, (BLOCK_R, 4, 32))
    return x3, e8m0(block_amax(x3, 2))


@triton.jit
def _swiglu_quant_kernel(h1_addr, num_rows_ptr, h1q_addr, h1e_addr, h2_addr, F, alpha, limit,
                         n_rb, CLAMPED: tl.constexpr, SAVE_H1: tl.constexpr, HW: tl.constexpr,
                         BLOCK_R: tl.constexpr, GROUP_R: tl.constexpr):
    rb, cb = grouped_tile(n_rb, F // 128, GROUP_R)
    n = tl.load(num_rows_ptr)
    if rb * BLOCK_R >= n:
        return
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n
    c = cb * 128 + tl.arange(0, 128)
    h1 = load_ptr(h1_addr, tl.bfloat16)
    gp = h1 + rows[:, None] * (2 * F) + c[None, :]
    g = tl.load(gp, mask=ok[:, None], other=0.0).to(tl.float32)
    u = tl.load(gp + F, mask=ok[:, None], other=0.0).to(tl.float32)
    eb = tl.arange(0, 4)
    if SAVE_H1:
        q_base = load_ptr(h1q_addr, tl.float8e4nv)
        e_base = load_ptr(h1e_addr, tl.uint8)
        qp = q_base + rows[:, None] * (2 * F) + c[None, :]
        ep = e_base + rows[:, None] * (2 * F // 32) + cb * 4 + eb[None, :]
        g3, eg = _row_blocks(g, BLOCK_R)
        qg = to_e4m3(g3 * e8m0_reciprocal(eg)[:, :, None], HW)
        tl.store(qp, tl.reshape(qg, (BLOCK_R, 128)), mask=ok[:, None])
        tl.store(ep, eg.to(tl.uint8), mask=ok[:, None])
        u3, eu = _row_blocks(u, BLOCK_R)
        qu = to_e4m3(u3 * e8m0_reciprocal(eu)[:, :, None], HW)
        tl.store(qp + F, tl.reshape(qu, (BLOCK_R, 128)), mask=ok[:, None])
        tl.store(ep + F // 32, eu.to(tl.uint8), mask=ok[:, None])
    h2 = round_bf16(_act_fwd(g, u, CLAMPED, alpha, limit), HW)
    h3, e2 = _row_blocks(h2, BLOCK_R)
    f = tl.reshape(_fake(h3, tl.broadcast_to(e2[:, :, None], (BLOCK_R, 4, 32)), HW),
                   (BLOCK_R, 128))
    tl.store(load_ptr(h2_addr, tl.bfloat16) + rows[:, None] * F + c[None, :], f,
             mask=ok[:, None])


def swiglu_quant(h1, num_rows: torch.Tensor, max_rows: int, F: int, *, h2_fake, h1q=None,
                 activation: str = "swiglu", swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, group_rows: int = GROUP_ROWS) -> None:
    """From bf16 h1 [R, 2F] (R = num_rows[0] on the device): h2_fake [R, F] bf16 =
    fake_rows(round(act(h1))); h1q = (q [R, 2F] e4m3, e [R, 2F/32] uint8), the row bundle of
    h1, when given."""
    assert F % 128 == 0, f"F={F} must be a multiple of 128"
    BLOCK_R = 32
    dummy = num_rows
    a, b = (as_device_ptr(h1q[0], "h1q"), as_device_ptr(h1q[1], "h1q_s")) if h1q else (
        dummy, dummy)
    n_rb = max(1, triton.cdiv(max_rows, BLOCK_R))
    _swiglu_quant_kernel[grouped_grid(n_rb, F // 128, group_rows)](
        as_device_ptr(h1, "h1", torch.bfloat16), num_rows, a, b,
        as_device_ptr(h2_fake, "h2_fake", torch.bfloat16), F, float(swiglu_alpha),
        float(swiglu_limit), n_rb, CLAMPED=activation == "swiglu_clamped",
        SAVE_H1=h1q is not None, HW=_hw(num_rows), BLOCK_R=BLOCK_R, GROUP_R=group_rows * 4,
        num_warps=4)


@triton.jit
def _deq_rows_kernel(q_addr, e_addr, num_rows_ptr, out_addr, K, n_rb, HW: tl.constexpr,
                     BLOCK_R: tl.constexpr, GROUP_R: tl.constexpr):
    rb, cb = grouped_tile(n_rb, K // 128, GROUP_R)
    n = tl.load(num_rows_ptr)
    if rb * BLOCK_R >= n:
        return
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n
    c = cb * 128 + tl.arange(0, 128)
    q = _e4m3_value(tl.load(load_ptr(q_addr, tl.uint8) + rows[:, None] * K + c[None, :],
                            mask=ok[:, None], other=0), HW)
    e = tl.load(load_ptr(e_addr, tl.uint8) + rows[:, None] * (K // 32) + cb * 4
                + tl.arange(0, 4)[None, :], mask=ok[:, None], other=0).to(tl.int32)
    v = tl.reshape(q, (BLOCK_R, 4, 32)) * e8m0_value(e)[:, :, None]
    out = round_bf16(tl.reshape(v, (BLOCK_R, 128)), HW).to(tl.bfloat16)
    tl.store(load_ptr(out_addr, tl.bfloat16) + rows[:, None] * K + c[None, :], out,
             mask=ok[:, None])


def dequantize_rows(q, e, num_rows: torch.Tensor, max_rows: int, K: int, *, out,
                    group_rows: int = GROUP_ROWS_DEQ_ROWS) -> None:
    """out [R, K] bf16 = quant/mxfp8.dequantize_rows(q [R, K], e [R, K/32]) (R = num_rows[0])."""
    assert K % 128 == 0, f"K={K} must be a multiple of 128"
    BLOCK_R = 32
    n_rb = max(1, triton.cdiv(max_rows, BLOCK_R))
    _deq_rows_kernel[grouped_grid(n_rb, K // 128, group_rows)](
        as_device_ptr(q, "q"), as_device_ptr(e, "e"), num_rows,
        as_device_ptr(out, "out", torch.bfloat16), K, n_rb, HW=_hw(num_rows), BLOCK_R=BLOCK_R,
        GROUP_R=group_rows * 4, num_warps=4)


@triton.jit
def _deq_cols_kernel(q_addr, e_addr, offsets_ptr, out_addr, K, E, n_pb, E_PAD: tl.constexpr,
                     HW: tl.constexpr, GROUP_R: tl.constexpr):
    pb, cb = grouped_tile(n_pb, K // 128, GROUP_R)
    found, p0, start, n, pstart, Rp = padded_block(offsets_ptr, E, E_PAD, pb)
    if not found:
        return
    i = tl.arange(0, 128)
    local = p0 - pstart + i
    ok = local < n
    rows = start + local
    cols = cb * 128 + tl.arange(0, 128)
    q = _e4m3_value(tl.load(load_ptr(q_addr, tl.uint8) + cols[None, :].to(tl.int64) * Rp
                            + (p0 + i)[:, None]), HW)
    eb = pb.to(tl.int64) * 4 + tl.arange(0, 4)
    e = tl.load(load_ptr(e_addr, tl.uint8) + eb[:, None] * K + cols[None, :]).to(tl.int32)
    v = tl.reshape(q, (4, 32, 128)) * e8m0_value(e)[:, None, :]
    out = round_bf16(tl.reshape(v, (128, 128)), HW).to(tl.bfloat16)
    tl.store(load_ptr(out_addr, tl.bfloat16) + rows[:, None] * K + cols[None, :], out,
             mask=ok[:, None])


def dequantize_cols(q_t, e_t, offsets: torch.Tensor, max_rows: int, K: int, *, out,
                    group_rows: int = GROUP_ROWS) -> None:
    """out [R, K] bf16, token-major: the column bundle (q_t [K, Rp], e_t [Rp/32, K]) of
    `quantize`, dequantized, without its padding rows."""
    assert K % 128 == 0, f"K={K} must be a multiple of 128"
    E = offsets.numel() - 1
    from ..layout import padded_rows
    n_pb = max(1, padded_rows(max_rows, E) // 128)
    _deq_cols_kernel[grouped_grid(n_pb, K // 128, group_rows)](
        as_device_ptr(q_t, "q_t"), as_device_ptr(e_t, "e_t"), offsets,
        as_device_ptr(out, "out", torch.bfloat16), K, E, n_pb,
        E_PAD=max(2, triton.next_power_of_2(E)), HW=_hw(offsets), GROUP_R=group_rows,
        num_warps=8)


@triton.jit
def _fake_weight_kernel(w_ptr, out_ptr, N, K, HW: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    r = nb * 32 + tl.arange(0, 32)
    c = kb * 128 + tl.arange(0, 128)
    off = e * N * K + r[:, None].to(tl.int64) * K + c[None, :]
    w = tl.load(w_ptr + off).to(tl.float32)
    w3 = tl.reshape(w, (32, 4, 32))
    ex = e8m0(tl.max(block_amax(w3, 2), 0))              # [4]: one per 32 x 32 tile
    f = _fake(w3, tl.broadcast_to(ex[None, :, None], (32, 4, 32)), HW)
    tl.store(out_ptr + off, tl.reshape(f, (32, 128)))


def fake_weight(w_ENK: torch.Tensor, out=None) -> torch.Tensor:
    """bf16 [E, N, K] = quant/mxfp8.fake_weight(w): 32 x 32 tiles, N % 32 == 0, K % 128 == 0.
    out: a bf16 tensor of w's shape to write into (a weight cache entry)."""
    E, N, K = w_ENK.shape
    assert w_ENK.is_contiguous() and w_ENK.dtype == torch.bfloat16
    assert N % BLOCK == 0 and K % 128 == 0, f"[{N}, {K}]: N % 32 and K % 128 must be 0"
    if out is None:
        out = torch.empty_like(w_ENK)
    assert out.shape == w_ENK.shape and out.dtype == w_ENK.dtype and out.is_contiguous()
    _fake_weight_kernel[(E, N // BLOCK, K // 128)](w_ENK, out, N, K, HW=_hw(w_ENK), num_warps=4)
    return out

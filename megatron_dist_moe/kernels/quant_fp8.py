"""FP8 block quantization kernels (Triton): the twins of quant/fp8_block.py, bit-equal to it.

    quantize_rows_cols  bf16 rows [R, K] (dense, at a device pointer) -> the row bundle
                        (1 x 128 along K) and / or the column bundle (128 x 1 along the tokens
                        of each expert, padded, stored transposed [K, Rp]) in one read
    swiglu_quant        h1 [R, 2F] bf16 -> the h1 row bundle (saved for the backward) and the
                        row bundle of h2 = round(act(h1)) (the W2 FPROP operand)
    quantize_weight     w [E, N, K] bf16 -> q [E, N, K] and q_t [E, K, N] with their 128 x 128
                        tile scales (both orientations of one quantization)
    swiglu_bwd_rows     the SwiGLU backward after a W2 DGRAD that stored u = g3 W2 (bf16 [R, F])
                        instead of fusing it: from u and the saved h1 row bundle, grad_h1 and h2
                        (u's region, in place) and the score-gradient parts, with the formulas
                        of the fused epilogue of grouped_gemm/fp8.py on u rounded to bf16 (the
                        epilogue has u in fp32: round(s round(u)) instead of round(s u); h2 and
                        the unscored grad_h1 are the same given the same u). Twin:
                        kernels/rows_ref.swiglu_bwd_rows_ref

R and the expert offsets are device values: grids are host bounds and programs past the rows
return. Every kernel reads the recipe (power-of-two scales, amax epsilon) as constexprs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.fp8_block import BF16_MAX, BLOCK, BlockScaling
from .common import (as_device_ptr, check_rows, grouped_grid, grouped_tile, interpreting,
                     load_ptr)
from .rows import _act_fwd, swiglu_grad

__all__ = ["quantize_rows_cols", "swiglu_quant", "quantize_weight", "swiglu_bwd_rows",
           "block_scales", "to_e4m3", "padded_block", "block_amax", "round_bf16"]

_BF16_MAX = tl.constexpr(BF16_MAX)
# The launch order of quantize_rows_cols' tiles (common.grouped_tile): one 128-row block at a
# time walks every column block, 1-2 % faster than the row-block-fastest grid on one H200 at
# the guide's shapes (x 275.5 -> 270.7 us; bench_quant.py); swiglu_quant measured even and
# keeps its 2-D grid.
GROUP_ROWS = 1
# (column chunk, warps) of quantize_rows_cols' programs, the launcher's choice per output set
# (bench_quant.py --fp8-tiles times each against the others, bit-exact first). One-warp tiles,
# whose column amaxes stay inside the warp, measured slower: the loop over 16-column chunks
# costs more than the shared-memory reductions it saves (docs/decisions.md)
QUANT_TILES = ((64, 8), (32, 2), (64, 4))


def _hw(t: torch.Tensor) -> bool:
    """The hardware fp8 conversion where it rounds correctly: a GPU, not the interpreter."""
    return t.device.type == "cuda" and not interpreting()


@triton.jit
def block_scales(amax, POW2: tl.constexpr, EPS: tl.constexpr):
    """(scale, scale_inv) fp32 from block amaxes: quant/fp8_block.compute_scales."""
    if EPS > 0:
        amax = tl.maximum(amax, EPS)
    scale = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    scale = tl.where(scale == float("inf"), _BF16_MAX, scale)
    scale = tl.where((amax == 0.0) | (amax == float("inf")), 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    return scale, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)


@triton.jit
def block_amax(x, axis: tl.constexpr):
    """max |x| along axis with NaN ignored, 0 for an all-NaN block (TE's amax). tl.max ignores
    NaN operands by itself (maxnum: PTX max.f32 on the GPU, numpy nanmax in the interpreter of
    Triton >= 3.8; an interpreter whose max propagated NaN would fail the kernel checks), so
    only the block's result is checked: one FMNMX with |x| per value, where checking each value
    first costs two more (the mxfp8 quantizer is bound by instruction issue)."""
    m = tl.max(tl.abs(x), axis)
    return tl.where(m != m, 0.0, m)


@triton.jit
def to_e4m3(v, HW: tl.constexpr):
    """clamp to +-448 (NaN kept), round to nearest even: the hardware conversion (HW, on the
    GPU: cvt.rn.satfinite, which clamps finite and infinite values to +-448 and keeps NaN by
    itself) or the same in integer arithmetic (the interpreter, whose fp8 conversion neither
    rounds to nearest even nor saturates)."""
    if HW:
        return v.to(tl.float8e4nv)
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -448.0), 448.0))
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal range (>= 2^-6): round the fp32 mantissa to 3 bits, rebias the exponent 127 -> 7
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    # subnormal range: multiples of 2^-9; x * 512 + 2^23 rounds to an integer (ties to even)
    sub = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag >= 0x3C800000, normal, sub)       # 0x3C800000 = 2^-6
    code = tl.where(mag > 0x7F800000, 0x7F, code)          # NaN
    return (code | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def round_bf16(x, HW: tl.constexpr):
    """fp32 x rounded to bf16 (nearest even), returned as fp32: the hardware conversion, or
    the same in integer arithmetic (the interpreter's conversion truncates)."""
    if HW:
        return x.to(tl.bfloat16).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, r)


@triton.jit
def _padded_segments(offsets_ptr, E, E_PAD: tl.constexpr):
    """(starts, lens, padded starts) of the experts' segments, [E_PAD] int64 vectors."""
    e = tl.arange(0, E_PAD)
    ok = e < E
    starts = tl.load(offsets_ptr + e, mask=ok, other=0).to(tl.int64)
    ends = tl.load(offsets_ptr + e + 1, mask=ok, other=0).to(tl.int64)
    lens = ends - starts
    plen = (lens + 127) // 128 * 128
    pstarts = tl.cumsum(plen, 0) - plen
    return starts, lens, pstarts, plen


@triton.jit
def padded_block(offsets_ptr, E, E_PAD: tl.constexpr, pb):
    """Block pb of 128 rows of the padded row space (each expert's rows padded to 128):
    (found: inside some expert's padded segment, p0 its first padded row, that expert's first
    compact row, row count and padded start, Rp = layout.padded_rows(R, E), the column
    bundle's row stride for this call's R)."""
    starts, lens, pstarts, plen = _padded_segments(offsets_ptr, E, E_PAD)
    Rp = (tl.load(offsets_ptr + E).to(tl.int64) + 127 * E + 127) // 128 * 128
    p0 = pb.to(tl.int64) * 128
    in_e = (pstarts <= p0) & (p0 < pstarts + plen)
    found = tl.sum(in_e.to(tl.int32), 0) > 0
    start = tl.sum(tl.where(in_e, starts, 0), 0)
    n = tl.sum(tl.where(in_e, lens, 0), 0)
    pstart = tl.sum(tl.where(in_e, pstarts, 0), 0)
    return found, p0, start, n, pstart, Rp


@triton.jit
def _cols_chunk(x_rows, ld, amax_r, c, cb, pb, p0, i, K, Rp, qc_base, sc_base, ROWS: tl.constexpr,
                COLS: tl.constexpr, POW2: tl.constexpr, EPS: tl.constexpr, HW: tl.constexpr,
                CHUNK: tl.constexpr):
    """Column chunk c of the tile: its column blocks quantized and stored (COLS), the row
    amaxes grown by it (ROWS); returns the row amaxes."""
    cols = cb * 128 + c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_rows + cols[None, :], mask=ld[:, None], other=0.0).to(tl.float32)
    if ROWS:
        amax_r = tl.maximum(amax_r, block_amax(x, 1))
    if COLS:
        scale, s_inv = block_scales(block_amax(x, 0), POW2, EPS)
        q = to_e4m3(x * scale[None, :], HW)
        tl.store(qc_base + cols[None, :].to(tl.int64) * Rp + (p0 + i)[:, None], q)
        tl.store(sc_base + pb.to(tl.int64) * K + cols, s_inv)
    return amax_r


@triton.jit
def _rows_chunk(x_rows, ld, ok, q_rows, scale, c, cb, HW: tl.constexpr, CHUNK: tl.constexpr):
    """Column chunk c of the tile quantized with the rows' scales and stored."""
    cols = cb * 128 + c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_rows + cols[None, :], mask=ld[:, None], other=0.0).to(tl.float32)
    tl.store(q_rows + cols[None, :], to_e4m3(x * scale[:, None], HW), mask=ok[:, None])


@triton.jit
def _quant_rows_cols_kernel(x_addr, row_ptrs, offsets_ptr, q_addr, s_addr, qc_addr, sc_addr, K, E,
                            n_pb, E_PAD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                            POW2: tl.constexpr, EPS: tl.constexpr, HW: tl.constexpr,
                            CHUNK: tl.constexpr, GROUP_R: tl.constexpr, GATHER: tl.constexpr):
    # One program per 128-row block of the padded row space x 128 columns, walked in column
    # chunks of CHUNK: each chunk's column blocks are final at once, and the row amax grows
    # over the chunks; the rows are then quantized from a second read of the same 32 KB (an
    # L2 hit). Holding the whole 128 x 128 tile in fp32 registers instead leaves room for one
    # program per SM, which then waits on each load with nothing else in flight. Up to two
    # chunks are unrolled; more run as a loop (unrolled, eight 16-column chunks are ~14,000
    # SASS instructions, more than the instruction cache holds).
    pb, cb = grouped_tile(n_pb, K // 128, GROUP_R)
    found, p0, start, n, pstart, Rp = padded_block(offsets_ptr, E, E_PAD, pb)
    if not found:
        return          # past the last padded segment
    i = tl.arange(0, 128)
    local = p0 - pstart + i                     # row within the expert's segment
    ok = local < n
    rows = start + local                        # compact row
    if GATHER:
        # row i read from the address row_ptrs[i] (a peer's token row; 0: a row of zeros), as
        # rows.gather_rows would have copied it; 16-byte aligned rows (the hint on the int ->
        # pointer cast, common.load_ptr), so the loads vectorize
        src = tl.load(row_ptrs + rows, mask=ok, other=0)
        x_rows = tl.multiple_of(src.to(tl.pointer_type(tl.bfloat16)), [16])[:, None]
        ld = ok & (src != 0)
    else:
        x_rows = load_ptr(x_addr, tl.bfloat16) + rows[:, None] * K
        ld = ok
    NC: tl.constexpr = 128 // CHUNK
    if COLS:    # the column bundle's base addresses, loaded once (not per chunk of the loop)
        qc_base = load_ptr(qc_addr, tl.float8e4nv)
        sc_base = load_ptr(sc_addr, tl.float32)
    else:
        qc_base, sc_base = qc_addr, sc_addr    # unused
    amax_r = tl.zeros((128,), tl.float32)
    if NC <= 2:
        for c in tl.static_range(NC):
            amax_r = _cols_chunk(x_rows, ld, amax_r, c, cb, pb, p0, i, K, Rp, qc_base, sc_base,
                                 ROWS, COLS, POW2, EPS, HW, CHUNK)
    else:
        for c in tl.range(NC):
            amax_r = _cols_chunk(x_rows, ld, amax_r, c, cb, pb, p0, i, K, Rp, qc_base, sc_base,
                                 ROWS, COLS, POW2, EPS, HW, CHUNK)
    if ROWS:
        scale, s_inv = block_scales(amax_r, POW2, EPS)
        q_rows = load_ptr(q_addr, tl.float8e4nv) + rows[:, None] * K
        if NC <= 2:
            for c in tl.static_range(NC):
                _rows_chunk(x_rows, ld, ok, q_rows, scale, c, cb, HW, CHUNK)
        else:
            for c in tl.range(NC):
                _rows_chunk(x_rows, ld, ok, q_rows, scale, c, cb, HW, CHUNK)
        s_base = load_ptr(s_addr, tl.float32)
        tl.store(s_base + rows * (K // 128) + cb, s_inv, mask=ok)


def quantize_rows_cols(x, offsets: torch.Tensor, max_rows: int, K: int, *, rows=None,
                       cols=None, recipe: BlockScaling = BlockScaling(),
                       group_rows: int = GROUP_ROWS, row_ptrs: torch.Tensor | None = None,
                       tile: tuple | None = None) -> None:
    """Quantize bf16 rows x [R, K] (tensor or device pointer; R = offsets[-1] on the device).
    With row_ptrs (int64 [>= R] device addresses, 16-byte aligned; x then None): row i is read
    from row_ptrs[i] (zeros where 0), the gather fused into the quantizer (rows.gather_rows
    followed by this function, without the bf16 copy).

    rows = (q, s): the row bundle, q [>= R, K] e4m3, s [>= R, K/128] fp32 (tensors or device
    pointers); cols = (q_t, s_t): the column bundle over each expert's segment padded to 128
    rows, q_t [K, Rp] e4m3 and s_t [Rp/128, K] fp32 with Rp = layout.padded_rows(R, E) (zeros
    in each segment's padding). max_rows: host bound on R (the grid). group_rows: 128-row
    blocks per launch group (common.grouped_tile). tile: (column chunk, warps), one of
    QUANT_TILES (for benchmarks/bench_quant.py); None: the launcher's choice per output set."""
    assert rows is not None or cols is not None
    assert tile is None or tuple(tile) in QUANT_TILES, (
        f"tile={tile}: expected one of {QUANT_TILES}")
    assert K % BLOCK == 0, f"K={K} must be a multiple of {BLOCK}"
    E = offsets.numel() - 1
    from ..layout import padded_rows
    Rp = padded_rows(max_rows, E)
    dummy = offsets
    assert (x is None) != (row_ptrs is None), "pass x or row_ptrs"
    xa = as_device_ptr(x, "x", torch.bfloat16) if x is not None else dummy
    q, s = (as_device_ptr(rows[0], "q"), as_device_ptr(rows[1], "s")) if rows else (dummy, dummy)
    qc, sc = (as_device_ptr(cols[0], "q_t"), as_device_ptr(cols[1], "s_t")) if cols else (
        dummy, dummy)
    n_pb = max(1, Rp // BLOCK)
    # (column chunk, warps) per output set: both bundles 32 x 2 warps and columns alone 64 x 4,
    # the fastest of a sweep of seven tiles at the guide's shapes (docs/decisions.md); rows
    # alone 64 x 8 (3.3 TB/s, from an earlier sweep; inference only)
    chunk, warps = (32, 2) if rows and cols else (64, 8) if rows else (64, 4)
    if tile is not None:
        chunk, warps = tile
    if interpreting() and tile is None:
        chunk = 128     # the interpreter's cost is per loop step and per program, not per byte
    _quant_rows_cols_kernel[grouped_grid(n_pb, K // BLOCK, group_rows)](
        xa, row_ptrs if row_ptrs is not None else dummy, offsets, q, s, qc, sc, K, E, n_pb,
        E_PAD=max(2, triton.next_power_of_2(E)), ROWS=rows is not None, COLS=cols is not None,
        POW2=recipe.power_2_scales, EPS=float(recipe.amax_epsilon), HW=_hw(offsets),
        CHUNK=chunk, GROUP_R=group_rows, GATHER=row_ptrs is not None, num_warps=warps)


@triton.jit
def _swiglu_quant_kernel(h1_addr, num_rows_ptr, h1q_addr, h1s_addr, h2q_addr, h2s_addr, F,
                         alpha, limit, CLAMPED: tl.constexpr, SAVE_H1: tl.constexpr,
                         POW2: tl.constexpr, EPS: tl.constexpr, HW: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    n = tl.load(num_rows_ptr)
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n
    if rb * BLOCK_R >= n:
        return
    c = cb * 128 + tl.arange(0, 128)
    h1 = load_ptr(h1_addr, tl.bfloat16)
    gp = h1 + rows[:, None] * (2 * F) + c[None, :]
    g = tl.load(gp, mask=ok[:, None], other=0.0).to(tl.float32)
    u = tl.load(gp + F, mask=ok[:, None], other=0.0).to(tl.float32)
    nb = (2 * F) // 128
    if SAVE_H1:
        q_base = load_ptr(h1q_addr, tl.float8e4nv)
        s_base = load_ptr(h1s_addr, tl.float32)
        sg, ig = block_scales(block_amax(g, 1), POW2, EPS)
        su, iu = block_scales(block_amax(u, 1), POW2, EPS)
        qp = q_base + rows[:, None] * (2 * F) + c[None, :]
        tl.store(qp, to_e4m3(g * sg[:, None], HW), mask=ok[:, None])
        tl.store(qp + F, to_e4m3(u * su[:, None], HW), mask=ok[:, None])
        tl.store(s_base + rows * nb + cb, ig, mask=ok)
        tl.store(s_base + rows * nb + F // 128 + cb, iu, mask=ok)
    h2 = round_bf16(_act_fwd(g, u, CLAMPED, alpha, limit), HW)
    s2, i2 = block_scales(block_amax(h2, 1), POW2, EPS)
    q2 = load_ptr(h2q_addr, tl.float8e4nv)
    tl.store(q2 + rows[:, None] * F + c[None, :], to_e4m3(h2 * s2[:, None], HW), mask=ok[:, None])
    tl.store(load_ptr(h2s_addr, tl.float32) + rows * (F // 128) + cb, i2, mask=ok)


def swiglu_quant(h1, num_rows: torch.Tensor, max_rows: int, F: int, *, h2q, h1q=None,
                 activation: str = "swiglu", swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, recipe: BlockScaling = BlockScaling()) -> None:
    """From bf16 h1 [R, 2F] (R = num_rows[0] on the device): h2q = (q [R, F], s [R, F/128]),
    the row bundle of round(act(h1)); h1q = (q [R, 2F], s [R, 2F/128]) when given."""
    assert F % BLOCK == 0, f"F={F} must be a multiple of {BLOCK}"
    BLOCK_R = 32
    dummy = num_rows
    a, b = (as_device_ptr(h1q[0], "h1q"), as_device_ptr(h1q[1], "h1q_s")) if h1q else (
        dummy, dummy)
    grid = (max(1, triton.cdiv(max_rows, BLOCK_R)), F // BLOCK)
    _swiglu_quant_kernel[grid](as_device_ptr(h1, "h1", torch.bfloat16), num_rows, a, b,
                               as_device_ptr(h2q[0], "h2q"), as_device_ptr(h2q[1], "h2q_s"), F,
                               float(swiglu_alpha), float(swiglu_limit),
                               CLAMPED=activation == "swiglu_clamped", SAVE_H1=h1q is not None,
                               POW2=recipe.power_2_scales, EPS=float(recipe.amax_epsilon),
                               HW=_hw(num_rows), BLOCK_R=BLOCK_R, num_warps=4)


@triton.jit
def _quant_weight_kernel(w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, N, K, POW2: tl.constexpr,
                         EPS: tl.constexpr, HW: tl.constexpr, TRANSPOSED: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    r = nb * 128 + tl.arange(0, 128)
    c = kb * 128 + tl.arange(0, 128)
    base = e * N * K
    w = tl.load(w_ptr + base + r[:, None].to(tl.int64) * K + c[None, :]).to(tl.float32)
    amax = tl.max(block_amax(w, 1), 0)
    scale, s_inv = block_scales(amax, POW2, EPS)
    q = to_e4m3(w * scale, HW)
    tl.store(q_ptr + base + r[:, None].to(tl.int64) * K + c[None, :], q)
    tl.store(s_ptr + e * (N // 128) * (K // 128) + nb * (K // 128) + kb, s_inv)
    if TRANSPOSED:
        tl.store(qt_ptr + base + c[None, :].to(tl.int64) * N + r[:, None], q)
        tl.store(st_ptr + e * (N // 128) * (K // 128) + kb * (N // 128) + nb, s_inv)


def quantize_weight(w_ENK: torch.Tensor, recipe: BlockScaling = BlockScaling(),
                    transposed: bool = True, out=None):
    """(q [E, N, K], s [E, N/128, K/128], q_t [E, K, N], s_t [E, K/128, N/128]); without
    `transposed` q_t and s_t are None. out: such a tuple to write into (a weight cache entry:
    the same addresses every time)."""
    E, N, K = w_ENK.shape
    assert w_ENK.is_contiguous() and w_ENK.dtype == torch.bfloat16
    assert N % BLOCK == 0 and K % BLOCK == 0, f"[{N}, {K}] must be multiples of {BLOCK}"
    f8 = torch.float8_e4m3fn
    if out is not None:
        q, s, qt, st = out
        shapes = [(E, N, K), (E, N // BLOCK, K // BLOCK)] + (
            [(E, K, N), (E, K // BLOCK, N // BLOCK)] if transposed else [])
        assert [tuple(t.shape) for t in (q, s, qt, st)[:len(shapes)]] == shapes, (
            "quantize_weight(out=): the tensors do not match the weight's shapes")
    else:
        q = torch.empty(E, N, K, dtype=f8, device=w_ENK.device)
        s = torch.empty(E, N // BLOCK, K // BLOCK, dtype=torch.float32, device=w_ENK.device)
        qt = st = None
        if transposed:
            qt = torch.empty(E, K, N, dtype=f8, device=w_ENK.device)
            st = torch.empty(E, K // BLOCK, N // BLOCK, dtype=torch.float32,
                             device=w_ENK.device)
    _quant_weight_kernel[(E, N // BLOCK, K // BLOCK)](w_ENK, q, s, q if qt is None else qt,
                                                      s if st is None else st, N, K,
                                                      POW2=recipe.power_2_scales,
                                                      EPS=float(recipe.amax_epsilon),
                                                      HW=_hw(w_ENK), TRANSPOSED=transposed,
                                                      num_warps=8)
    return q, s, qt, st


@triton.jit
def _swiglu_bwd_chunk(u_base, h1q_base, h1s_base, rows, ok, cols, fb, F, s, alpha, limit,
                      CLAMPED: tl.constexpr, SCORED: tl.constexpr, HW: tl.constexpr):
    """(u, grad_h1 gate part, grad_h1 up part, h2, round(act(h1))) of rows x cols (cols inside
    the 128-column block fb of F), with the fused epilogue's formulas on u rounded to bf16, each
    output rounded to bf16 where it is stored; rows outside `ok` are zeros."""
    mask = ok[:, None]
    u = tl.load(u_base + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    hq = h1q_base + rows[:, None] * (2 * F) + cols[None, :]
    hs = h1s_base + rows * ((2 * F) // 128) + fb
    g = tl.load(hq, mask=mask, other=0.0).to(tl.float32) * tl.load(hs, mask=ok, other=0.0)[:, None]
    v = (tl.load(hq + F, mask=mask, other=0.0).to(tl.float32)
         * tl.load(hs + F // 128, mask=ok, other=0.0)[:, None])
    if SCORED:
        dh = round_bf16(s[:, None] * u, HW)
    else:
        dh = u
    dg, du, h2v = swiglu_grad(g, v, dh, CLAMPED, alpha, limit)
    h2r = round_bf16(h2v, HW)
    if SCORED:
        h2 = round_bf16(s[:, None] * h2v, HW)
    else:
        h2 = h2r
    return u, round_bf16(dg, HW), round_bf16(du, HW), h2, h2r


@triton.jit
def _swiglu_bwd_rows_kernel(u_addr, h1q_addr, h1s_addr, gh1_addr, num_rows_ptr, score_ptrs,
                            score_grad_delta, part_stride, F, alpha, limit,
                            CLAMPED: tl.constexpr, SCORED: tl.constexpr, HW: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    n = tl.load(num_rows_ptr)
    if rb * BLOCK_R >= n:
        return
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n
    mask = ok[:, None]
    c = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    if SCORED:
        s_addr = tl.load(score_ptrs + rows, mask=ok, other=0)
        s_ok = ok & (s_addr != 0)
        s = tl.load(s_addr.to(tl.pointer_type(tl.float32)), mask=s_ok, other=0.0)
    else:
        s = tl.zeros((BLOCK_R,), tl.float32)
    u_base = load_ptr(u_addr, tl.bfloat16)
    u, dg, du, h2, h2r = _swiglu_bwd_chunk(
        u_base, load_ptr(h1q_addr, tl.float8e4nv), load_ptr(h1s_addr, tl.float32), rows, ok, c,
        (cb * BLOCK_N) // 128, F, s, alpha, limit, CLAMPED, SCORED, HW)
    gp = load_ptr(gh1_addr, tl.bfloat16) + rows[:, None] * (2 * F) + c[None, :]
    tl.store(gp, dg.to(tl.bfloat16), mask=mask)
    tl.store(gp + F, du.to(tl.bfloat16), mask=mask)
    # h2 over u: another layout's threads may store a value this thread loaded, so every
    # load of u ends before any store to its region (the compiler's layout conversions
    # synchronise too; this does not rely on them)
    tl.debug_barrier()
    tl.store(u_base + rows[:, None] * F + c[None, :], h2.to(tl.bfloat16), mask=mask)
    if SCORED:
        part = tl.sum(tl.where(mask, u * h2r, 0.0), axis=1)
        p_addr = s_addr + (score_grad_delta + cb.to(tl.int64) * part_stride)
        tl.store(p_addr.to(tl.pointer_type(tl.float32)), part, mask=s_ok)


def swiglu_bwd_rows(u_h2, h1q, gh1, num_rows: torch.Tensor, max_rows: int, F: int, *,
                    score_ptrs=None, score_grad_delta: int = 0, part_stride: int = 0,
                    block_n: int = 128, activation: str = "swiglu", swiglu_alpha: float = 1.702,
                    swiglu_limit: float = 7.0) -> None:
    """The SwiGLU backward of the fp8_block W2 DGRAD, after a GEMM that stored u = g3 W2^T.

    u_h2        bf16 [R, F] (tensor or device pointer): u on entry, h2 on return (in place)
    h1q         the saved h1 row bundle (q [R, 2F] e4m3, s [R, 2F/128] fp32)
    gh1         bf16 [R, 2F]: grad_h1 = act'(h1) round(s u)
    num_rows    int32 [1] on the device: R
    score_ptrs  int64 [>= max_rows]: each row's score address (the owner's, 0: none), as the
                fused epilogue's; then h2 = round(s act(h1)), and each block_n-wide column
                block's <u, round(act(h1))> goes to the part slot at score_ptrs[r] +
                score_grad_delta + block * part_stride (block_n: the fp8 GEMM's n-tile, so the
                owner finds as many parts as that epilogue writes). Without, s = 1.
    """
    assert F % 128 == 0 and F % block_n == 0, f"F={F}: a multiple of 128 and of block_n"
    assert 16 <= block_n <= 128 and 128 % block_n == 0, (
        f"block_n={block_n}: 16 to 128 dividing 128 (one h1 scale per 128 columns)")
    dev = num_rows.device
    q, sc = h1q
    if score_ptrs is not None:
        check_rows(score_ptrs, "score_ptrs", max_rows, dev)
    BLOCK_R = 16
    grid = (max(1, triton.cdiv(max_rows, BLOCK_R)), F // block_n)
    _swiglu_bwd_rows_kernel[grid](
        as_device_ptr(u_h2, "u_h2", torch.bfloat16), as_device_ptr(q, "h1q"),
        as_device_ptr(sc, "h1q scales"), as_device_ptr(gh1, "gh1", torch.bfloat16), num_rows,
        score_ptrs if score_ptrs is not None else num_rows, int(score_grad_delta),
        int(part_stride), F, float(swiglu_alpha), float(swiglu_limit),
        CLAMPED=activation == "swiglu_clamped", SCORED=score_ptrs is not None, HW=_hw(num_rows),
        BLOCK_R=BLOCK_R, BLOCK_N=block_n, num_warps=4)

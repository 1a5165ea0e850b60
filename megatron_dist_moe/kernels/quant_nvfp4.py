"""NVFP4 row quantization kernels (Triton): the twins of quant/nvfp4.py's byte rows, bit-equal.

    quantize_rows   bf16 rows [R, K] -> NVFP4 byte rows (layout.nvfp4_row_bytes(K) each: packed
                    E2M1 | E4M3 scales per 16 | the row's fp32 S_dec), each row its own tensor
                    (its amax sets its global scale): what a source rank publishes, and
                    the dense GEMM's bf16 h2 (optionally with its a16, as swiglu_quant)
    publish_quantized  quantize_rows of a source rank's tokens into its dispatch buffer, with
                    the routing header (T, int16 IDs), in one launch
    swiglu_quant    h1 [R, 2F] -> the byte rows of h2 = round(act(h1)) (the W2 operand), and
                    optionally their decoded values (a16) from the same pass
    dequantize_rows byte rows -> fp16 values without the rows' global scales (exact)
    fanout_dequantize  the owner's fan-out of byte rows (rows.fanout_rows) with their decode
                    into a16 in the same pass

and the E2M1 decode the NVFP4 GEMM shares (_decode_f16: Triton ops; _decode_f16_asm: the same
bits in packed PTX, which the interpreter cannot run).

One program per row: a first pass finds the row's amax, a second (from L2) quantizes. R is a
device value (num_rows); the grid is the host bound. Conversions that must round exactly use
IEEE divisions (div_rn) and, in the interpreter, quant_fp8's integer E4M3 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import nvfp4_row_bytes
from .common import as_device_ptr, load_ptr
from .quant_fp8 import _hw, block_amax, round_bf16, to_e4m3
from .rows import _act_fwd, check_publish_ids, publish_ids, schedule_args

__all__ = ["quantize_rows", "publish_quantized", "swiglu_quant", "fanout_dequantize",
           "dequantize_rows", "DEQ_ORDERS", "e2m1_code"]

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_RCP_E2M1_MAX = tl.constexpr(1.0 / 6.0)       # fp32(1/6), TE's fp4_max_inv


@triton.jit
def e2m1_code(x):
    """int32 E2M1 codes (0..15) of fp32 x: round to nearest even, saturating at +-6, the sign
    kept for results that round to zero, NaN -> 7 (quant/nvfp4.e2m1_codes)."""
    a = tl.abs(x)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return tl.where(x != x, 7, mag | (sign << 3))


@triton.jit
def _load_values(src, r, c, K, F, ACT: tl.constexpr, CLAMPED: tl.constexpr, alpha, limit,
                 HW: tl.constexpr):
    """fp32 values c of row r (0 past the row's end): x[r, c] (ACT False, row stride K) or
    round_bf16(act(g, u)) of h1 = [g | u] (row stride 2F; act(0, 0) = 0)."""
    ok = c < K
    if ACT:
        g = tl.load(src + r * (2 * F) + c, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(src + r * (2 * F) + F + c, mask=ok, other=0.0).to(tl.float32)
        return round_bf16(_act_fwd(g, u, CLAMPED, alpha, limit), HW)
    return tl.load(src + r * K + c, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _in_a16_order(v, CHUNK: tl.constexpr, FRAGMENT: tl.constexpr):
    """[1, CHUNK] values of a row in k order, rearranged into the order a16 stores them: as they
    are ("k"), or quant/nvfp4.a16_fragment_index's order within each 128-wide chunk
    ("fragment", the wgmma GEMM's: position 16s + 8o + 2q + j holds value 32q + 4s + 2j + o).
    The values move in registers (a layout conversion through shared memory), so the stores
    stay contiguous: storing each value at its permuted address instead scattered 2-byte
    stores over the row and ran the fan-out at half its k-order speed."""
    if FRAGMENT:
        tl.static_assert(CHUNK % 128 == 0, "the fragment order permutes 128-wide chunks")
        v5 = tl.reshape(v, (CHUNK // 128, 4, 8, 2, 2))          # (chunk, q, s, j, o)
        return tl.reshape(tl.permute(v5, (0, 2, 4, 1, 3)), (1, CHUNK))   # (chunk, s, o, q, j)
    return v


@triton.jit
def _quant_row(src, r, out, a16, K, alpha, limit, ACT: tl.constexpr, CLAMPED: tl.constexpr,
               CHUNK: tl.constexpr, PAD: tl.constexpr, HW: tl.constexpr, A16: tl.constexpr,
               VALUES: tl.constexpr):
    """The NVFP4 byte row of row r of src (bf16) at out (uint8): two passes, the second from
    L2 (one when the row is one CHUNK). A16 (1 "k", 2 "fragment"): the row's values before its
    global scale also go to a16 (fp16, dequantize_rows' result without its launch). VALUES
    False (with A16): only the row's S_dec and pad are stored in out, not its packed values and
    block scales."""
    F = K      # ACT: the row is h2 [F] from h1 [2F]
    amax = tl.zeros((), tl.float32)
    for k0 in range(0, K, CHUNK):
        v = _load_values(src, r, k0 + tl.arange(0, CHUNK), K, F, ACT, CLAMPED, alpha, limit, HW)
        amax = tl.maximum(amax, block_amax(v, 0))
    # S_enc = fminf(2688 / amax, FLT_MAX), 1 for amax 0 or inf; S_dec = fp32(1.0 / S_enc) in
    # double (quant/nvfp4.global_scale / global_decode_scale)
    s_enc = tl.minimum(tl.math.div_rn(tl.full((), 2688.0, tl.float32), amax), _FLT_MAX)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    s_dec = (tl.full((), 1.0, tl.float64) / s_enc.to(tl.float64)).to(tl.float32)   # div.rn.f64
    mult = s_enc * _RCP_E2M1_MAX
    NB: tl.constexpr = CHUNK // 16
    for k0 in range(0, K, CHUNK):
        v = _load_values(src, r, k0 + tl.arange(0, CHUNK), K, F, ACT, CLAMPED, alpha, limit, HW)
        v2 = tl.reshape(v, (NB, 16))
        s = tl.minimum(block_amax(v2, 1) * mult, _FLT_MAX)
        s8 = to_e4m3(s, HW)                                           # satfinite, RNE
        rcp = tl.minimum(tl.math.div_rn(tl.full((NB,), 1.0, tl.float32),
                                        s8.to(tl.float32) * s_dec), _FLT_MAX)
        codes = e2m1_code(v2 * rcp[:, None])                          # [NB, 16]
        lo, hi = tl.split(tl.reshape(codes, (CHUNK // 2, 2)))
        cb = k0 // 2 + tl.arange(0, CHUNK // 2)
        packed = (lo | (hi << 4)).to(tl.uint8)
        cs = k0 // 16 + tl.arange(0, NB)
        s8_bits = s8.to(tl.uint8, bitcast=True)
        if VALUES:
            tl.store(out + cb, packed, mask=cb < K // 2)
            tl.store(out + K // 2 + cs, s8_bits, mask=cs < K // 16)
        if A16 > 0:
            # decoded from the stored bytes by dequantize_rows' own steps, so a16 is its result
            # bit for bit (a decode from the codes and the fp8 scale through fp32 gave other
            # bits on sm_90)
            _decode_into_a16(packed, s8_bits, k0, K, a16, CHUNK, A16 == 2)
    tail = K // 2 + K // 16
    tl.store((out + tail).to(tl.pointer_type(tl.float32)), s_dec)
    if PAD > 0:
        p = tl.arange(0, 16)
        tl.store(out + tail + 4 + p, tl.zeros((16,), tl.uint8), mask=p < PAD)


@triton.jit
def _quant_rows_kernel(src_addr, num_rows_ptr, out_addr, a16_addr, K, out_stride, alpha, limit,
                       ACT: tl.constexpr, CLAMPED: tl.constexpr, CHUNK: tl.constexpr,
                       PAD: tl.constexpr, HW: tl.constexpr, A16: tl.constexpr,
                       VALUES: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    if r >= tl.load(num_rows_ptr):
        return
    src = load_ptr(src_addr, tl.bfloat16)
    out = load_ptr(out_addr, tl.uint8) + r * out_stride
    if A16 > 0:
        _quant_row(src, r, out, load_ptr(a16_addr, tl.float16) + r * K, K, alpha, limit, ACT,
                   CLAMPED, CHUNK, PAD, HW, A16, VALUES)
    else:
        _quant_row(src, r, out, a16_addr, K, alpha, limit, ACT, CLAMPED, CHUNK, PAD, HW, 0, True)


@triton.jit
def _publish_quant_kernel(x_ptr, ids_ptr, header_ptr, ids16_ptr, out_ptr, sched_ptr, sched_mul, T,
                          K, out_stride, KI: tl.constexpr, KI_PAD: tl.constexpr,
                          CHUNK: tl.constexpr, PAD: tl.constexpr, HW: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    publish_ids(t, T, ids_ptr, header_ptr, ids16_ptr, sched_ptr, sched_mul, KI, KI_PAD)
    if t < T:
        _quant_row(x_ptr, t, out_ptr + t * out_stride, x_ptr, K, 1.702, 7.0, False, False,
                   CHUNK, PAD, HW, 0, True)


@triton.jit
def _decode_f16(packed, scales16, ROWS: tl.constexpr, BK: tl.constexpr):
    """fp16 [ROWS, BK] of packed bytes [ROWS, BK/2] with one fp16 scale per 16 values
    [ROWS, BK/16], by bit placement: an E2M1 code's sign to bit 15 and its three magnitude bits
    to bits 11..9 give the fp16 of value x 2^-14 (E2M1's subnormal 0.5 lands on fp16's
    subnormal 2^-15), which one multiply by 2^14 and one by the E4M3 scale make exact: the
    products have at most 6 significant bits and lie in [2^-10, 2688], fp16's normal range."""
    b = packed.to(tl.uint16)
    lo = ((b << 12) & 0x8000) | ((b << 9) & 0x0E00)                   # element 2j
    hi = ((b << 8) & 0x8000) | ((b << 5) & 0x0E00)                    # element 2j + 1
    codes = tl.reshape(tl.join(lo, hi), (ROWS, BK)).to(tl.float16, bitcast=True) * 16384.0
    v = tl.reshape(codes, (ROWS, BK // 16, 16)) * scales16[:, :, None]
    return tl.reshape(v, (ROWS, BK))


@triton.jit
def _decode_chunk(packed, s8, CHUNK: tl.constexpr):
    """fp16 [1, CHUNK]: CHUNK values of a byte row, from their packed bytes [CHUNK/2] and E4M3
    scale bytes [CHUNK/16] (uint8), before the row's global scale. The one decode of stored
    byte rows: dequantize_rows, the fan-out and the quantizers' a16 all run it, so their a16
    agree bit for bit."""
    s16 = s8.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return _decode_f16(packed[None, :], s16[None, :], 1, CHUNK)


@triton.jit
def _decode_into_a16(packed, s8, k0, K, a16, CHUNK: tl.constexpr, FRAGMENT: tl.constexpr):
    """_decode_chunk of values [k0, k0 + CHUNK) of a row into its a16 row (fp16 at a16, in
    _in_a16_order; values past K not stored: K % 128 == 0 in the fragment order, so no value moves
    across K)."""
    c = k0 + tl.arange(0, CHUNK)[None, :]
    tl.store(a16 + c, _in_a16_order(_decode_chunk(packed, s8, CHUNK), CHUNK, FRAGMENT), mask=c < K)


# Two E2M1 codes per byte, four bytes per call: prmt spreads bytes 0,1 (2,3) into the low bytes of
# two 16-bit lanes; shifts and masks place each nibble's sign at bit 15 and its magnitude at bits
# 11..9 (the fp16 of value x 2^-14, as _decode_f16); two f16x2 multiplies apply 2^14 and the
# block's scale. Outputs: $0,$1 the low nibbles of bytes 0..3, $2,$3 the high ones; inputs: $4
# the four bytes, $5,$6 their scales.
_E2M1X4_ASM = tl.constexpr("""
{
.reg .b32 x<2>, l<2>, h<2>, t, c;
mov.b32 c, 0x74007400;
prmt.b32 x0, $4, 0, 0x4140;
prmt.b32 x1, $4, 0, 0x4342;
shl.b32 t, x0, 12; and.b32 l0, t, 0x80008000; shl.b32 t, x0, 9; and.b32 t, t, 0x0E000E00; or.b32 l0, l0, t;
shl.b32 t, x1, 12; and.b32 l1, t, 0x80008000; shl.b32 t, x1, 9; and.b32 t, t, 0x0E000E00; or.b32 l1, l1, t;
shl.b32 t, x0, 8; and.b32 h0, t, 0x80008000; shl.b32 t, x0, 5; and.b32 t, t, 0x0E000E00; or.b32 h0, h0, t;
shl.b32 t, x1, 8; and.b32 h1, t, 0x80008000; shl.b32 t, x1, 5; and.b32 t, t, 0x0E000E00; or.b32 h1, h1, t;
mul.rn.f16x2 l0, l0, c; mul.rn.f16x2 l1, l1, c; mul.rn.f16x2 h0, h0, c; mul.rn.f16x2 h1, h1, c;
mul.rn.f16x2 $0, l0, $5; mul.rn.f16x2 $1, l1, $6; mul.rn.f16x2 $2, h0, $5; mul.rn.f16x2 $3, h1, $6;
}
""")


@triton.jit
def _decode_f16_asm(packed, scales16, ROWS: tl.constexpr, BK: tl.constexpr):
    """_decode_f16 in packed PTX (about three instructions per value instead of eight)."""
    b = tl.reshape(packed, (ROWS, BK // 16, 8))
    sc = tl.broadcast_to(scales16[:, :, None], (ROWS, BK // 16, 8))
    lo, hi = tl.inline_asm_elementwise(_E2M1X4_ASM, "=r,=r,=r,=r,r,r,r", [b, sc],
                                       dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return tl.reshape(tl.join(lo, hi), (ROWS, BK))


@triton.jit
def _deq_rows_kernel(src_addr, num_rows_ptr, out_addr, K, src_stride, CHUNK: tl.constexpr,
                     FRAGMENT: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    if r >= tl.load(num_rows_ptr):
        return
    src = load_ptr(src_addr, tl.uint8) + r * src_stride
    out = load_ptr(out_addr, tl.float16) + r * K
    for k0 in range(0, K, CHUNK):
        cb = k0 // 2 + tl.arange(0, CHUNK // 2)
        packed = tl.load(src + cb, mask=cb < K // 2, other=0)
        cs = k0 // 16 + tl.arange(0, CHUNK // 16)
        s8 = tl.load(src + K // 2 + cs, mask=cs < K // 16, other=0)
        _decode_into_a16(packed, s8, k0, K, out, CHUNK, FRAGMENT)


@triton.jit
def _fanout_deq_kernel(src_base_ptr, dest_ptr, xg_addr, a16_addr, num_rows_ptr, n_tokens, T,
                       src_stride_bytes, D, W, KR: tl.constexpr, KR_PAD: tl.constexpr,
                       CH: tl.constexpr, FRAGMENT: tl.constexpr, VALUES: tl.constexpr):
    tok = tl.program_id(0)            # flat (source rank r, token t)
    c0 = tl.program_id(1) * CH        # its values [c0, c0 + CH)
    if tok >= n_tokens:
        return
    n = tl.load(num_rows_ptr).to(tl.int64)
    kk = tl.arange(0, KR_PAD)
    d = tl.load(dest_ptr + tok.to(tl.int64) * KR + kk, mask=kk < KR, other=-1).to(tl.int64)
    ok = (d >= 0) & (d < n)
    if tl.sum(ok.to(tl.int32), 0) == 0:
        return                        # no route of this token lands here: no peer read
    r = tok // T
    src = (tl.load(src_base_ptr + r) + (tok - r * T).to(tl.int64) * src_stride_bytes).to(
        tl.pointer_type(tl.uint8))
    xg = load_ptr(xg_addr, tl.uint8)
    a16 = load_ptr(a16_addr, tl.float16)
    cb = c0 // 2 + tl.arange(0, CH // 2)
    pm = cb < D // 2
    packed = tl.load(src + cb, mask=pm, other=0)          # read once ...
    cs = c0 // 16 + tl.arange(0, CH // 16)
    sm = cs < D // 16
    s8 = tl.load(src + D // 2 + cs, mask=sm, other=0)
    v = tl.reshape(_in_a16_order(_decode_chunk(packed, s8, CH), CH, FRAGMENT), (CH,))
    c = c0 + tl.arange(0, CH)
    tb = tl.arange(0, 32)             # S_dec and the pad, by the first column block
    tm = (tb < W - D // 2 - D // 16) & (c0 == 0)
    tail = tl.load(src + D // 2 + D // 16 + tb, mask=tm, other=0)
    for k in tl.static_range(KR_PAD):
        dk = tl.sum(tl.where(kk == k, d, 0), 0)
        okk = tl.sum(tl.where(kk == k, ok.to(tl.int32), 0), 0) > 0
        row = xg + dk * W                                 # ... written to every row
        if VALUES:
            tl.store(row + cb, packed, mask=pm & okk)
            tl.store(row + D // 2 + cs, s8, mask=sm & okk)
        tl.store(row + D // 2 + D // 16 + tb, tail, mask=tm & okk)
        tl.store(a16 + dk * D + c, v, mask=(c < D) & okk)


def fanout_dequantize(src_base_EP: torch.Tensor, src_stride_bytes: int, dest_rows: torch.Tensor,
                      T: int, K_routes: int, x_g, num_rows: torch.Tensor, D: int, *, a16,
                      order: str = "k", s_dec_only: bool = False) -> None:
    """rows.fanout_rows of NVFP4 byte rows (layout.nvfp4_row_bytes(D) each) into x_g, and in
    the same pass dequantize_rows(x_g, order=order) into a16 (fp16 [>= R, D]): each token's
    byte row is read once over NVLink and decoded once for all of its rows here. x_g, a16:
    tensors or device pointers. s_dec_only: of each x_g row only its S_dec and pad are written
    (the NVFP4 GEMMs given a16 read nothing else of a byte row)."""
    assert order in DEQ_ORDERS, f"order={order!r}: expected one of {DEQ_ORDERS}"
    assert D % 32 == 0 and (order == "k" or D % 128 == 0), (
        f"D={D}: a multiple of 32 (128 for order='fragment')")
    EP = src_base_EP.numel()
    assert src_stride_bytes >= nvfp4_row_bytes(D), (
        f"src_stride_bytes={src_stride_bytes}: below one byte row ({nvfp4_row_bytes(D)})")
    assert dest_rows.numel() == EP * T * K_routes and dest_rows.dtype == torch.int32, (
        f"dest_rows: int32 [EP*T*K] = [{EP * T * K_routes}], got {dest_rows.dtype} "
        f"[{dest_rows.numel()}]")
    if EP * T == 0:
        return
    ch = min(1024, triton.next_power_of_2(D))
    _fanout_deq_kernel[(EP * T, triton.cdiv(D, ch))](
        src_base_EP, dest_rows, as_device_ptr(x_g, "x_g"),
        as_device_ptr(a16, "a16", torch.float16), num_rows, EP * T, T, src_stride_bytes, D,
        nvfp4_row_bytes(D), KR=K_routes, KR_PAD=max(2, triton.next_power_of_2(K_routes)), CH=ch,
        FRAGMENT=order == "fragment", VALUES=not s_dec_only, num_warps=4)


_ONE_PASS = 8192   # rows up to this width are read once (one masked block: one load round trip)


def _chunk(K: int) -> tuple[int, int]:
    """(values per step, warps) of a row: the whole row as one masked block up to _ONE_PASS
    (a decode step's few rows are latency-bound: one load round trip instead of one per 512
    values), else the largest power of two up to 512 dividing K."""
    assert K % 32 == 0, f"K={K} must be a multiple of 32"
    if K <= _ONE_PASS:
        c = triton.next_power_of_2(K)
        return c, 8 if c >= 4096 else 4
    c = 512
    while K % c:
        c //= 2
    return c, 4


def _row_layout(K: int, out_stride: int | None) -> tuple[int, int, int, int]:
    """(out_stride, pad bytes, CHUNK, warps) of the row quantizers' byte rows of K values. They
    store a row's fp32 S_dec at byte K/2 + K/16: 4-byte aligned for K % 64 == 0 (Config asks
    multiples of 128 of D and F for nvfp4)."""
    assert K % 64 == 0, (f"K={K}: the NVFP4 row quantizers need a multiple of 64 (the row's fp32 "
                         f"S_dec at byte K/2 + K/16 = {K // 2 + K // 16} must be 4-byte aligned)")
    W = nvfp4_row_bytes(K)
    out_stride = W if out_stride is None else out_stride
    assert out_stride >= W and out_stride % 16 == 0, f"out_stride={out_stride}: >= {W}, % 16"
    return (out_stride, W - (K // 2 + K // 16 + 4)) + _chunk(K)


def _launch(src, num_rows, max_rows, K, out, act, alpha, limit, clamped, out_stride=None,
            a16=None, a16_order="k", s_dec_only=False):
    out_stride, pad, chunk, warps = _row_layout(K, out_stride)
    assert a16 is not None or not s_dec_only, (
        "s_dec_only=True needs a16: without it the byte rows are the only output")
    assert a16_order in DEQ_ORDERS, f"a16_order={a16_order!r}: expected one of {DEQ_ORDERS}"
    assert a16_order == "k" or K % 128 == 0, f"a16_order='fragment' needs K % 128 == 0, K={K}"
    src_addr = as_device_ptr(src, "src", torch.bfloat16)
    _quant_rows_kernel[(max(1, max_rows),)](
        src_addr, num_rows, as_device_ptr(out, "out"),
        src_addr if a16 is None else as_device_ptr(a16, "a16", torch.float16), K, out_stride,
        float(alpha), float(limit), ACT=act, CLAMPED=clamped, CHUNK=chunk, PAD=pad,
        HW=_hw(num_rows), A16=0 if a16 is None else DEQ_ORDERS.index(a16_order) + 1,
        VALUES=not s_dec_only, num_warps=warps)


def quantize_rows(x, num_rows: torch.Tensor, max_rows: int, K: int, *, out,
                  out_stride: int | None = None, a16=None, a16_order: str = "k",
                  s_dec_only: bool = False) -> None:
    """out [>= R, nvfp4_row_bytes(K)] uint8 = quant/nvfp4.quantize_row_bytes(x [R, K] bf16)
    (tensors or device pointers; R = num_rows[0] on the device, max_rows its host bound);
    out_stride: bytes between out's rows (default the row size; a source rank writes its rows
    into the dispatch buffer's bf16 row slots, 2K bytes apart). a16 (fp16 [>= R, K], tensor or
    device pointer): also what dequantize_rows(out, order=a16_order) would write there, from the
    same pass (as swiglu_quant's). s_dec_only (with a16): of each out row only its S_dec and pad
    are written (the NVFP4 GEMMs given a16 read nothing else of a byte row)."""
    _launch(x, num_rows, max_rows, K, out, False, 1.702, 7.0, False, out_stride, a16=a16,
            a16_order=a16_order, s_dec_only=s_dec_only)


def publish_quantized(x_TD: torch.Tensor, ids_TK: torch.Tensor, header: torch.Tensor,
                      ids16: torch.Tensor, dispatch: torch.Tensor, out_stride: int,
                      sched=None) -> None:
    """A source rank's publication in NVFP4, one launch: header = [T, schedule word]
    (rows.schedule_args), ids16[:T*K] = ids_TK as int16 and dispatch's row t (out_stride bytes
    apart) = quantize_rows(x_TD)[t] (what rows.publish_tokens does for bf16 rows)."""
    T, K = x_TD.shape
    KI = ids_TK.shape[1]
    out_stride, pad, chunk, warps = _row_layout(K, out_stride)
    assert x_TD.dtype == torch.bfloat16 and x_TD.is_contiguous(), "x_TD: dense bf16"
    check_publish_ids(T, ids_TK, header, ids16)
    assert dispatch.numel() * dispatch.element_size() >= T * out_stride, "dispatch: T rows"
    _publish_quant_kernel[(max(1, T),)](
        x_TD, ids_TK, header, ids16, dispatch.view(torch.uint8), *schedule_args(sched, header), T,
        K, out_stride, KI=KI,
        KI_PAD=max(2, triton.next_power_of_2(KI)), CHUNK=chunk, PAD=pad, HW=_hw(header),
        num_warps=warps)


DEQ_ORDERS = ("k", "fragment")


def dequantize_rows(rows, num_rows: torch.Tensor, max_rows: int, K: int, *, out,
                    order: str = "k") -> None:
    """out [>= R, K] fp16 (tensor or device pointer) = the values of NVFP4 byte rows [R,
    nvfp4_row_bytes(K)] before their row's global scale: E2M1 x E4M3 per 16, exact in fp16
    (the NVFP4 GEMM's A operand, decoded once instead of by every program that reads it; the
    GEMM applies each row's S_dec from the byte row). order "k": value k at column k;
    "fragment": each 128-wide chunk in the order of the wgmma GEMM's weight fragments
    (quant/nvfp4.a16_fragment_index; K % 128 == 0)."""
    assert order in DEQ_ORDERS, f"order={order!r}: expected one of {DEQ_ORDERS}"
    assert order == "k" or K % 128 == 0, f"order='fragment' needs K % 128 == 0, got K={K}"
    chunk, warps = _chunk(K)
    _deq_rows_kernel[(max(1, max_rows),)](as_device_ptr(rows, "rows"), num_rows,
                                          as_device_ptr(out, "out", torch.float16), K,
                                          nvfp4_row_bytes(K), CHUNK=chunk,
                                          FRAGMENT=order == "fragment", num_warps=warps)


def swiglu_quant(h1, num_rows: torch.Tensor, max_rows: int, F: int, *, out,
                 activation: str = "swiglu", swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, a16=None, a16_order: str = "k",
                 s_dec_only: bool = False) -> None:
    """out [>= R, nvfp4_row_bytes(F)] uint8: the byte rows of h2 = round(act(h1)) from bf16 h1
    [R, 2F] = [g | u]. a16 (fp16 [>= R, F], tensor or device pointer): also what
    dequantize_rows(out, order=a16_order) would write there (the W2 GEMM's operand), from the
    same pass. s_dec_only (with a16): of each out row only its S_dec and pad are written."""
    _launch(h1, num_rows, max_rows, F, out, True, swiglu_alpha, swiglu_limit,
            activation == "swiglu_clamped", a16=a16, a16_order=a16_order, s_dec_only=s_dec_only)

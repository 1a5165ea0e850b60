"""NVFP4 (TransformerEngine's NVFP4BlockScaling): formats and torch twins.

E2M1 values (sign bit, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) with two levels of scale: one
E4M3 decode scale per 16 values along the contraction axis and one fp32 encode scale per tensor
(TE keeps the tensor amax; the scale is a function of it). The rules are TE's CUDA cast kernels
(transformer_engine/common/cast/nvfp4/core_nvfp4.cuh and quantize_transpose_nvfp4.cuh; the
tuned 1D kernel in cast/nvfp4/specialized/ computes the same without fast math), in their fp32
operation order, exactly:

    amax    = max |x| over the tensor, NaN ignored (TE's amax kernel, recipe/current_scaling.cu:
              __hmax / fmaxf); block amaxes likewise over each block
    S_enc   = fminf(fp32(2688 / amax), FLT_MAX), 1 when amax == 0 or the quotient is 0 (amax
              inf); a NaN amax gives FLT_MAX (fminf drops the NaN)
              (compute_global_encode_scaling_factor_FP4, 2688 = 448 * 6)
    S_dec   = fp32(1.0 / S_enc), the division in double as the kernels write it (S_dec_rowwise)
    s       = e4m3_satfinite(block_amax * (S_enc * fp32(1/6))), round to nearest even,
              saturating at 448 (compute_decoding_scaling_factor: S_enc * fp4_max_inv first);
              the block holding the tensor amax gets s = 448
    r       = fminf(1 / (fp32(s) * S_dec), FLT_MAX)          (block_scale_inverse; FLT_MAX for s = 0)
    q       = e2m1(x * r), fp32 product, round to nearest even, saturating at +-6, the sign kept
              for results that round to zero (-0 is code 8), NaN -> +6 (code 7)
              (cvt.rn.satfinite.e2m1x2.f32 in util/ptx_arch_spec.cuh, mul_cvt_*_to_fp4_4x;
              cuda_fp4.h's __nv_cvt_double_to_fp4 gives the same rule in C)
    x ~= q * fp32(s) * S_dec

TE's own dequantizer (cast/nvfp4/dequantize_nvfp4.cuh) and its GEMM alpha (recipe/nvfp4.cu,
compute_nvfp4_per_tensor_scale_kernel) read the amax instead: q * ((fp32(s) * amax) *
fp32(1 / 2688)); `dequantize_rows(..., amax=...)` gives those bits. The two agree to a couple
of fp32 ulps.

TE's Python reference (pytorch/custom_recipes/reference_nvfp4.py, NVFP4QuantizerRef, the one
its tests/pytorch/nvfp4/test_nvfp4_quantize_exact.py hold the kernels to) computes the same
bits, except at inputs those tests never draw: it maps NaN to code 0 and an exact -0.0 to code
0, and keeps S_enc = FLT_MAX for amax == 0 (the data are the same zeros). This module follows
the kernels.

Packing (the cvt's operand order, and the reference's cast_to_fp4x2): byte j of a row holds
element 2j in its low nibble and element 2j+1 in its high nibble.

Layouts:
    rows      packed [R, K/2] uint8, s [R, K/16] float8_e4m3fn, S_enc a 0-d fp32 tensor
    weights   packed [E, N, K/2], one scale per 16 x 16 tile s [E, N/16, K/16], S_enc [E]: TE's
              recipe quantizes weights in 16 x 16 blocks (NVFP4BlockScaling.fp4_quant_fwd_weight,
              fp4_2d_quantization unless NVTE_NVFP4_DISABLE_2D_QUANTIZATION; the 2D kernel in
              quantize_transpose_nvfp4.cuh applies the rules above to 16 x 16 amaxes), so the
              FPROP and DGRAD operands share one quantization (the tile form is transpose-exact),
              with one global scale per expert matrix (TE quantizes each expert's weight as its
              own tensor, with its own amax). TE stores the tile scales once per row
              (rowwise_scale_inv [N, K/16]): s.repeat_interleave(16, 1). block_2d=False gives
              the 1 x 16 form (TE with 2D quantization disabled): s [E, N, K/16].

Byte rows (what a source rank publishes and an expert reads; layout.nvfp4_row_bytes): each
row is quantized as its own tensor (its amax, its S_enc: "the row inverse global scale" of the
design), and stored as one 16-byte aligned byte row: packed [K/2] | scales [K/16] | S_dec fp32.
`quantize_row_bytes` / `dequantize_row_bytes`.

Not covered: the random Hadamard transform TE applies to the column-wise (WGRAD) copies of
inputs and gradients, the stochastic rounding of gradients, row-scaled NVFP4, 4over6, and TE's
fast-math option (a bf16 scale multiplier). Hopper has no FP4 tensor-core instruction and no
E2M1 cvt: this module is the format's definition in plain torch (CPU or CUDA tensors).
"""

from __future__ import annotations

import torch

from .fp8_block import _amax

__all__ = ["BLOCK", "E2M1_MAX", "E4M3_MAX", "FP32_MAX", "E2M1_VALUES", "SCALE_DTYPE",
           "global_scale", "global_decode_scale", "block_scales", "block_encode_scales",
           "e2m1_codes", "pack_e2m1", "unpack_e2m1", "quantize_rows", "dequantize_rows",
           "quantize_weight", "dequantize_weight", "row_bytes", "quantize_row_bytes",
           "split_row_bytes", "dequantize_row_bytes", "a16_fragment_index"]

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP32_MAX = torch.finfo(torch.float32).max
SCALE_DTYPE = torch.float8_e4m3fn
# code -> value; bit 3 is the sign, bits 0-2 the magnitude (cvt.rn.f16x2.e2m1x2's table)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
_F32 = torch.float32
_RCP_E2M1_MAX = torch.tensor(1.0 / 6.0, dtype=_F32)              # fp4_max_inv, fp32(1/6)
_RCP_GLOBAL = torch.tensor(1.0 / (6.0 * 448.0), dtype=_F32)      # dequantize's factor_inv
# e2m1 magnitude codes = the number of rounding thresholds |x| passes; the ties go to the even
# code: 0.25 -> 0, 0.75 -> 2 (1.0), 1.25 -> 2, 1.75 -> 4 (2.0), 2.5 -> 4, 3.5 -> 6 (4.0), 5 -> 6
_ABOVE = (0.25, 1.25, 2.5, 5.0)          # strictly above counts
_AT_LEAST = (0.75, 1.75, 3.5)            # at or above counts


def _f32(t, device=None) -> torch.Tensor:
    return torch.as_tensor(t, dtype=_F32, device=device)


def global_scale(amax) -> torch.Tensor:
    """fp32 global encode scale(s) S_enc of tensor amax(es), TE's
    compute_global_encode_scaling_factor_FP4 (core_nvfp4.cuh)."""
    amax = _f32(amax)
    s = torch.fmin(torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax, torch.full_like(amax, FP32_MAX))
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def global_decode_scale(s_enc) -> torch.Tensor:
    """fp32 S_dec = 1.0 / S_enc, the kernels' S_dec_rowwise: a double division rounded to fp32,
    as they write it (the fp32 quotient itself but for subnormal results)."""
    s_enc = _f32(s_enc)
    return (1.0 / s_enc.to(torch.float64)).to(_F32)


def block_scales(block_amax: torch.Tensor, s_enc) -> torch.Tensor:
    """float8_e4m3fn decode scales of blocks with these (fp32) amaxes under encode scale s_enc
    (a scalar, or broadcastable): compute_decoding_scaling_factor (core_nvfp4.cuh)."""
    block_amax = block_amax.to(_F32)
    mult = _f32(s_enc, block_amax.device) * _RCP_E2M1_MAX.to(block_amax.device)
    s = torch.fmin(block_amax * mult, torch.full_like(block_amax, FP32_MAX))
    return torch.clamp(s, -E4M3_MAX, E4M3_MAX).to(SCALE_DTYPE)     # satfinite


def block_encode_scales(scales: torch.Tensor, s_enc) -> torch.Tensor:
    """fp32 multipliers r = fminf(1 / (fp32(s) * S_dec), FLT_MAX) (block_scale_inverse)."""
    s_dec = global_decode_scale(s_enc).to(scales.device)
    r = 1.0 / (scales.to(_F32) * s_dec)
    return torch.fmin(r, torch.full_like(r, FP32_MAX))


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (0..15) of x (converted to fp32 exactly): round to nearest even,
    saturating at +-6, sign kept (-0 and negatives that round to zero give 8), NaN -> 7."""
    x = x.to(_F32)
    a = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _ABOVE:
        mag += (a > t).to(torch.uint8)
    for t in _AT_LEAST:
        mag += (a >= t).to(torch.uint8)
    codes = mag | (torch.signbit(x).to(torch.uint8) << 3)
    return torch.where(torch.isnan(x), torch.full_like(codes, 7), codes)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes -> uint8 [..., K/2]: element 2j in the low nibble of byte j."""
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: codes must have an even last dimension, got shape "
                         f"{tuple(codes.shape)}")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K] (the inverse of pack_e2m1)."""
    if packed.dim() == 0:
        raise ValueError("unpack_e2m1: packed must have at least one dimension")
    p = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)


def _tensor_amax(t: torch.Tensor, dims) -> torch.Tensor:
    """NaN-ignoring amax over dims; 0 for an empty tensor (TE's amax kernel starts at 0)."""
    if t.numel() == 0:
        keep = [n for i, n in enumerate(t.shape) if i not in dims]
        return t.new_zeros(keep, dtype=_F32)
    return _amax(t, dims)


def _check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {ndim}-d tensor, got {shape}")
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def _quantize_blocks(blocks: torch.Tensor, scales: torch.Tensor, s_enc, expand) -> torch.Tensor:
    """codes of blocks (fp32) scaled by their blocks' multipliers (expand(r) broadcasts)."""
    return e2m1_codes(blocks * expand(block_encode_scales(scales, s_enc)))


def quantize_rows(x_RK: torch.Tensor, global_amax=None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1 x 16 blocks along the last axis: (packed uint8 [R, K/2], scales e4m3 [R, K/16],
    S_enc 0-d fp32). global_amax (default: the NaN-ignoring amax of x) sets S_enc, as TE's
    amax (possibly all-reduced) does."""
    _check_float("quantize_rows: x_RK", x_RK, 2)
    R, K = x_RK.shape
    if K % BLOCK:
        raise ValueError(f"quantize_rows: x_RK's last dimension K={K} must be a multiple of {BLOCK}")
    x = x_RK.to(_F32)
    amax = _tensor_amax(x, (0, 1)) if global_amax is None else _f32(global_amax, x.device).reshape(())
    s_enc = global_scale(amax)
    blocks = x.view(R, K // BLOCK, BLOCK)
    scales = block_scales(_amax(blocks, -1), s_enc)
    codes = _quantize_blocks(blocks, scales, s_enc, lambda r: r.unsqueeze(-1))
    return pack_e2m1(codes.view(R, K)), scales, s_enc


def row_bytes(K: int) -> int:
    """Bytes of one byte row of K values (layout.nvfp4_row_bytes)."""
    from ..layout import nvfp4_row_bytes
    return nvfp4_row_bytes(K)


def quantize_row_bytes(x_RK: torch.Tensor) -> torch.Tensor:
    """uint8 [R, row_bytes(K)]: every row quantized as its own tensor (1 x 16 blocks, the row's
    NaN-ignoring amax sets its S_enc), laid out packed | scales | S_dec (fp32), zero padding."""
    _check_float("quantize_row_bytes: x_RK", x_RK, 2)
    R, K = x_RK.shape
    if K % BLOCK:
        raise ValueError(f"quantize_row_bytes: x_RK's last dimension K={K} must be a multiple "
                         f"of {BLOCK}")
    x = x_RK.to(_F32)
    s_enc = global_scale(_tensor_amax(x, (1,)))                         # [R]
    blocks = x.view(R, K // BLOCK, BLOCK)
    scales = block_scales(_amax(blocks, -1), s_enc[:, None])
    codes = _quantize_blocks(blocks, scales, s_enc[:, None], lambda r: r.unsqueeze(-1))
    out = torch.zeros(R, row_bytes(K), dtype=torch.uint8, device=x.device)
    a, b = K // 2, K // 2 + K // BLOCK
    out[:, :a] = pack_e2m1(codes.view(R, K))
    out[:, a:b] = scales.view(torch.uint8)
    out[:, b:b + 4] = global_decode_scale(s_enc).view(R, 1).view(torch.uint8)
    return out


def split_row_bytes(rows: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [R, K/2], scales e4m3 [R, K/16], S_dec fp32 [R]) views of byte rows."""
    if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[1] != row_bytes(K):
        raise ValueError(f"split_row_bytes: rows must be uint8 [R, {row_bytes(K)}] for K={K}, "
                         f"got {rows.dtype} {tuple(rows.shape)}")
    a, b = K // 2, K // 2 + K // BLOCK
    return (rows[:, :a], rows[:, a:b].view(SCALE_DTYPE),
            rows[:, b:b + 4].clone().view(_F32).view(-1))


def dequantize_row_bytes(rows: torch.Tensor, K: int) -> torch.Tensor:
    """fp32 [R, K] of byte rows: q * (fp32(s) * S_dec) with each row's own S_dec."""
    packed, scales, s_dec = split_row_bytes(rows, K)
    R = rows.shape[0]
    q = E2M1_VALUES.to(rows.device)[unpack_e2m1(packed.contiguous()).long()]
    f = scales.to(_F32) * s_dec[:, None]
    return (q.view(R, K // BLOCK, BLOCK) * f.unsqueeze(-1)).view(R, K)


def _check_packed(name: str, packed: torch.Tensor, scales: torch.Tensor, ndim: int) -> None:
    if packed.dim() != ndim or packed.dtype != torch.uint8:
        raise ValueError(f"{name}: packed must be a {ndim}-d uint8 tensor, got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    if scales.dim() != ndim or scales.dtype != SCALE_DTYPE:
        raise ValueError(f"{name}: scales must be a {ndim}-d {SCALE_DTYPE} tensor, got "
                         f"{tuple(scales.shape)} {scales.dtype}")


def _decode_factor(scales: torch.Tensor, s_enc: torch.Tensor, amax) -> torch.Tensor:
    s = scales.to(_F32)
    if amax is None:
        return s * global_decode_scale(s_enc).to(s.device)
    return (s * _f32(amax, s.device)) * _RCP_GLOBAL.to(s.device)      # dequantize_fp4_kernel


def dequantize_rows(packed: torch.Tensor, scales: torch.Tensor, global_scale, *, amax=None
                    ) -> torch.Tensor:
    """fp32 [R, K]: q * (fp32(s) * S_dec); with amax (the tensor amax TE stores), TE's
    dequantizer's q * ((fp32(s) * amax) * fp32(1/2688))."""
    _check_packed("dequantize_rows", packed, scales, 2)
    R, K = packed.shape[0], packed.shape[1] * 2
    if tuple(scales.shape) != (R, K // BLOCK):
        raise ValueError(f"dequantize_rows: scales {tuple(scales.shape)} do not match packed "
                         f"{tuple(packed.shape)} (want {(R, K // BLOCK)})")
    q = E2M1_VALUES.to(packed.device)[unpack_e2m1(packed).long()]
    f = _decode_factor(scales, _f32(global_scale, packed.device), amax)
    return (q.view(R, K // BLOCK, BLOCK) * f.unsqueeze(-1)).view(R, K)


def quantize_weight(w_ENK: torch.Tensor, global_amax=None, *, block_2d: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per expert matrix (its own amax and S_enc): (packed uint8 [E, N, K/2], scales e4m3
    [E, N/16, K/16] per 16 x 16 tile (block_2d=False: [E, N, K/16] per 1 x 16 block),
    S_enc fp32 [E]). global_amax [E] overrides the experts' amaxes."""
    _check_float("quantize_weight: w_ENK", w_ENK, 3)
    E, N, K = w_ENK.shape
    if K % BLOCK or (block_2d and N % BLOCK):
        need = "N and K" if block_2d else "K"
        raise ValueError(f"quantize_weight: w_ENK's {need} must be multiples of {BLOCK}, got "
                         f"[{E}, {N}, {K}]")
    w = w_ENK.to(_F32)
    if global_amax is None:
        amax = _tensor_amax(w, (1, 2))
    else:
        amax = _f32(global_amax, w.device).reshape(-1)
        if amax.numel() != E:
            raise ValueError(f"quantize_weight: global_amax must hold {E} values, got {amax.numel()}")
    s_enc = global_scale(amax)
    if block_2d:
        tiles = w.view(E, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
        scales = block_scales(_amax(tiles, (2, 4)), s_enc[:, None, None])
        codes = _quantize_blocks(tiles, scales, s_enc[:, None, None], lambda r: r[:, :, None, :, None])
    else:
        blocks = w.view(E, N, K // BLOCK, BLOCK)
        scales = block_scales(_amax(blocks, -1), s_enc[:, None, None])
        codes = _quantize_blocks(blocks, scales, s_enc[:, None, None], lambda r: r.unsqueeze(-1))
    return pack_e2m1(codes.reshape(E, N, K)), scales, s_enc


def dequantize_weight(packed: torch.Tensor, scales: torch.Tensor, global_scales, *, amax=None
                      ) -> torch.Tensor:
    """fp32 [E, N, K] from quantize_weight's output (either scale form: [E, N/16, K/16] tiles
    or [E, N, K/16] rows); amax [E] as in dequantize_rows."""
    _check_packed("dequantize_weight", packed, scales, 3)
    E, N, K = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    s_enc = _f32(global_scales, packed.device).reshape(-1)
    if s_enc.numel() != E:
        raise ValueError(f"dequantize_weight: global_scales must hold {E} values, got {s_enc.numel()}")
    a = None if amax is None else _f32(amax, packed.device).reshape(E, 1, 1)
    f = _decode_factor(scales, s_enc.view(E, 1, 1), a)
    q = E2M1_VALUES.to(packed.device)[unpack_e2m1(packed).long()]
    if N % BLOCK == 0 and tuple(scales.shape) == (E, N // BLOCK, K // BLOCK):
        tiles = q.view(E, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
        return (tiles * f[:, :, None, :, None]).view(E, N, K)
    if tuple(scales.shape) == (E, N, K // BLOCK):
        return (q.view(E, N, K // BLOCK, BLOCK) * f.unsqueeze(-1)).view(E, N, K)
    raise ValueError(f"dequantize_weight: scales {tuple(scales.shape)} match neither "
                     f"{(E, N // BLOCK, K // BLOCK)} (16 x 16 tiles) nor {(E, N, K // BLOCK)} (rows)")


def a16_fragment_index(K: int) -> torch.Tensor:
    """int64 [K]: the logical value at each position of a row in the wgmma NVFP4 GEMM's
    fragment order (csrc/nvfp4_wgmma_mm.cu), row_in_fragment_order = row[:, index]. Per
    128-wide chunk, position 16s + 8o + 2q + j holds value 32q + 4s + 2j + o (k16 step s,
    thread q of a quad, o and j in {0, 1}): the order in which each thread's 16-byte weight
    load of 32 consecutive values fills its MMA fragments."""
    if K % 128:
        raise ValueError(f"a16_fragment_index: K={K} must be a multiple of 128")
    p = torch.arange(128)
    s, o, q, j = p // 16, p % 16 // 8, p % 8 // 2, p % 2
    chunk = 32 * q + 4 * s + 2 * j + o
    return (torch.arange(0, K, 128)[:, None] + chunk[None, :]).reshape(K)


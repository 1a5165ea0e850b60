"""MXFP8 (OCP microscaling, TransformerEngine's MXFP8BlockScaling): formats and torch twins.

E4M3 values with one E8M0 scale (a biased power-of-two exponent, one byte) per 32 values along
the contraction axis. The scale rule is TransformerEngine's `float_to_e8m0(amax * max_norm_rcp)`
(its Hopper code path; Blackwell's `cvt.rp.satfinite.ue8m0x2.f32` gives the same bytes):

    v       = amax * fp32(1 / 448)           (fp32, round to nearest)
    e       = 255 for NaN, 254 for inf, 0 for v == 0; else the exponent bits of v, plus one
              when v is not already a power of two (round up, so no value saturates), except
              at 254 and for v <= 2^-127 (exponent bits 0, mantissa <= 0x400000)
    q       = e4m3(clamp(x * r, -448, 448)), round to nearest even, r = 2^(127 - e) for e > 0
              and r = 1 for e == 0 (TE's exp2f_rcp)
    x ~= q * 2^(e - 127)

Layouts, as quant/fp8_block.py's with 32-value blocks and uint8 scales (the same bytes per row:
layout.py counts both alike):
    rows      q [R, K], s [R, K/32]
    columns   q [K, Rp] (tokens contiguous, each expert's rows padded to a multiple of 128),
              s [Rp/32, K]
    weights   q [E, N, K] with one scale per 32 x 32 tile, s [E, N/32, K/32] (the design's
              grouped 32 x 32 weight quantization: FPROP and DGRAD share one quantization)

Hopper has no MXFP8 tensor-core instruction. An MXFP8 value q * 2^(e - 127) has at most four
significant bits, so it is a bf16 value (exactly, for every block scale 2^(e - 127) >= 2^-124,
i.e. e >= 3: only blocks whose amax is below ~2^-116 round to bf16's subnormal grid), and a
bf16 GEMM over the dequantized operands multiplies exactly what the MXFP8 operands hold, with
fp32 accumulation. The CUDA backend computes so: `fake_rows`, `fake_cols` and `fake_weight`
give those bf16 operands (the quantize-then-dequantize of one kernel pass; twins of
kernels/quant_mxfp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import padded_rows
from .fp8_block import _amax, _cast, padded_offsets

__all__ = ["BLOCK", "MAX_NORM_RCP", "e8m0_from_amax", "scale_reciprocal", "scale_values",
           "quantize_rows", "dequantize_rows", "quantize_cols", "dequantize_cols",
           "quantize_weight", "dequantize_weight", "fake_rows", "fake_cols", "fake_weight",
           "Mxfp8Format", "padded_rows"]

BLOCK = 32
MAX_NORM_RCP = torch.tensor(1.0 / 448.0, dtype=torch.float32)   # TE: float(1.0 / max_norm)


def e8m0_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 scale exponents of blocks with these amaxes (TE's float_to_e8m0)."""
    v = amax.to(torch.float32) * MAX_NORM_RCP.to(amax.device)
    bits = v.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + up.to(torch.int32)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 0xFE), e)
    e = torch.where(torch.isnan(v), torch.full_like(e, 0xFF), e)
    return e.to(torch.uint8)


def scale_reciprocal(e: torch.Tensor) -> torch.Tensor:
    """fp32 multiplier before the cast: 2^(127 - e), 1 for e == 0 (TE's exp2f_rcp)."""
    ei = e.to(torch.int32)
    r = ((254 - ei) << 23).view(torch.float32)
    return torch.where(ei == 0, torch.ones_like(r), r)


def scale_values(e: torch.Tensor) -> torch.Tensor:
    """fp32 dequantization scales 2^(e - 127)."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device),
                       e.to(torch.int32) - 127)


def quantize_rows(x_RK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x 32 blocks along the last axis: (q [R, K] e4m3, e [R, K/32] uint8)."""
    R, K = x_RK.shape
    assert K % BLOCK == 0, f"quantize_rows: K={K} must be a multiple of {BLOCK}"
    blocks = x_RK.view(R, K // BLOCK, BLOCK).to(torch.float32)
    e = e8m0_from_amax(_amax(blocks, -1))
    return _cast(blocks * scale_reciprocal(e).unsqueeze(-1)).view(R, K), e


def dequantize_rows(q_RK: torch.Tensor, e_RB: torch.Tensor) -> torch.Tensor:
    R, K = q_RK.shape
    return (q_RK.to(torch.float32).view(R, K // BLOCK, BLOCK)
            * scale_values(e_RB).unsqueeze(-1)).view(R, K)


def quantize_cols(x_RK: torch.Tensor, offsets: torch.Tensor, Rp: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """32 x 1 blocks along each expert's rows, segments padded with zeros to 128 rows:
    (q [K, Rp] e4m3, tokens contiguous; e [Rp/32, K] uint8)."""
    R, K = x_RK.shape
    assert Rp % 128 == 0
    poffs = padded_offsets(offsets)
    xp = torch.zeros(Rp, K, dtype=x_RK.dtype, device=x_RK.device)
    for i in range(offsets.numel() - 1):
        a, b, p = int(offsets[i]), int(offsets[i + 1]), int(poffs[i])
        xp[p:p + b - a] = x_RK[a:b]
    blocks = xp.view(Rp // BLOCK, BLOCK, K).to(torch.float32)
    e = e8m0_from_amax(_amax(blocks, 1))
    q = _cast(blocks * scale_reciprocal(e).unsqueeze(1)).view(Rp, K)
    return q.t().contiguous(), e


def dequantize_cols(q_KR: torch.Tensor, e_BK: torch.Tensor) -> torch.Tensor:
    """[Rp, K] fp32 (padded row space)."""
    K, Rp = q_KR.shape
    return (q_KR.t().to(torch.float32).view(Rp // BLOCK, BLOCK, K)
            * scale_values(e_BK).unsqueeze(1)).view(Rp, K)


def quantize_weight(w_ENK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """32 x 32 tiles: (q [E, N, K] e4m3, e [E, N/32, K/32] uint8)."""
    E, N, K = w_ENK.shape
    assert N % BLOCK == 0 and K % BLOCK == 0
    tiles = w_ENK.view(E, N // BLOCK, BLOCK, K // BLOCK, BLOCK).to(torch.float32)
    amax = _amax(tiles.transpose(2, 3).reshape(E, N // BLOCK, K // BLOCK, BLOCK * BLOCK), -1)
    e = e8m0_from_amax(amax)
    return _cast(tiles * scale_reciprocal(e)[:, :, None, :, None]).view(E, N, K), e


def dequantize_weight(q_ENK: torch.Tensor, e_ENB: torch.Tensor) -> torch.Tensor:
    E, N, K = q_ENK.shape
    tiles = q_ENK.to(torch.float32).view(E, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    return (tiles * scale_values(e_ENB)[:, :, None, :, None]).view(E, N, K)


def fake_rows(x_RK: torch.Tensor) -> torch.Tensor:
    """bf16 [R, K]: the MXFP8 row quantization of x, dequantized (exact in bf16, see above)."""
    return dequantize_rows(*quantize_rows(x_RK)).to(torch.bfloat16)


def fake_cols(x_RK: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """bf16 [R, K], token-major: the MXFP8 column quantization of x (32 x 1 blocks along each
    expert's rows, from the segment's first row; offsets int [E+1]), dequantized. The same
    values as the column bundle of `quantize_cols`, without its padding rows."""
    R, K = x_RK.shape
    out = torch.empty(R, K, dtype=torch.bfloat16, device=x_RK.device)
    for i in range(offsets.numel() - 1):
        a, b = int(offsets[i]), int(offsets[i + 1])
        if b > a:
            Rp = -(-(b - a) // 128) * 128
            seg = torch.tensor([0, b - a], device=x_RK.device)
            out[a:b] = dequantize_cols(*quantize_cols(x_RK[a:b], seg, Rp))[:b - a].to(out.dtype)
    return out


def fake_weight(w_ENK: torch.Tensor) -> torch.Tensor:
    """bf16 [E, N, K]: the 32 x 32 tile quantization of w, dequantized."""
    return dequantize_weight(*quantize_weight(w_ENK)).to(torch.bfloat16)


@dataclass(frozen=True)
class Mxfp8Format:
    """The format interface the reference math and the emulation use (as Fp8BlockFormat)."""

    name: str = "mxfp8"
    block: int = BLOCK
    scale_dtype: torch.dtype = torch.uint8

    def rows(self, x):
        return quantize_rows(x)

    def deq_rows(self, q, s):
        return dequantize_rows(q, s)

    def cols(self, x, offsets, Rp):
        return quantize_cols(x, offsets, Rp)

    def deq_cols(self, q, s):
        return dequantize_cols(q, s)

    def weight(self, w):
        return quantize_weight(w)

    def deq_weight(self, q, s):
        return dequantize_weight(q, s)

"""FP8 block scaling (DeepSeek-V3's recipe; TransformerEngine's `Float8BlockScaling`): formats
and their torch twins.

Every quantized operand is E4M3 data plus one fp32 scale inverse per block of 128 values along
the axis its GEMM contracts over (weights: per 128 x 128 tile). A value is stored as
q = e4m3(x * scale) and read back as q * scale_inv. The scale rules are TransformerEngine's
(`compute_scale_from_amax`, block-scaling quantizers), exactly:

    amax   = max |x| over the block (NaN ignored), clamped below by amax_epsilon
    scale  = 448 / amax in fp32 (round to nearest); 1 when amax is 0 or inf; the largest bf16
             value when the quotient overflows; with power-of-two scales (TE's default) the
             mantissa bits are cleared (scale rounded down to a power of two)
    q      = e4m3(clamp(x * scale, -448, 448)), round to nearest even
    scale_inv = 1 / scale (fp32, round to nearest; exact for powers of two)

The four layouts a routed-expert call uses (the bundles memory_plan and layout.py count):

    rows      q [R, K] and s [R, K/128]: 1 x 128 blocks along K, for FPROP / DGRAD operands
              (x_g and h2 along their features, the output gradients along D, grad_h1 along 2F)
    columns   q [K, Rp] (transposed: tokens contiguous) and s [Rp/128, K]: 128 x 1 blocks along
              the token axis, each expert's rows padded with zeros to a multiple of 128 so no
              block spans two experts (`padded_offsets`); the WGRAD operands (x_g, h2, the
              output gradients and grad_h1). Quantized from the high-precision values, not from
              the row bundle (TE's columnwise rule).
    weights   q [E, N, K] and s [E, N/128, K/128] over 128 x 128 tiles, and the same data and
              scales transposed, q_t [E, K, N] and s_t [E, K/128, N/128]: Hopper's FP8 tensor
              cores read both operands K-major, so FPROP reads q and DGRAD reads q_t (one
              quantization, two layouts: transposing a 128 x 128-tile quantization is exact).

Everything here is plain torch on any device: the reference backend's math, and the twins the
Triton kernels (kernels/quant_fp8.py) are held bit-equal to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import padded_rows   # the column-bundle row bound, shared with the byte layout

__all__ = ["BLOCK", "FP8_MAX", "FP8_DTYPE", "BlockScaling", "compute_scales", "quantize_rows",
           "dequantize_rows", "padded_rows", "padded_offsets", "quantize_cols",
           "dequantize_cols", "quantize_weight", "dequantize_weight", "Fp8Weights",
           "prepare_weights", "Fp8BlockFormat"]

BLOCK = 128
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
BF16_MAX = 3.3895313892515355e38      # TE's value_for_inf for bf16 inputs


@dataclass(frozen=True)
class BlockScaling:
    """The scaling settings of the recipe (TransformerEngine's QParams, the same for inputs,
    weights and gradients): power-of-two scales (TE's default) and the amax floor."""

    power_2_scales: bool = True
    amax_epsilon: float = 0.0

    @classmethod
    def of(cls, config) -> "BlockScaling":
        """The settings of a Config (fp8_power_2_scales, fp8_amax_epsilon)."""
        return cls(bool(config.fp8_power_2_scales), float(config.fp8_amax_epsilon))


def compute_scales(amax: torch.Tensor, recipe: BlockScaling = BlockScaling()
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) fp32 from block amaxes (fp32), TransformerEngine's rules."""
    amax = amax.to(torch.float32)
    if recipe.amax_epsilon > 0:
        amax = torch.clamp(amax, min=recipe.amax_epsilon)
    scale = torch.full_like(amax, FP8_MAX) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, BF16_MAX), scale)
    scale = torch.where((amax == 0) | torch.isinf(amax), torch.ones_like(scale), scale)
    if recipe.power_2_scales:
        scale = (scale.view(torch.int32) & -8388608).view(torch.float32)   # & 0xFF800000
    return scale, torch.ones_like(scale) / scale


def _cast(x_scaled: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x_scaled, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _amax(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    a = blocks.abs().to(torch.float32)
    return torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=dim)


def quantize_rows(x_RK: torch.Tensor, recipe: BlockScaling = BlockScaling()
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x 128 blocks along the last axis: (q [R, K] e4m3, s [R, K/128] fp32 scale inverses)."""
    R, K = x_RK.shape
    assert K % BLOCK == 0, f"quantize_rows: K={K} must be a multiple of {BLOCK}"
    blocks = x_RK.view(R, K // BLOCK, BLOCK)
    scale, s_inv = compute_scales(_amax(blocks, -1), recipe)
    q = _cast(blocks.to(torch.float32) * scale.unsqueeze(-1)).view(R, K)
    return q, s_inv


def dequantize_rows(q_RK: torch.Tensor, s_RB: torch.Tensor) -> torch.Tensor:
    R, K = q_RK.shape
    return (q_RK.to(torch.float32).view(R, K // BLOCK, BLOCK) * s_RB.unsqueeze(-1)).view(R, K)


def padded_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """Start of each expert's padded segment: [E+1] cumulative align128 lengths (int64)."""
    lens = offsets.to(torch.int64).diff()
    padded = (lens + BLOCK - 1) // BLOCK * BLOCK
    return torch.cat([padded.new_zeros(1), padded.cumsum(0)])


def quantize_cols(x_RK: torch.Tensor, offsets: torch.Tensor, Rp: int,
                  recipe: BlockScaling = BlockScaling()) -> tuple[torch.Tensor, torch.Tensor]:
    """128 x 1 blocks along the rows of each expert segment [offsets[e], offsets[e+1]), padded
    with zeros: (q [K, Rp] e4m3, tokens contiguous; s [Rp/128, K] fp32). Rows past the padded
    segments hold zeros (scale inverse 1)."""
    R, K = x_RK.shape
    assert Rp % BLOCK == 0, f"quantize_cols: Rp={Rp} must be a multiple of {BLOCK}"
    poffs = padded_offsets(offsets)
    assert int(poffs[-1]) <= Rp, f"quantize_cols: padded rows {int(poffs[-1])} > Rp={Rp}"
    xp = torch.zeros(Rp, K, dtype=x_RK.dtype, device=x_RK.device)
    for e in range(offsets.numel() - 1):
        a, b, p = int(offsets[e]), int(offsets[e + 1]), int(poffs[e])
        xp[p:p + b - a] = x_RK[a:b]
    blocks = xp.view(Rp // BLOCK, BLOCK, K)
    scale, s_inv = compute_scales(_amax(blocks, 1), recipe)
    q = _cast(blocks.to(torch.float32) * scale.unsqueeze(1)).view(Rp, K)
    return q.t().contiguous(), s_inv


def dequantize_cols(q_KR: torch.Tensor, s_BK: torch.Tensor) -> torch.Tensor:
    """[Rp, K] fp32 (padded row space)."""
    K, Rp = q_KR.shape
    return (q_KR.t().to(torch.float32).view(Rp // BLOCK, BLOCK, K) * s_BK.unsqueeze(1)).view(Rp, K)


def quantize_weight(w_ENK: torch.Tensor, recipe: BlockScaling = BlockScaling()
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """128 x 128 tiles: (q [E, N, K] e4m3, s [E, N/128, K/128] fp32)."""
    E, N, K = w_ENK.shape
    assert N % BLOCK == 0 and K % BLOCK == 0, (
        f"quantize_weight: [{N}, {K}] must be multiples of {BLOCK} in both dimensions")
    tiles = w_ENK.view(E, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    amax = _amax(tiles.transpose(2, 3).reshape(E, N // BLOCK, K // BLOCK, BLOCK * BLOCK), -1)
    scale, s_inv = compute_scales(amax, recipe)
    q = _cast(tiles.to(torch.float32) * scale[:, :, None, :, None]).view(E, N, K)
    return q, s_inv


def dequantize_weight(q_ENK: torch.Tensor, s_ENB: torch.Tensor) -> torch.Tensor:
    E, N, K = q_ENK.shape
    tiles = q_ENK.to(torch.float32).view(E, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    return (tiles * s_ENB[:, :, None, :, None]).view(E, N, K)


@dataclass
class Fp8Weights:
    """The expert weights of one version, quantized in 128 x 128 tiles, in both orientations.

    w13 [E, 2F, D] / w13_t [E, D, 2F] (FPROP / DGRAD of W13) with scales [E, 2F/128, D/128] /
    [E, D/128, 2F/128]; w2 [E, D, F] / w2_t [E, F, D] likewise."""

    w13: torch.Tensor
    w13_s: torch.Tensor
    w13_t: torch.Tensor
    w13_t_s: torch.Tensor
    w2: torch.Tensor
    w2_s: torch.Tensor
    w2_t: torch.Tensor
    w2_t_s: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())


def prepare_weights(w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor,
                    recipe: BlockScaling = BlockScaling()) -> Fp8Weights:
    """Both weights quantized once, in both orientations (torch)."""
    q13, s13 = quantize_weight(w13_E2FD, recipe)
    q2, s2 = quantize_weight(w2_EDF, recipe)
    return Fp8Weights(q13, s13, q13.transpose(1, 2).contiguous(), s13.transpose(1, 2).contiguous(),
                      q2, s2, q2.transpose(1, 2).contiguous(), s2.transpose(1, 2).contiguous())


@dataclass(frozen=True)
class Fp8BlockFormat:
    """The format interface the reference math and the emulation use: quantize / dequantize
    rows, columns and weights (quant/mxfp8.Mxfp8Format is the other one)."""

    recipe: BlockScaling = BlockScaling()
    name: str = "fp8_block"
    block: int = BLOCK
    scale_dtype: torch.dtype = torch.float32

    def rows(self, x):
        return quantize_rows(x, self.recipe)

    def deq_rows(self, q, s):
        return dequantize_rows(q, s)

    def cols(self, x, offsets, Rp):
        return quantize_cols(x, offsets, Rp, self.recipe)

    def deq_cols(self, q, s):
        return dequantize_cols(q, s)

    def weight(self, w):
        return quantize_weight(w, self.recipe)

    def deq_weight(self, q, s):
        return dequantize_weight(q, s)

"""quant/mxfp8.py: TransformerEngine's MXFP8 scale rule (float_to_e8m0 of amax / 448, rounded
up), E4M3 casts with saturation, the row / column / 32 x 32 weight layouts, adversarial blocks."""

from __future__ import annotations

import torch

from megatron_dist_moe.quant import mxfp8 as M

F32 = torch.float32


def test_scale_exponent_rounds_up_and_handles_specials():
    amax = torch.tensor([448.0, 448.0 * 1.0000001, 1.0, 0.0, float("inf"), float("nan"),
                         448.0 * 2.0 ** -127, 1e-45, 448.0 * 2.0 ** 100], dtype=F32)
    e = M.e8m0_from_amax(amax).tolist()
    assert e[0] == 127                        # 448 * fp32(1/448) rounds to 1.0: 2^0
    assert e[1] == 128                        # just above 448: the next power of two
    # 1 / 448 = 1.14 * 2^-9 -> rounded up to 2^-8 -> 119
    assert e[2] == 119
    assert e[3] == 0 and e[4] == 254 and e[5] == 255
    assert e[6] in (0, 1) and e[7] == 0       # at / below 2^-127: stays 0 (TE's subnormal rule)
    assert e[8] == 127 + 100
    # the dequantization scale times 448 covers the amax: no finite value saturates
    ok = torch.tensor([0, 1, 2, 8])
    assert bool((M.scale_values(M.e8m0_from_amax(amax))[ok] * 448 >= amax[ok]).all())
    # the cast multiplier: 2^(127 - e), 1 for e == 0 (TE's exp2f_rcp)
    r = M.scale_reciprocal(torch.tensor([0, 1, 127, 119], dtype=torch.uint8))
    assert r.tolist() == [1.0, 2.0 ** 126, 1.0, 2.0 ** 8]


def test_rows_on_adversarial_blocks():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 128, generator=g)
    x[0, :32] *= torch.logspace(-30, 30, 32)          # a wide exponent spread in one block
    x[1, :32] = 0.0                                    # a zero block
    x[1, 32:64] = 448.0                                # at the E4M3 maximum
    x[1, 64:96] = -448.0 * 1.5                         # beyond it before scaling
    x[2, :32] = torch.tensor(2.0 ** -130)              # far below 2^-127 * 448
    x[3, 5] = float("nan")
    x[4, :32] = torch.tensor(2.0 ** -9) * torch.arange(32)   # subnormal E4M3 steps
    x = x.to(torch.bfloat16)
    q, e = M.quantize_rows(x)
    assert q.shape == x.shape and e.shape == (6, 4) and e.dtype == torch.uint8
    d = M.dequantize_rows(q, e)
    xf = x.float()
    assert e[1, 0] == 0 and bool((d[1, :32] == 0).all())
    assert bool((d[1, 32:64] == 448.0).all())          # 448 is exact with e = 127
    # 672 = 1.5 * 448: scale 2, 336 = 1.3125 * 2^8 is a tie between E4M3 neighbours -> 320 (even)
    assert bool((d[1, 64:96] == -640.0).all())
    assert bool((d[2, :32] == 0).all())                # too small for the format: zeros
    assert torch.isnan(d[3, 5]) and not torch.isnan(d[3, 6:]).any()
    # round to nearest within 2^-4 relative wherever the block's scale keeps it normal
    r = M.scale_reciprocal(e).repeat_interleave(32, 1)     # what the cast multiplies by
    normal = (xf.abs() * r >= 2 ** -6) & ~torch.isnan(xf)
    assert bool(((d - xf).abs()[normal] <= 2 ** -4 * xf.abs()[normal]).all())
    # the largest element of a block never saturates (the scale rounds up)
    amax = xf.nan_to_num(0).abs().view(6, 4, 32).amax(-1)
    assert bool((q.float().nan_to_num(0).abs().view(6, 4, 32).amax(-1) <= 448).all())
    assert bool((M.scale_values(e) * 448 >= amax).all())


def test_columns_and_weights():
    g = torch.Generator().manual_seed(1)
    offs = torch.tensor([0, 40, 40, 170])
    x = torch.randn(170, 64, generator=g).to(torch.bfloat16)
    Rp = M.padded_rows(170, 3)
    q, e = M.quantize_cols(x, offs, Rp)
    assert q.shape == (64, Rp) and e.shape == (Rp // 32, 64)
    d = M.dequantize_cols(q, e)
    # expert 0 at rows 0..39 (blocks 0, 1), expert 2 from the padded offset 128
    rel = (d[:40] - x[:40].float()).abs() / x[:40].float().abs()
    assert float(rel[x[:40].float().abs() > 0.05].max()) <= 2 ** -4
    assert bool((d[40:128] == 0).all()) and bool((d[258:] == 0).all())
    blk = x[128 - 128 + 40:40 + 32].float().abs().amax(0)    # expert 2's first 32 rows
    assert torch.equal(e[4], M.e8m0_from_amax(blk))
    w = torch.randn(2, 64, 96, generator=g).to(torch.bfloat16)
    qw, ew = M.quantize_weight(w)
    assert ew.shape == (2, 2, 3)
    assert torch.equal(ew[1, 1, 2], M.e8m0_from_amax(w[1, 32:64, 64:96].float().abs().amax()))
    dw = M.dequantize_weight(qw, ew)
    # transposing the tiles is the transposed weight's quantization (FPROP and DGRAD share it)
    qt, et = M.quantize_weight(w.transpose(1, 2).contiguous())
    assert torch.equal(qt.view(torch.uint8), qw.transpose(1, 2).contiguous().view(torch.uint8))
    assert torch.equal(et, ew.transpose(1, 2))
    assert float(((dw - w.float()).abs() / w.float().abs().clamp(min=1e-2)).max()) < 0.07

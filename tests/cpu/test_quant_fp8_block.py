"""quant/fp8_block.py: TransformerEngine's Float8BlockScaling rules, the four layouts, bounds."""

from __future__ import annotations

import pytest
import torch

from megatron_dist_moe.quant import fp8_block as Q

F32 = torch.float32


def test_scale_rules_follow_transformer_engine():
    amax = torch.tensor([1.0, 3.0, 0.0, float("inf"), 1e-38, 448.0, 500.0], dtype=F32)
    scale, s_inv = Q.compute_scales(amax, Q.BlockScaling(power_2_scales=True))
    # 448 / 1 = 448 -> 256; 448 / 3 = 149.3 -> 128; 0 and inf -> 1; 448/1e-38 overflows ->
    # bf16 max -> 2^127; 448/448 = 1; 448/500 = 0.896 -> 0.5
    assert scale.tolist() == [256.0, 128.0, 1.0, 1.0, 2.0 ** 127, 1.0, 0.5]
    assert torch.equal(s_inv, 1 / scale)
    scale, s_inv = Q.compute_scales(amax, Q.BlockScaling(power_2_scales=False))
    want = torch.tensor([448.0, 448.0 / 3, 1.0, 1.0, Q.BF16_MAX, 1.0, 448.0 / 500], dtype=F32)
    assert torch.equal(scale, want)
    assert torch.equal(s_inv, torch.ones_like(want) / want)
    # amax_epsilon floors the amax first
    scale, _ = Q.compute_scales(torch.tensor([0.0, 1e-3]), Q.BlockScaling(False, 1e-2))
    assert torch.equal(scale, torch.full((2,), 448.0 / 1e-2, dtype=F32))


@pytest.mark.parametrize("pow2", [True, False])
def test_rows_round_trip_and_saturation(pow2):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 384, generator=g) * torch.logspace(-3, 3, 37).unsqueeze(1)).to(
        torch.bfloat16)
    x[3, :128] = 0
    x[5, 7] = float("nan")
    recipe = Q.BlockScaling(power_2_scales=pow2)
    q, s = Q.quantize_rows(x, recipe)
    assert q.dtype == Q.FP8_DTYPE and q.shape == x.shape and s.shape == (37, 3)
    assert torch.isnan(q[5, 7].float()) and not torch.isnan(q[5, 8:].float()).any()
    assert s[3, 0] == 1 and bool((q[3, :128].float() == 0).all())
    d = Q.dequantize_rows(q, s)
    xf = x.float()
    ok = ~torch.isnan(xf)
    # E4M3 keeps 3 mantissa bits: round-to-nearest error <= 2^-4 of |x| in the normal range,
    # and the block maximum lands at or below 448
    big = ok & (xf.abs() >= 2 ** -6 / s.repeat_interleave(128, 1))
    assert bool(((d - xf).abs()[big] <= 2 ** -4 * xf.abs()[big]).all())
    assert float(q.float()[ok].abs().max()) <= Q.FP8_MAX
    if not pow2:   # the exact scale maps each block's amax onto 448
        amax = xf.nan_to_num(0).abs().view(37, 3, 128).amax(-1)
        hit = (q.float().nan_to_num(0).abs().view(37, 3, 128).amax(-1) == Q.FP8_MAX) | (amax == 0)
        assert bool(hit.all())


def test_columns_pad_each_expert_and_transpose():
    g = torch.Generator().manual_seed(1)
    lens = [5, 0, 130, 1]
    offs = torch.tensor([0, 5, 5, 135, 136])
    x = torch.randn(136, 256, generator=g).to(torch.bfloat16)
    Rp = Q.padded_rows(136, 4)
    assert Rp % 128 == 0 and Rp >= sum(-(-n // 128) * 128 for n in lens)
    q, s = Q.quantize_cols(x, offs, Rp)
    assert q.shape == (256, Rp) and s.shape == (Rp // 128, 256)
    assert Q.padded_offsets(offs).tolist() == [0, 128, 128, 384, 512]
    d = Q.dequantize_cols(q, s)
    # segment e starts at its padded offset; padding rows and the tail are exact zeros
    for (a, b), p in zip(((0, 5), (5, 135), (135, 136)), (0, 128, 384)):
        rows, xf = d[p:p + b - a], x[a:b].float()
        normal = xf.abs() > xf.abs().amax(0) / 32     # far above E4M3's subnormals
        assert bool(((rows - xf).abs()[normal] <= 2 ** -4 * xf.abs()[normal]).all())
    live = torch.zeros(Rp, dtype=torch.bool)
    for (a, b), p in zip(((0, 5), (5, 135), (135, 136)), (0, 128, 384)):
        live[p:p + b - a] = True
    assert bool((d[~live] == 0).all())
    # a column block's scale comes from its own 128 rows only (not the row bundle's)
    blk = x[5:133].float().abs().amax(0)     # expert 2's first block
    scale, s_inv = Q.compute_scales(blk)
    assert torch.equal(s[1], s_inv)


def test_weights_both_orientations_are_one_quantization():
    g = torch.Generator().manual_seed(2)
    w13 = torch.randn(3, 256, 384, generator=g).to(torch.bfloat16)
    w2 = torch.randn(3, 384, 128, generator=g).to(torch.bfloat16)
    p = Q.prepare_weights(w13, w2)
    assert p.w13.shape == (3, 256, 384) and p.w13_s.shape == (3, 2, 3)
    assert torch.equal(p.w13_t.float(), p.w13.float().transpose(1, 2))
    assert torch.equal(p.w13_t_s, p.w13_s.transpose(1, 2))
    assert torch.equal(p.w2_t.float(), p.w2.float().transpose(1, 2))
    # one scale per 128 x 128 tile, from that tile's amax
    tile = w13[1, 128:256, 256:384].float().abs().amax()
    assert torch.equal(p.w13_s[1, 1, 2], Q.compute_scales(tile)[1])
    d = Q.dequantize_weight(p.w13, p.w13_s)
    assert float(((d - w13.float()).abs() / w13.float().abs().clamp(min=1e-2)).max()) < 0.07


def test_shapes_must_be_multiples_of_128():
    with pytest.raises(AssertionError, match="multiple of 128"):
        Q.quantize_rows(torch.zeros(4, 200))
    with pytest.raises(AssertionError, match="multiples of 128"):
        Q.quantize_weight(torch.zeros(1, 128, 64))

"""quant/nvfp4.py: TransformerEngine's NVFP4 rules (E2M1 round to nearest even with saturation,
the global encode scale and its special cases, E4M3 block scales), the nibble order, the 1 x 16
row and 16 x 16 weight layouts, bit-exact against a plain-Python rendering of TE's formulas."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from megatron_dist_moe.quant import nvfp4 as Q

F32 = torch.float32
FLT_MAX = 3.4028234663852886e38


# --- an independent plain-Python rendering of TE's kernels (quantize_transpose_nvfp4.cuh) ----

def f32(v: float) -> float:
    """Round a Python float (double) to fp32, round to nearest even (overflow -> inf)."""
    if math.isnan(v) or math.isinf(v):
        return v
    if abs(v) >= 2.0 ** 128 * (1 - 2.0 ** -25):
        return math.copysign(math.inf, v)
    return struct.unpack("<f", struct.pack("<f", v))[0]


# all finite non-negative E4M3 values by code: e == 0 subnormal m * 2^-9, else (1 + m/8) 2^(e-7);
# code 0x7F is NaN
E4M3 = [(m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        for e in range(16) for m in range(8)][:127]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_even(v: float, table: list[float]) -> int:
    """Index of the value of table nearest v (v >= 0, within range), ties to the even index."""
    best = min(range(len(table)), key=lambda i: (abs(table[i] - v), i % 2))
    return best


def e4m3_code(v: float) -> int:
    """cvt.rn.satfinite to E4M3 of a non-negative fp32 value."""
    return nearest_even(min(v, 448.0), E4M3)


def e2m1_code(v: float) -> int:
    """cvt.rn.satfinite to E2M1: sign kept, magnitude saturated at 6, NaN -> +6."""
    if math.isnan(v):
        return 7
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    return sign | nearest_even(min(abs(v), 6.0), E2M1)


def te_quantize(rows: list[list[float]], amax_of_block, amax: float | None = None
                ) -> tuple[list[list[int]], list[list[int]], float]:
    """(packed bytes, scale codes, S_enc) for fp32 rows, blocks of 16 along each row;
    amax_of_block(i, b) gives the amax the block holding row i, block b is scaled by; amax the
    tensor's (default: max |x|)."""
    if amax is None:
        amax = max(abs(v) for r in rows for v in r)
    s_enc = min(f32(2688.0 / amax), FLT_MAX) if amax > 0 else 1.0
    if s_enc == 0.0:
        s_enc = 1.0
    s_dec = f32(1.0 / s_enc)
    mult = f32(s_enc * f32(1.0 / 6.0))
    packed, scales = [], []
    for i, r in enumerate(rows):
        codes, srow = [], []
        for b in range(len(r) // 16):
            sc = e4m3_code(f32(amax_of_block(i, b) * mult))
            srow.append(sc)
            enc = min(f32(1.0 / f32(E4M3[sc] * s_dec)), FLT_MAX) if E4M3[sc] > 0 else FLT_MAX
            codes += [e2m1_code(f32(v * enc)) for v in r[16 * b:16 * b + 16]]
        packed.append([codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(len(codes) // 2)])
        scales.append(srow)
    return packed, scales, s_enc


def as_lists(x: torch.Tensor) -> list[list[float]]:
    return x.to(F32).tolist()


# --- E2M1 ---------------------------------------------------------------------------------

def test_e2m1_rounding_table_ties_signs_saturation():
    cases = {0.0: 0, 0.1: 0, 0.25: 0, 0.26: 1, 0.5: 1, 0.75: 2, 1.0: 2, 1.25: 2, 1.3: 3, 1.5: 3,
             1.75: 4, 2.0: 4, 2.5: 4, 2.6: 5, 3.0: 5, 3.5: 6, 4.0: 6, 5.0: 6, 5.01: 7, 6.0: 7,
             7.0: 7, 1e30: 7, float("inf"): 7}
    x = torch.tensor(list(cases), dtype=F32)
    assert Q.e2m1_codes(x).tolist() == list(cases.values())
    assert Q.e2m1_codes(-x).tolist() == [8 | c for c in cases.values()]     # -0 -> 8: sign kept
    assert Q.e2m1_codes(torch.tensor([float("nan"), -float("nan")])).tolist() == [7, 7]
    assert Q.e2m1_codes(x).dtype == torch.uint8
    # the table decodes each code to its value, and every value encodes to its own code
    assert Q.E2M1_VALUES.tolist() == E2M1 + [-v for v in E2M1]
    assert Q.e2m1_codes(Q.E2M1_VALUES).tolist() == list(range(16))
    # dense sweep against the nearest-even table search (bf16 input converts exactly)
    g = torch.Generator().manual_seed(0)
    v = (torch.rand(4000, generator=g) * 16 - 8).to(torch.bfloat16)
    assert Q.e2m1_codes(v).tolist() == [e2m1_code(t) for t in v.float().tolist()]


def test_pack_unpack_round_trip_and_nibble_order():
    # element 2j in the low nibble of byte j (TE's cvt operand order / cast_to_fp4x2)
    assert Q.pack_e2m1(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    assert Q.unpack_e2m1(torch.tensor([0x21, 0x0F], dtype=torch.uint8)).tolist() == [1, 2, 15, 0]
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    p = Q.pack_e2m1(codes)
    assert p.shape == (3, 5, 32) and p.dtype == torch.uint8
    assert torch.equal(Q.unpack_e2m1(p), codes)
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(Q.pack_e2m1(Q.unpack_e2m1(every)), every)
    with pytest.raises(ValueError, match="codes"):
        Q.pack_e2m1(torch.zeros(3, 5, dtype=torch.uint8))


# --- scales -------------------------------------------------------------------------------

def test_global_scale_special_cases():
    amax = torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 6.0, 3.0, 7.0, 2688.0, 1e38],
                        dtype=F32)
    s = Q.global_scale(amax).tolist()
    assert s[0] == 1.0 and s[1] == 1.0          # amax 0 and inf: 1
    assert s[2] == FLT_MAX                      # NaN: fminf keeps FLT_MAX
    assert s[3] == FLT_MAX                      # 2688 / 1e-45 overflows: clamped to FLT_MAX
    assert s[4] == 448.0 and s[5] == 896.0 and s[7] == 1.0
    assert s[6] == f32(2688.0 / f32(7.0))
    assert s[8] == f32(2688.0 / f32(1e38))
    assert Q.global_scale(torch.tensor(3.0)).dim() == 0 and Q.global_scale(3.0).dtype == F32
    d = Q.global_decode_scale(torch.tensor([1.0, 448.0, f32(2688.0 / f32(7.0))])).tolist()
    assert d == [1.0, f32(1.0 / 448.0), f32(1.0 / f32(2688.0 / f32(7.0)))]


def test_block_scale_of_the_tensor_amax_block_is_448():
    rnd = random.Random(2)
    for _ in range(300):
        amax = f32(10.0 ** rnd.uniform(-30, 30))
        s_enc = Q.global_scale(torch.tensor(amax))
        sc = Q.block_scales(torch.tensor([amax]), s_enc)
        assert sc.view(torch.uint8).item() == 0x7E and sc.float().item() == 448.0
        # and the plain-Python formula agrees
        assert E4M3[e4m3_code(f32(amax * f32(f32(2688.0 / amax) * f32(1 / 6))))] == 448.0
    # in a tensor: the amax element encodes to +-6 and decodes to the amax within an ulp or two
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=g)
    x[5, 20] = -9.5
    p, s, s_enc = Q.quantize_rows(x)
    assert float(s_enc) == f32(2688.0 / 9.5)
    assert s[5, 1].float().item() == 448.0
    assert Q.unpack_e2m1(p)[5, 20].item() == 15                            # -6
    assert abs(Q.dequantize_rows(p, s, s_enc)[5, 20].item() + 9.5) <= 9.5 * 2 ** -21
    # clamping: a caller's amax below the data's saturates the scale at 448 (never NaN)
    _, s2, _ = Q.quantize_rows(x, global_amax=1.0)
    assert s2.float().max().item() == 448.0 and not torch.isnan(s2.float()).any()


# --- rows ---------------------------------------------------------------------------------

def test_rows_match_plain_python_rendering_bit_for_bit():
    rnd = random.Random(4)
    rows = [[rnd.gauss(0, 1) * 10.0 ** rnd.uniform(-4, 2) for _ in range(64)] for _ in range(6)]
    rows[1][16:32] = [0.0] * 16                                 # a zero block
    rows[2][:16] = [v * 1e-5 for v in rows[2][:16]]             # subnormal E4M3 scales
    for dtype in (F32, torch.bfloat16):
        x = torch.tensor(rows, dtype=F32).to(dtype)
        xl = as_lists(x)
        want_p, want_s, want_enc = te_quantize(
            xl, lambda i, b: max(abs(v) for v in xl[i][16 * b:16 * b + 16]))
        p, s, s_enc = Q.quantize_rows(x)
        assert p.shape == (6, 32) and s.shape == (6, 4) and s.dtype == torch.float8_e4m3fn
        assert s_enc.dim() == 0 and s_enc.dtype == F32
        assert float(s_enc) == want_enc
        assert p.tolist() == want_p
        assert s.view(torch.uint8).tolist() == want_s


def test_hand_worked_block():
    # one block, amax 3: S_enc = 896, S_dec = fp32(1/896), the block's scale
    # e4m3(3 * fp32(896 * fp32(1/6))) = e4m3(448.00003) = 448, r = 1 / fp32(448/896) = 2:
    # x * 2 rounds to the E2M1 grid: 0.1 -> 0.2 -> 0; 0.375 -> 0.75 -> 1.0 (tie, even);
    # -0.625 -> -1.25 -> -1.0 (tie, even); 1.25 -> 2.5 -> 2 (tie); 1.75 -> 3.5 -> 4 (tie);
    # 2.5 -> 5 -> 4 (tie); 3 -> 6; -0.05 -> -0 (code 8); 2 -> 4
    vals = [0.1, 0.375, -0.625, 1.25, 1.75, 2.5, 3.0, -0.05, 0.0, 0.5, -1.0, 0.75, -3.0, 1.0, 0.25, 2.0]
    p, s, s_enc = Q.quantize_rows(torch.tensor([vals], dtype=F32))
    assert float(s_enc) == 896.0 and s.float().item() == 448.0
    codes = [0, 2, 10, 4, 6, 6, 7, 8, 0, 2, 12, 3, 15, 4, 1, 6]
    assert Q.unpack_e2m1(p)[0].tolist() == codes
    assert p[0].tolist() == [codes[2 * j] | codes[2 * j + 1] << 4 for j in range(8)]
    d = Q.dequantize_rows(p, s, s_enc)[0].tolist()
    assert d == [f32(E2M1[c & 7] * (-1 if c & 8 else 1) * f32(448.0 * f32(1 / 896))) for c in codes]


def test_fp32_operation_order_is_te_kernels():
    """Inputs where the kernels' order (block_amax * (S_enc * fp32(1/6)), 1 / (s * S_dec)) and
    the algebraically equal (block_amax / 6) * S_enc, S_enc / s give different bytes."""
    # the block scale: TE's order rounds to code 73, the other to 72
    a, b = 5.007953643798828, 0.047508493065834045
    s_enc = f32(2688.0 / a)
    assert e4m3_code(f32(b * f32(s_enc * f32(1 / 6)))) == 73
    assert e4m3_code(f32(f32(b / 6) * s_enc)) == 72
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = a, b
    _, s, _ = Q.quantize_rows(x)
    assert s.view(torch.uint8).tolist() == [[0x7E, 73]]
    # the encode multiplier: 1 / (fp32(0.5625) * S_dec) and S_enc / 0.5625 are one ulp apart,
    # and these four values land on E2M1 midpoints (0.75, 1.25, 2.5, 5) between the two
    a = 10.777570724487305
    vals = [0.013532105833292007, 0.0016915129963308573, 0.0028191886376589537,
            0.005638377275317907, 0.011276754550635815]
    s_enc = f32(2688.0 / a)
    r_te, r_alt = f32(1.0 / f32(0.5625 * f32(1.0 / s_enc))), f32(s_enc / 0.5625)
    assert [e2m1_code(f32(v * r_te)) for v in vals[1:]] == [2, 3, 5, 7]
    assert [e2m1_code(f32(v * r_alt)) for v in vals[1:]] == [1, 2, 4, 6]
    x = torch.zeros(1, 32)
    x[0, 0] = a
    x[0, 16:21] = torch.tensor(vals)
    p, s, _ = Q.quantize_rows(x)
    assert s.view(torch.uint8).tolist() == [[0x7E, 49]] and E4M3[49] == 0.5625
    assert Q.unpack_e2m1(p)[0, 16:21].tolist() == [7, 2, 3, 5, 7]


def test_zero_blocks_and_zero_tensor():
    x = torch.randn(4, 48)
    x[2, 16:32] = 0.0
    p, s, s_enc = Q.quantize_rows(x)
    assert s[2, 1].view(torch.uint8).item() == 0
    assert bool((Q.unpack_e2m1(p)[2, 16:32] == 0).all())
    d = Q.dequantize_rows(p, s, s_enc)
    assert bool((d[2, 16:32] == 0).all()) and not torch.isnan(d).any()
    z = torch.zeros(3, 32, dtype=torch.bfloat16)
    p, s, s_enc = Q.quantize_rows(z)
    assert float(s_enc) == 1.0 and bool((p == 0).all()) and bool((s.float() == 0).all())
    assert bool((Q.dequantize_rows(p, s, s_enc) == 0).all())
    assert bool((Q.dequantize_rows(p, s, s_enc, amax=0.0) == 0).all())


def test_nan_and_inf_inputs():
    x = torch.randn(2, 32)
    x[0, 3] = float("nan")
    p, s, s_enc = Q.quantize_rows(x)
    # NaN is left out of both amaxes (TE's amax kernels), and encodes to +6 (satfinite)
    assert float(s_enc) == f32(2688.0 / x.nan_to_num(0).abs().max().item())
    assert Q.unpack_e2m1(p)[0, 3].item() == 7 and not torch.isnan(s.float()).any()
    x = torch.randn(2, 32)
    x[1, 20] = -float("inf")
    p, s, s_enc = Q.quantize_rows(x)
    assert float(s_enc) == 1.0                                      # amax inf -> 1
    assert s[1, 1].float().item() == 448.0 and Q.unpack_e2m1(p)[1, 20].item() == 15


def test_round_trip_error_bounds():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 256, generator=g) * torch.logspace(-2, 2, 32)[:, None]
    x[0, :16] *= torch.logspace(-3, 3, 16)                         # a wide spread in one block
    x = x.to(torch.bfloat16)
    p, s, s_enc = Q.quantize_rows(x)
    d = Q.dequantize_rows(p, s, s_enc)
    xf = x.float()
    D = (s.float() * Q.global_decode_scale(s_enc)).repeat_interleave(16, 1)   # decode factor
    normal = s.float().repeat_interleave(16, 1) >= 2.0 ** -6                   # E4M3 normal scales
    a = (xf / D).abs()
    # E2M1 rounding: half a step of the grid at the scaled magnitude (0.25 / 0.5 / 1), plus
    # what saturation at 6 cuts off; the E4M3 rounding of the scale keeps that within 2^-4 amax
    half_step = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
    err = (d - xf).abs()
    sat = (xf.abs() - 6 * D).clamp(min=0)
    assert bool((err <= half_step * D * (1 + 2 ** -18) + sat)[normal].all())
    bamax = xf.abs().view(32, 16, 16).amax(-1)
    nb = normal.view(32, 16, 16)[..., 0]
    assert nb.float().mean() > 0.9
    assert bool((sat.view(32, 16, 16).amax(-1) <= 2 ** -4 * (1 + 2 ** -10) * bamax)[nb].all())
    # per block: the error is at most 1/6 (+ the scale's rounding) of the block amax, and the
    # block's largest element comes back within the E4M3 scale rounding (2^-4)
    berr = err.view(32, 16, 16).amax(-1)
    assert bool((berr <= bamax * (1 / 6) * (1 + 2 ** -3))[nb].all())
    imax = xf.abs().view(32, 16, 16).argmax(-1, keepdim=True)
    top = d.view(32, 16, 16).gather(-1, imax).squeeze(-1)
    topx = xf.view(32, 16, 16).gather(-1, imax).squeeze(-1)
    assert bool(((top - topx).abs() <= 2 ** -4 * (1 + 2 ** -10) * bamax)[nb].all())


def test_bf16_equals_fp32_of_its_values_and_global_amax_override():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    a = Q.quantize_rows(x)
    b = Q.quantize_rows(x.float())
    assert all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a[:2], b[:2]))
    assert torch.equal(a[2], b[2])
    amax = 4 * x.float().abs().max()                        # e.g. an all-reduced amax
    p, s, s_enc = Q.quantize_rows(x, global_amax=amax)
    assert torch.equal(s_enc, Q.global_scale(amax))
    xl = as_lists(x)
    want_p, want_s, want_enc = te_quantize(
        xl, lambda i, b: max(abs(v) for v in xl[i][16 * b:16 * b + 16]), amax=amax.item())
    assert float(s_enc) == want_enc and p.tolist() == want_p and s.view(torch.uint8).tolist() == want_s
    assert not torch.equal(s.view(torch.uint8), a[1].view(torch.uint8))


def test_dequantize_with_amax_is_te_dequantizer():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 32, generator=g)
    p, s, s_enc = Q.quantize_rows(x)
    amax = x.abs().max().item()
    d = Q.dequantize_rows(p, s, s_enc, amax=amax)
    codes = Q.unpack_e2m1(p).tolist()
    sc = s.float().tolist()
    for i in range(3):
        for j in range(32):
            c = codes[i][j]
            f = f32(f32(sc[i][j // 16] * amax) * f32(1 / 2688))
            assert d[i, j].item() == f32(E2M1[c & 7] * (-1 if c & 8 else 1) * f)
    assert torch.allclose(d, Q.dequantize_rows(p, s, s_enc), rtol=2 ** -21, atol=0)


# --- weights ------------------------------------------------------------------------------

def test_weight_16x16_tiles_match_plain_python():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(2, 32, 48, generator=g) * torch.tensor([1e-3, 50.0])[:, None, None]
    w[1, :16, 16:32] *= 1e-4
    w = w.to(torch.bfloat16)
    p, s, s_enc = Q.quantize_weight(w)
    assert p.shape == (2, 32, 24) and s.shape == (2, 2, 3) and s_enc.shape == (2,)
    for e in range(2):
        wl = as_lists(w[e])

        def tile_amax(i, b):
            t = i // 16
            return max(abs(v) for r in wl[16 * t:16 * t + 16] for v in r[16 * b:16 * b + 16])
        want_p, want_s, want_enc = te_quantize(wl, tile_amax)
        assert float(s_enc[e]) == want_enc                  # each expert's own global scale
        assert p[e].tolist() == want_p
        assert s[e].view(torch.uint8).repeat_interleave(16, 0).tolist() == want_s
    d = Q.dequantize_weight(p, s, s_enc)
    assert d.shape == (2, 32, 48)
    rel = (d - w.float()).abs().amax((1, 2)) / w.float().abs().amax((1, 2))
    assert bool((rel <= 1 / 6 * (1 + 2 ** -3)).all())
    # tile quantization is transpose-exact: the transpose's tiles are the same tiles
    pt, st, _ = Q.quantize_weight(w.transpose(1, 2).contiguous())
    assert torch.equal(st.view(torch.uint8), s.view(torch.uint8).transpose(1, 2))
    assert torch.equal(Q.unpack_e2m1(pt), Q.unpack_e2m1(p).transpose(1, 2))


def test_weight_rows_form_is_quantize_rows_per_expert():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(3, 8, 32, generator=g)
    p, s, s_enc = Q.quantize_weight(w, block_2d=False)
    assert s.shape == (3, 8, 2)
    for e in range(3):
        pe, se, ee = Q.quantize_rows(w[e])
        assert torch.equal(p[e], pe) and torch.equal(s[e].view(torch.uint8), se.view(torch.uint8))
        assert torch.equal(s_enc[e], ee)
    d = Q.dequantize_weight(p, s, s_enc)
    assert torch.equal(d[1], Q.dequantize_rows(p[1], s[1], s_enc[1]))
    p2, _, e2 = Q.quantize_weight(w, global_amax=torch.tensor([1.0, 2.0, 3.0]), block_2d=False)
    assert e2.tolist() == [2688.0, 1344.0, 896.0]


# --- bad inputs ---------------------------------------------------------------------------

def test_bad_inputs():
    with pytest.raises(ValueError, match="x_RK.*K=24.*multiple of 16"):
        Q.quantize_rows(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="x_RK"):
        Q.quantize_rows(torch.zeros(32))
    with pytest.raises(ValueError, match="x_RK"):
        Q.quantize_rows(torch.zeros(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="w_ENK"):
        Q.quantize_weight(torch.zeros(2, 24, 32))
    with pytest.raises(ValueError, match="w_ENK"):
        Q.quantize_weight(torch.zeros(2, 16, 40), block_2d=False)
    with pytest.raises(ValueError, match="w_ENK"):
        Q.quantize_weight(torch.zeros(16, 32))
    with pytest.raises(ValueError, match="global_amax"):
        Q.quantize_weight(torch.zeros(2, 16, 32), global_amax=torch.ones(3))
    p, s, e = Q.quantize_rows(torch.randn(2, 32))
    with pytest.raises(ValueError, match="scales"):
        Q.dequantize_rows(p, s[:, :1], e)
    with pytest.raises(ValueError, match="scales"):
        Q.dequantize_rows(p, s.float(), e)
    pw, sw, ew = Q.quantize_weight(torch.randn(2, 32, 32))
    with pytest.raises(ValueError, match="scales"):
        Q.dequantize_weight(pw, sw[:, :1], ew)
    with pytest.raises(ValueError, match="global_scales"):
        Q.dequantize_weight(pw, sw, ew[:1])


def test_byte_rows_are_each_row_quantized_as_its_own_tensor():
    """quantize_row_bytes: row i = quantize_rows(x[i:i+1]) (its own amax and S_enc), laid out
    packed | scales | S_dec in a 16-byte aligned row; dequantize_row_bytes inverts the layout."""
    from megatron_dist_moe.layout import nvfp4_row_bytes
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(9, 96, generator=g) * torch.logspace(-3, 3, 9)[:, None]).to(torch.bfloat16)
    x[3] = 0
    rows = Q.quantize_row_bytes(x)
    assert rows.shape == (9, nvfp4_row_bytes(96)) and rows.shape[1] % 16 == 0
    packed, scales, s_dec = Q.split_row_bytes(rows, 96)
    for i in range(9):
        p, s, s_enc = Q.quantize_rows(x[i:i + 1])
        assert torch.equal(packed[i:i + 1], p)
        assert torch.equal(scales[i:i + 1].view(torch.uint8), s.view(torch.uint8))
        assert torch.equal(s_dec[i], Q.global_decode_scale(s_enc))
        assert torch.equal(Q.dequantize_row_bytes(rows[i:i + 1], 96),
                           Q.dequantize_rows(p, s, s_enc))
    assert not rows[:, 96 // 2 + 96 // 16 + 4:].any(), "padding must be zeros"
    with pytest.raises(ValueError, match="K=90"):
        Q.quantize_row_bytes(torch.zeros(2, 90))
    with pytest.raises(ValueError, match="uint8"):
        Q.split_row_bytes(torch.zeros(2, 64), 96)

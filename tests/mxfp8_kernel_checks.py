"""Checks of the mxfp8 kernels (kernels/quant_mxfp8.py) against their torch twins
(quant/mxfp8.py), on any device: every output bit-equal, on adversarial blocks (exponents
spread over 40 binades inside one block, E4M3 subnormals, zero blocks, amaxes that are exact
powers of two and the saturation bound, NaN).

Run by tests/cpu/test_kernel_checks_interp.py (Triton's interpreter, small shapes) and
tests/gpu/test_kernel_checks_gpu.py (sm_90, the guide's shapes; tests/kernel_checks.py). Each check_* takes
(device, big).
"""

from __future__ import annotations

import torch

from megatron_dist_moe.activation import Activation
from megatron_dist_moe.layout import padded_rows
from megatron_dist_moe.quant import mxfp8 as MX
from kernel_checks import scattered_rows  # noqa: E402  (tests/ on sys.path)

U8 = torch.uint8
F8 = torch.float8_e4m3fn
BF = torch.bfloat16


def _bits_equal(name, got, want):
    """Bit-equal, except that any NaN equals any NaN (payloads are not part of the format)."""
    got, want = got.cpu(), want.cpu()
    if got.dtype == BF:
        nan_g, nan_w = torch.isnan(got), torch.isnan(want)
        if not torch.equal(nan_g, nan_w):
            raise AssertionError(f"{name}: NaN at {(nan_g != nan_w).sum().item()} other places")
        got, want = got.masked_fill(nan_g, 0), want.masked_fill(nan_w, 0)
    if got.dtype in (F8, BF):
        got, want = got.view(U8 if got.dtype == F8 else torch.int16), want.view(
            U8 if want.dtype == F8 else torch.int16)
    if not torch.equal(got, want):
        bad = (got != want).sum().item()
        raise AssertionError(f"{name}: {bad} of {got.numel()} values differ from the twin")


def adversarial(R, K, seed=0, device="cpu"):
    """bf16 [R, K] whose 32-blocks (along either axis) cover the scale rule's corner cases."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, K, generator=g)
    x = x * torch.exp2(torch.randint(-20, 21, (R, K), generator=g).float())   # wide spread
    x[: R // 8] *= 2.0 ** -30                              # blocks of tiny values
    x[R // 8: R // 4, : K // 4] = 0                        # zero blocks
    x[5, 64:96] = torch.tensor([448.0, -448.0] * 16)       # amax at the saturation bound
    x[6, 0:32] = 2.0 ** 5                                  # amax an exact power of two
    x[7, 32:64] = torch.linspace(-1, 1, 32) * 2.0 ** -3    # E4M3 subnormals after scaling
    x[8, 96:128] = 3 * 2.0 ** -12
    x[9, 5] = float("nan")
    x[10, 7] = float("inf")                                # a block with inf: E8M0 254, NaN
    x[11, 40] = -float("inf")
    x[12, 128:160] = float("nan")                          # an all-NaN row block: amax 0
    return x.to(BF).to(device)


def nan_column_block(x, offs):
    """x with one all-NaN 32-row column block (rows 32..63 of the longest expert): its amax
    ignores every value, so its exponent is 0 and its values stay NaN."""
    lens = (offs[1:] - offs[:-1]).tolist()
    e = max(range(len(lens)), key=lambda i: lens[i])
    assert lens[e] >= 64, "no expert has two 32-row blocks"
    s = int(offs[e])
    x = x.clone()
    x[s + 32:s + 64, x.shape[1] // 2 + 3] = float("nan")
    return x


def _segments(big, device):
    lens = [900, 0, 2048, 1, 1800, 77] if big else [40, 0, 200, 5, 33]   # 200: two 128-blocks
    offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)
    return lens, offs, sum(lens)


def check_quantize(device, big=False):
    from megatron_dist_moe.kernels.quant_mxfp8 import quantize
    lens, offs, R = _segments(big, device)
    E = len(lens)
    for K in ((7168, 384) if big else (256,)):
        x = nan_column_block(adversarial(R, K, seed=K, device=device), offs.cpu())
        Rp = padded_rows(R, E)
        rf = torch.full((R, K), float("nan"), dtype=BF, device=device)
        qc = torch.empty(K, Rp, dtype=F8, device=device)
        ec = torch.empty(Rp // 32, K, dtype=U8, device=device)
        cf = torch.full((R, K), float("nan"), dtype=BF, device=device)
        quantize(x, offs, R + 5, K, rows_fake=rf, cols=(qc, ec), cols_fake=cf)
        _bits_equal(f"fake rows K={K}", rf, MX.fake_rows(x))
        tq, te = MX.quantize_cols(x, offs.long().cpu(), Rp)
        used = int(MX.padded_offsets(offs.cpu())[-1])
        _bits_equal(f"cols K={K}", qc[:, :used], tq[:, :used])
        _bits_equal(f"col exponents K={K}", ec[:used // 32], te[:used // 32])
        _bits_equal(f"fake cols K={K}", cf, MX.fake_cols(x, offs.long().cpu()))
        # in place, as the pipeline calls it: rows alone, rows + column bundle (x_g),
        # rows + fake columns (g3, grad_h1)
        y = x.clone()
        quantize(y, offs, R, K, rows_fake=y)
        _bits_equal(f"fake rows in place K={K}", y, MX.fake_rows(x))
        y = x.clone()
        qc2 = torch.empty_like(qc)
        ec2 = torch.empty_like(ec)
        quantize(y, offs, R, K, rows_fake=y, cols=(qc2, ec2))
        _bits_equal(f"fake rows in place + cols K={K}", y, MX.fake_rows(x))
        _bits_equal(f"cols beside in-place rows K={K}", qc2[:, :used], tq[:, :used])
        y = x.clone()
        cf2 = torch.full_like(cf, float("nan"))
        quantize(y, offs, R, K, rows_fake=y, cols_fake=cf2)
        _bits_equal(f"fake rows in place + fake cols K={K}", y, MX.fake_rows(x))
        _bits_equal(f"fake cols beside in-place rows K={K}", cf2, MX.fake_cols(x, offs.long().cpu()))
        # the gather fused in: row i read through an address table into a shuffled source
        # (row 5's address 0: a row of zeros, as gather_rows copies), every output
        ptrs, xz, _src = scattered_rows(x, torch.Generator().manual_seed(K))
        rf3, cf3 = torch.full_like(rf, float("nan")), torch.full_like(cf, float("nan"))
        qc3, ec3 = torch.empty_like(qc), torch.empty_like(ec)
        quantize(None, offs, R + 5, K, rows_fake=rf3, cols=(qc3, ec3), cols_fake=cf3,
                 row_ptrs=ptrs)
        zq, ze = MX.quantize_cols(xz, offs.long().cpu(), Rp)
        _bits_equal(f"gathered fake rows K={K}", rf3, MX.fake_rows(xz))
        _bits_equal(f"gathered cols K={K}", qc3[:, :used], zq[:, :used])
        _bits_equal(f"gathered col exponents K={K}", ec3[:used // 32], ze[:used // 32])
        _bits_equal(f"gathered fake cols K={K}", cf3, MX.fake_cols(xz, offs.long().cpu()))


def check_quantize_tiles(device, big=False):
    """Every tile `quantize` accepts (QUANT_TILES, the candidates bench_quant times), bit-equal
    to the twin: all three outputs, and the in-place rows with the column bundle. The
    interpreter runs one per row count (its cost is per program; warps do not change what a
    program does)."""
    from megatron_dist_moe.kernels.quant_mxfp8 import QUANT_TILES, quantize
    lens, offs, R = _segments(big, device)
    E = len(lens)
    K = 1024 if big else 256
    x = nan_column_block(adversarial(R, K, seed=3, device=device), offs.cpu())
    Rp = padded_rows(R, E)
    used = int(MX.padded_offsets(offs.cpu())[-1])
    tq, te = MX.quantize_cols(x, offs.long().cpu(), Rp)
    want_rf, want_cf = MX.fake_rows(x), MX.fake_cols(x, offs.long().cpu())
    tiles = QUANT_TILES if big else ((64, 32, 2), (32, 64, 1), (32, 128, 4))
    for tile in tiles:
        rf = torch.full((R, K), float("nan"), dtype=BF, device=device)
        qc = torch.full((K, Rp), float("nan"), dtype=F8, device=device)
        ec = torch.full((Rp // 32, K), 0xFF, dtype=U8, device=device)
        cf = torch.full((R, K), float("nan"), dtype=BF, device=device)
        quantize(x, offs, R + 5, K, rows_fake=rf, cols=(qc, ec), cols_fake=cf, tile=tile)
        _bits_equal(f"tile {tile}: fake rows", rf, want_rf)
        _bits_equal(f"tile {tile}: cols", qc[:, :used], tq[:, :used])
        _bits_equal(f"tile {tile}: col exponents", ec[:used // 32], te[:used // 32])
        _bits_equal(f"tile {tile}: fake cols", cf, want_cf)
        y = x.clone()
        qc.view(U8).fill_(0xFF)
        ec.fill_(0xFF)
        quantize(y, offs, R, K, rows_fake=y, cols=(qc, ec), tile=tile)
        _bits_equal(f"tile {tile}: fake rows in place", y, want_rf)
        _bits_equal(f"tile {tile}: cols beside in-place rows", qc[:, :used], tq[:, :used])
        _bits_equal(f"tile {tile}: col exponents beside in-place rows", ec[:used // 32],
                    te[:used // 32])
        y = x.clone()
        cf.fill_(float("nan"))
        quantize(y, offs, R, K, rows_fake=y, cols_fake=cf, tile=tile)
        _bits_equal(f"tile {tile}: fake rows in place beside fake cols", y, want_rf)
        _bits_equal(f"tile {tile}: fake cols beside in-place rows", cf, want_cf)


def check_swiglu_quant(device, big=False):
    from megatron_dist_moe.kernels.quant_mxfp8 import swiglu_quant
    R, F = (6000, 3072) if big else (141, 256)
    for act in ("swiglu", "swiglu_clamped"):
        a = Activation(act, 1.702, 7.0 if act == "swiglu" else 1.5)
        h1 = adversarial(R, 2 * F, seed=len(act), device=device)
        h1 = torch.where(torch.isnan(h1), 0.0, h1.float().clamp(-30, 30)).to(BF)
        nr = torch.tensor([R - 3], dtype=torch.int32, device=device)
        h1q = (torch.zeros(R, 2 * F, dtype=F8, device=device),
               torch.zeros(R, 2 * F // 32, dtype=U8, device=device))
        h2 = torch.zeros(R, F, dtype=BF, device=device)
        swiglu_quant(h1, nr, R, F, h2_fake=h2, h1q=h1q, activation=act, swiglu_alpha=a.alpha,
                     swiglu_limit=a.limit)
        n = R - 3
        wq, we = MX.quantize_rows(h1[:n])
        _bits_equal(f"{act} h1q", h1q[0][:n], wq)
        _bits_equal(f"{act} h1q exponents", h1q[1][:n], we)
        assert not h1q[0][n:].view(U8).any(), "rows past num_rows written"
        assert not h2[n:].view(torch.int16).any(), "rows past num_rows written"
        # the kernel's activation may differ from torch's in the last fp32 bit (exp), which can
        # flip a bf16 rounding of h2 and so one E4M3 step: require such flips to be rare and
        # every value within one step of its block
        want = MX.fake_rows(a.forward(h1[:n].float()).to(BF))
        _, e2 = MX.quantize_rows(a.forward(h1[:n].float()).to(BF))
        step = MX.scale_values(e2).repeat_interleave(32, 1) * 32
        assert bool(((h2[:n].float() - want.float()).abs() <= step).all()), f"{act}: h2 off"
        flips = (h2[:n].view(torch.int16) != want.view(torch.int16)).float().mean().item()
        assert flips < 1e-3, f"{act}: {flips:.2e} of h2's fake rows differ from the twin"


def check_dequantize(device, big=False):
    from megatron_dist_moe.kernels.quant_mxfp8 import dequantize_cols, dequantize_rows
    lens, offs, R = _segments(big, device)
    E = len(lens)
    K = 7168 if big else 384
    x = adversarial(R, K, seed=7, device=device)
    q, e = MX.quantize_rows(x)
    out = torch.full((R, K), float("nan"), dtype=BF, device=device)
    dequantize_rows(q, e, torch.tensor([R], dtype=torch.int32, device=device), R + 9, K, out=out)
    _bits_equal("dequantize_rows", out, MX.dequantize_rows(q, e).to(BF))
    Rp = padded_rows(R, E)
    qc, ec = MX.quantize_cols(x, offs.long().cpu(), Rp)
    qc, ec = qc.to(device), ec.to(device)
    out = torch.full((R, K), float("nan"), dtype=BF, device=device)
    dequantize_cols(qc, ec, offs, R + 9, K, out=out)
    _bits_equal("dequantize_cols", out, MX.fake_cols(x, offs.long().cpu()))


def check_fake_weight(device, big=False):
    from megatron_dist_moe.kernels.quant_mxfp8 import fake_weight
    E, N, K = (6, 6144, 7168) if big else (2, 96, 256)
    w = torch.stack([adversarial(N, K, seed=11 + i) for i in range(E)]).to(device)
    _bits_equal("fake weight", fake_weight(w), MX.fake_weight(w))


CHECKS = {f.__name__[len("check_"):]: f for f in
          (check_quantize, check_quantize_tiles, check_swiglu_quant, check_dequantize,
           check_fake_weight)}

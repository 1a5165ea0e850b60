"""Checks of the fp8_block kernels against their torch twins, on any device.

Run by tests/cpu/test_kernel_checks_interp.py (Triton's interpreter, small shapes) and
tests/gpu/test_kernel_checks_gpu.py (sm_90, real shapes; tests/kernel_checks.py). Quantizers
must match quant/fp8_block.py bit for bit; the GEMMs must match the same math on the
dequantized operands in fp32 up to the summation order (|err| <= 1e-5 x max|ref| before the
bf16 rounding of a stored output, one bf16 unit, 2^-7, after it: the interpreter's bf16 stores
truncate).

Each check_* takes (device, big): big selects the GPU's real shapes. On the GPU, fp32 outputs
get ACC_TOL: Hopper's FP8 tensor cores add the products of one 128-wide K block with about 14
significant bits (the reason for promoting to fp32 every 128 of K), so a block's partial sum
differs from an fp32 sum by ~1e-4 of the largest values.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from megatron_dist_moe.activation import Activation
from megatron_dist_moe.kernels.quant_fp8 import _hw, round_bf16, to_e4m3
from megatron_dist_moe.layout import padded_rows
from megatron_dist_moe.quant import fp8_block as Q
from kernel_checks import close as _close  # noqa: E402  (tests/ on sys.path)
from kernel_checks import scattered_rows  # noqa: E402

U8 = torch.uint8
F8 = torch.float8_e4m3fn


def _acc_tol(device) -> float:
    return 1e-3 if torch.device(device).type == "cuda" else 1e-5


def _bits_equal(name, got, want):
    if got.dtype == F8:
        got, want = got.view(U8), want.view(U8)
    if not torch.equal(got.cpu(), want.cpu()):
        bad = (got.cpu() != want.cpu()).sum().item()
        raise AssertionError(f"{name}: {bad} of {got.numel()} values differ from the twin")




def _segments(big, device):
    lens = [900, 0, 2048, 1, 1800, 77] if big else [40, 0, 70, 5]
    offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)
    return lens, offs, sum(lens)


@triton.jit
def _convert_kernel(x_ptr, q_ptr, b_ptr, n, HW: tl.constexpr):
    i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    m = i < n
    x = tl.load(x_ptr + i, mask=m)
    tl.store(q_ptr + i, to_e4m3(x, HW), mask=m)
    tl.store(b_ptr + i, round_bf16(x, HW), mask=m)


def check_e4m3_and_bf16_rounding(device, big=False):
    """The kernels' conversions (hardware on the GPU, the integer twins in the interpreter)
    round to nearest even exactly as torch does, ties and subnormals included."""
    g = torch.Generator().manual_seed(0)
    grid = torch.linspace(-448, 448, 200001)
    ties = torch.tensor([108.0, -108.0, 104.0 + 4, 0.0, -0.0, 2 ** -10, 3 * 2 ** -10,
                         5 * 2 ** -10, 2 ** -6 * 0.999, float("nan"), 1.0 + 2 ** -8,
                         1.0 + 3 * 2 ** -8])
    x = torch.cat([grid, torch.randn(100000, generator=g) * 10, ties]).to(device)
    q = torch.empty(x.numel(), dtype=F8, device=device)
    b = torch.empty_like(x)
    _convert_kernel[(triton.cdiv(x.numel(), 1024),)](x, q, b, x.numel(), HW=_hw(x))
    _bits_equal("e4m3", q, x.clamp(-448, 448).to(F8))
    want = x.to(torch.bfloat16).float()
    assert torch.equal(torch.isnan(b), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(b[ok], want[ok]), "bf16 rounding differs from torch"


def check_quantize_rows_cols(device, big=False):
    """Both bundles, read from rows in place and through an address table, with the launcher's
    tile and with every tile of QUANT_TILES (the GPU; in the interpreter, which ignores the warp
    count, the unrolled and the looped chunk walks), and each bundle alone; every run on
    poisoned outputs. On a GPU where its library loads, the CUDA C++ kernel
    (Execution.fp8_quant "cuda") runs the same cases ("cuda" in place of a tile)."""
    from megatron_dist_moe.kernels import quant_fp8_cuda
    from megatron_dist_moe.kernels.quant_fp8 import QUANT_TILES, quantize_rows_cols
    lens, offs, R = _segments(big, device)
    E = len(lens)
    tiles = (None,) + (QUANT_TILES if big else ((64, 4), (32, 2)))
    cuda = torch.device(device).type == "cuda" and quant_fp8_cuda.loads(torch.device(device))
    if cuda:
        tiles += ("cuda",)
    for K in ((7168, 384) if big else (256,)):
        for pow2 in (True, False):
            rc = Q.BlockScaling(pow2)
            g = torch.Generator().manual_seed(K + pow2)
            x = (torch.randn(R, K, generator=g) * torch.logspace(-3, 3, R)[:, None]).to(
                torch.bfloat16).to(device)
            x[7, 3] = float("nan")
            x[9, :128] = 0
            x[11, 128:256] = float("nan")      # an all-NaN row block: amax 0
            # a column of NaN over the longest expert's first 128-row block (all of its real
            # rows; the padding rows of a short expert are zeros)
            e = max(range(E), key=lambda i: lens[i])
            x[int(offs[e]):int(offs[e]) + min(lens[e], 128), 6] = float("nan")
            Rp = padded_rows(R, E)
            q = torch.empty(R, K, dtype=F8, device=device)
            s = torch.empty(R, K // 128, device=device)
            qc = torch.empty(K, Rp, dtype=F8, device=device)
            sc = torch.empty(Rp // 128, K, device=device)
            rq, rs = Q.quantize_rows(x, rc)
            cq, cs = Q.quantize_cols(x, offs.long(), Rp, rc)
            # the gather fused in: row i read from an address table into a shuffled source
            # (its peer's token rows), row 5's address 0: a row of zeros, as gather_rows copies
            ptrs, xz, _src = scattered_rows(x, g)
            ptrs = torch.cat([ptrs, ptrs.new_zeros(5)])   # a table of max_rows = R + 5 entries
            zq, zs = Q.quantize_rows(xz, rc)
            zcq, zcs = Q.quantize_cols(xz, offs.long(), Rp, rc)
            used = int(Q.padded_offsets(offs)[-1])
            # both bundles, in place and gathered; each bundle alone (in place) at the
            # launcher's tile and a looped one
            runs = [(t, src, want, out) for t in tiles
                    for src, want, out in ((x, (rq, rs, cq, cs), "rc"),
                                           (None, (zq, zs, zcq, zcs), "rc"))]
            runs += [(t, x, (rq, rs, cq, cs), out)
                     for t in (None, (32, 2)) + (("cuda",) if cuda else ()) for out in "rc"]
            for tile, src, want, out in runs:
                for t in (q, s, qc, sc):
                    t.view(U8).fill_(0xFF)
                kw = dict(rows=(q, s) if "r" in out else None,
                          cols=(qc, sc) if "c" in out else None, recipe=rc,
                          row_ptrs=None if src is not None else ptrs)
                if tile == "cuda":
                    quant_fp8_cuda.quantize_rows_cols(src, offs, R + 5, K, **kw)
                else:
                    quantize_rows_cols(src, offs, R + 5, K, tile=tile, **kw)
                what = (f"{'gathered ' if src is None else ''}K={K} pow2={pow2} tile={tile} "
                        f"outputs={out}")
                if "r" in out:
                    _bits_equal(f"rows {what}", q, want[0])
                    _bits_equal(f"row scales {what}", s, want[1])
                if "c" in out:
                    _bits_equal(f"cols {what}", qc[:, :used], want[2][:, :used])
                    _bits_equal(f"col scales {what}", sc[:used // 128], want[3][:used // 128])
    if big:
        _check_quantize_edges(device, cuda)


def _check_quantize_edges(device, cuda: bool):
    """quantize_rows_cols at the edges of its rules, the Triton kernel and (cuda) the CUDA one:
    40 experts (the CUDA kernel's segment search walks them 32 at a time; some empty), an amax
    floor, +-inf values (scale 1, saturation), a block of tiny values (scale = bf16's max, an
    fp32 subnormal inverse: neither kernel may flush subnormals)."""
    from megatron_dist_moe.kernels import quant_fp8_cuda
    from megatron_dist_moe.kernels.quant_fp8 import quantize_rows_cols
    g = torch.Generator().manual_seed(99)
    lens = torch.randint(0, 300, (40,), generator=g)
    lens[[3, 17, 33, 39]] = 0
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    R, E, K = int(offs[-1]), 40, 256
    x = (torch.randn(R, K, generator=g) * 1e-2).to(torch.bfloat16)
    x[5, 7], x[6, 130] = float("inf"), float("-inf")
    t0 = int(offs[20])
    x[t0:t0 + min(int(lens[20]), 128), 128:] = 1e-37   # fp32-normal; 448 / amax overflows
    x = x.to(device)
    offs = offs.to(device)
    Rp = padded_rows(R, E)
    used = int(Q.padded_offsets(offs.cpu())[-1])
    for rc in (Q.BlockScaling(False, 1e-4), Q.BlockScaling(True, 0.0)):
        rq, rs = Q.quantize_rows(x, rc)
        cq, cs = Q.quantize_cols(x, offs.long(), Rp, rc)
        for engine in ("triton",) + (("cuda",) if cuda else ()):
            q = torch.full((R, K), 0xFF, dtype=U8, device=device).view(F8)
            s = torch.full((R, K // 128), float("nan"), device=device)
            qc = torch.full((K, Rp), 0xFF, dtype=U8, device=device).view(F8)
            sc = torch.full((Rp // 128, K), float("nan"), device=device)
            fn = quant_fp8_cuda.quantize_rows_cols if engine == "cuda" else quantize_rows_cols
            fn(x, offs, R, K, rows=(q, s), cols=(qc, sc), recipe=rc)
            what = f"edges {engine} {rc}"
            _bits_equal(f"rows {what}", q, rq)
            _bits_equal(f"row scales {what}", s, rs)
            _bits_equal(f"cols {what}", qc[:, :used], cq[:, :used])
            _bits_equal(f"col scales {what}", sc[:used // 128], cs[:used // 128])


def check_swiglu_quant(device, big=False):
    from megatron_dist_moe.kernels.quant_fp8 import swiglu_quant
    R, F = (6000, 3072) if big else (141, 256)
    for act in ("swiglu", "swiglu_clamped"):
        a = Activation(act, 1.702, 7.0 if act == "swiglu" else 1.5)
        g = torch.Generator().manual_seed(len(act))
        h1 = (torch.randn(R, 2 * F, generator=g) * 2).to(torch.bfloat16).to(device)
        nr = torch.tensor([R - 3], dtype=torch.int32, device=device)
        h1q = (torch.zeros(R, 2 * F, dtype=F8, device=device),
               torch.zeros(R, 2 * F // 128, device=device))
        h2q = (torch.zeros(R, F, dtype=F8, device=device), torch.zeros(R, F // 128, device=device))
        swiglu_quant(h1, nr, R, F, h2q=h2q, h1q=h1q, activation=act, swiglu_alpha=a.alpha,
                     swiglu_limit=a.limit)
        n = R - 3
        wq, ws = Q.quantize_rows(h1[:n])
        _bits_equal(f"{act} h1q", h1q[0][:n], wq)
        _bits_equal(f"{act} h1q scales", h1q[1][:n], ws)
        assert not h1q[0][n:].view(U8).any(), "rows past num_rows written"
        # h2 = round(act(h1)): the kernels' activation may differ from torch's in the last fp32
        # bit (exp implementations), which can flip a bf16 rounding: compare the dequantized
        # values within one e4m3 quantum of the block, and require the flips to be rare
        h2 = a.forward(h1[:n].float()).to(torch.bfloat16)
        tq, ts = Q.quantize_rows(h2)
        got = Q.dequantize_rows(h2q[0][:n], h2q[1][:n])
        want = Q.dequantize_rows(tq, ts)
        quantum = ts.repeat_interleave(128, 1) * 32      # the block's step at its top binade
        assert bool(((got - want).abs() <= quantum).all()), f"{act}: h2q off by more than a step"
        flips = (h2q[0][:n].view(U8) != tq.view(U8)).float().mean().item()
        assert flips < 1e-3, f"{act}: {flips:.2e} of the h2 row bundle differs from the twin"


def check_quantize_weight(device, big=False):
    from megatron_dist_moe.kernels.quant_fp8 import quantize_weight
    E, N, K = (6, 6144, 7168) if big else (2, 256, 384)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(E, N, K, generator=g) / 50).to(torch.bfloat16).to(device)
    for pow2 in (True, False):
        rc = Q.BlockScaling(pow2)
        q, s, qt, st = quantize_weight(w, rc)
        tq, ts = Q.quantize_weight(w, rc)
        _bits_equal("w", q, tq)
        _bits_equal("w scales", s, ts)
        _bits_equal("w_t", qt, tq.transpose(1, 2).contiguous())
        _bits_equal("w_t scales", st, ts.transpose(1, 2).contiguous())
    q2, s2, none_q, none_s = quantize_weight(w, transposed=False)
    assert none_q is None and none_s is None
    _bits_equal("w (no transpose)", q2, Q.quantize_weight(w)[0])


def _gemm_problem(device, big):
    lens, offs, R = _segments(big, device)
    E = len(lens)
    D, F = (7168, 3072) if big else (256, 128)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(R, D, generator=g).to(torch.bfloat16).to(device)
    w13 = (torch.randn(E, 2 * F, D, generator=g) / D ** 0.5).to(torch.bfloat16).to(device)
    w2 = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(torch.bfloat16).to(device)
    return lens, offs, R, E, D, F, x, w13, w2, Q.prepare_weights(w13, w2)


def _per_expert(offs, fn):
    o = offs.tolist()
    return torch.cat([fn(e, o[e], o[e + 1]) for e in range(len(o) - 1)])


def check_fp8_mm_store_and_scatter(device, big=False):
    from megatron_dist_moe.kernels.grouped_gemm.fp8 import fp8_grouped_mm
    lens, offs, R, E, D, F, x, w13, w2, W = _gemm_problem(device, big)
    xq = Q.quantize_rows(x)
    h1 = torch.full((R, 2 * F), float("nan"), dtype=torch.bfloat16, device=device)
    fp8_grouped_mm(a=xq, w=W.w13, w_scales=W.w13_s, expert_offsets=offs, max_rows=R + 7,
                   epilogue="store", out=h1)
    xd, w13d = Q.dequantize_rows(*xq), Q.dequantize_weight(W.w13, W.w13_s)
    ref = _per_expert(offs, lambda e, a, b: xd[a:b] @ w13d[e].T)
    _close("W13 store", h1.float(), ref, 4e-3)
    h2q = Q.quantize_rows(Activation().forward(h1.float()).to(torch.bfloat16))
    dst = torch.full((R + 3, D), float("nan"), dtype=torch.bfloat16, device=device)
    perm = torch.randperm(R + 3, generator=torch.Generator().manual_seed(1))[:R].to(device)
    ptrs = dst.data_ptr() + perm.long() * D * 2
    ptrs[3] = 0                                             # a row with no destination
    fp8_grouped_mm(a=h2q, w=W.w2, w_scales=W.w2_s, expert_offsets=offs, max_rows=R,
                   epilogue="scatter", out_row_ptrs=ptrs)
    w2d = Q.dequantize_weight(W.w2, W.w2_s)
    h2d = Q.dequantize_rows(*h2q)
    ref = _per_expert(offs, lambda e, a, b: h2d[a:b] @ w2d[e].T)
    keep = torch.arange(R, device=device) != 3
    _close("W2 scatter", dst[perm][keep].float(), ref[keep], 4e-3)
    assert torch.isnan(dst[perm[3]].float()).all(), "row with address 0 was written"


def check_fp8_fprop_cutlass(device, big=False):
    """The W13 FPROP on CUTLASS's FP8 blockwise-scaled unit (GPU only: csrc/): the Triton
    check's bound against the twin, every configuration, rows past offsets[E] untouched."""
    from megatron_dist_moe.kernels import grouped_gemm_sm90 as sm90
    lens, offs, R, E, D, F, x, w13, w2, W = _gemm_problem(device, big)
    xq = Q.quantize_rows(x)
    xd, w13d = Q.dequantize_rows(*xq), Q.dequantize_weight(W.w13, W.w13_s)
    ref = _per_expert(offs, lambda e, a, b: xd[a:b] @ w13d[e].T)
    for config in sm90.FP8_FPROP_CONFIGS:
        h1 = torch.full((R + 7, 2 * F), float("nan"), dtype=torch.bfloat16, device=device)
        sm90.GroupedFp8FpropSm90(E, device, config)(xq, W.w13, W.w13_s, offs, h1)
        _close(f"W13 store (CUTLASS {config})", h1[:R].float(), ref, 4e-3)
        assert torch.isnan(h1[R:].float()).all(), f"{config}: rows past offsets[E] written"
    # the W2 DGRAD split: the CUTLASS unit stores u = g3 W2, the Triton pass does the rest
    gemm = sm90.GroupedFp8FpropSm90(E, device, sm90.FP8_FPROP_CONFIGS[0])
    _w2_dgrad_split(device, big, lambda g3q, W, offs, u: gemm(g3q, W.w2_t, W.w2_t_s, offs, u))


def check_fp8_mm_swiglu_bwd(device, big=False):
    from megatron_dist_moe.kernels.grouped_gemm.fp8 import fp8_config, fp8_grouped_mm
    lens, offs, R, E, D, F, x, w13, w2, W = _gemm_problem(device, big)
    g = torch.Generator().manual_seed(9)
    h1 = torch.randn(R, 2 * F, generator=g).to(torch.bfloat16).to(device)
    g3 = torch.randn(R, D, generator=g).to(torch.bfloat16).to(device)
    h1q, g3q = Q.quantize_rows(h1), Q.quantize_rows(g3)
    act = Activation()
    h1d = Q.dequantize_rows(*h1q)
    w2d = Q.dequantize_weight(W.w2, W.w2_s)
    u = _per_expert(offs, lambda e, a, b: Q.dequantize_rows(*g3q)[a:b] @ w2d[e])
    h2f = act.forward(h1d)
    parts = -(-F // fp8_config(torch.device(device)).block_n)
    for scored in (False, True):
        gh1 = torch.full((R, 2 * F), float("nan"), dtype=torch.bfloat16, device=device)
        h2 = torch.full((R, F), float("nan"), dtype=torch.bfloat16, device=device)
        kw = {}
        s = torch.ones(R, device=device)
        if scored:
            s = torch.rand(R, generator=g).to(device)
            buf = torch.zeros(R, 1 + parts, device=device)
            buf[:, 0] = s
            kw = dict(score_ptrs=buf.data_ptr() + torch.arange(R, device=device) * (1 + parts) * 4,
                      score_grad_delta=4, part_stride=4)
        fp8_grouped_mm(a=g3q, w=W.w2_t, w_scales=W.w2_t_s, expert_offsets=offs, max_rows=R,
                       epilogue="swiglu_bwd", out=gh1, h1q=h1q, h2=h2, **kw)
        want_gh1 = act.backward(h1d, (s[:, None] * u).to(torch.bfloat16).float())
        _close(f"grad_h1 scored={scored}", gh1.float(), want_gh1, 2e-2)
        _close(f"h2 scored={scored}", h2.float(), s[:, None] * h2f, 4e-3)
        if scored:
            want = (u * h2f.to(torch.bfloat16).float()).sum(-1)
            _close("score-gradient parts", buf[:, 1:].sum(1), want, max(1e-4, _acc_tol(device)))


def _w2_dgrad_split(device, big, u_gemm):
    """The W2 DGRAD as a GEMM that stores u = g3 W2 (u_gemm(g3q, W, offs, u)) and the
    SwiGLU-backward pass over it (quant_fp8.swiglu_bwd_rows), against the pass's twin on the
    same u and against the fused epilogue (fp8_grouped_mm "swiglu_bwd"), scored and not."""
    from megatron_dist_moe.kernels.grouped_gemm.fp8 import fp8_config, fp8_grouped_mm
    from megatron_dist_moe.kernels.quant_fp8 import swiglu_bwd_rows
    from megatron_dist_moe.kernels.rows_ref import swiglu_bwd_rows_ref
    lens, offs, R, E, D, F, x, w13, w2, W = _gemm_problem(device, big)
    g = torch.Generator().manual_seed(9)
    h1 = torch.randn(R, 2 * F, generator=g).to(torch.bfloat16).to(device)
    g3 = torch.randn(R, D, generator=g).to(torch.bfloat16).to(device)
    h1q, g3q = Q.quantize_rows(h1), Q.quantize_rows(g3)
    u = torch.full((R + 5, F), float("nan"), dtype=torch.bfloat16, device=device)
    u_gemm(g3q, W, offs, u)
    assert torch.isnan(u[R:].float()).all(), "u: rows past offsets[E] written"
    u = u[:R].contiguous()
    act = Activation()
    bn = fp8_config(torch.device(device)).block_n
    parts = F // bn
    nrows = offs[-1:].clone()
    for scored in (False, True):
        kw, s = {}, None
        if scored:
            s = torch.rand(R, generator=g).to(device)
            s[2] = 0.0                           # a zero score
            buf = torch.zeros(R, 1 + parts, device=device)
            buf[:, 0] = s
            ptrs = buf.data_ptr() + torch.arange(R, device=device) * (1 + parts) * 4
            ptrs[3] = 0                          # a row without a score address: s = 0
            s[3] = 0.0                           # (the twin's way of saying so)
            kw = dict(score_ptrs=ptrs, score_grad_delta=4, part_stride=4)
        uh2 = u.clone()
        gh1 = torch.full((R, 2 * F), float("nan"), dtype=torch.bfloat16, device=device)
        swiglu_bwd_rows(uh2, h1q, gh1, nrows, R, F, block_n=bn, **kw)
        want_gh1, want_h2, want_parts = swiglu_bwd_rows_ref(u, h1q, act, s, bn)
        _close(f"split grad_h1 vs twin scored={scored}", gh1.float(), want_gh1.float(), 8e-3)
        _close(f"split h2 vs twin scored={scored}", uh2.float(), want_h2.float(), 8e-3)
        if scored:
            live = torch.arange(R, device=device) != 3
            _close("split parts vs twin", buf[live, 1:], want_parts[live], 1e-4)
            assert not buf[3, 1:].any(), "parts written for a row without a score address"
        # the fused epilogue on the same operands (fp32 u inside): one more bf16 rounding apart
        fgh1 = torch.full_like(gh1, float("nan"))
        fh2 = torch.full((R, F), float("nan"), dtype=torch.bfloat16, device=device)
        fkw = {}
        if scored:
            fbuf = buf.clone()
            fbuf[:, 1:] = 0
            fptrs = fbuf.data_ptr() + torch.arange(R, device=device) * (1 + parts) * 4
            fptrs[3] = 0
            fkw = dict(score_ptrs=fptrs, score_grad_delta=4, part_stride=4)
        fp8_grouped_mm(a=g3q, w=W.w2_t, w_scales=W.w2_t_s, expert_offsets=offs, max_rows=R,
                       epilogue="swiglu_bwd", out=fgh1, h1q=h1q, h2=fh2, **fkw)
        _close(f"split grad_h1 vs fused scored={scored}", gh1.float(), fgh1.float(), 2e-2)
        _close(f"split h2 vs fused scored={scored}", uh2.float(), fh2.float(), 8e-3)
        if scored:
            _close("split parts vs fused", buf[:, 1:].sum(1), fbuf[:, 1:].sum(1), 3e-2)


def check_swiglu_bwd_rows(device, big=False):
    """The split W2 DGRAD with our Triton GEMM storing u (the pass runs everywhere; on the GPU
    the CUTLASS unit stores u instead: check_fp8_fprop_cutlass)."""
    from megatron_dist_moe.kernels.grouped_gemm.fp8 import fp8_grouped_mm

    def triton_u(g3q, W, offs, u):
        fp8_grouped_mm(a=g3q, w=W.w2_t, w_scales=W.w2_t_s, expert_offsets=offs,
                       max_rows=u.shape[0], epilogue="store", out=u)
    _w2_dgrad_split(device, big, triton_u)


def _bundle_gap(got, want, used: int | None = None):
    """(fraction of e4m3 codes that differ, norm-wise error of the dequantized bundle) of a row
    bundle `got` = (q, s) against `want`, or of a column bundle over its first `used` padded
    rows (the calls' segments; the kernels leave the rest alone)."""
    deq = Q.dequantize_rows
    if used is not None:
        deq = Q.dequantize_cols
        got = (got[0][:, :used], got[1][:used // 128])
        want = (want[0][:, :used], want[1][:used // 128])
    codes = (got[0].view(U8) != want[0].view(U8)).double().mean().item()
    g, w = deq(*got).double(), deq(*want).double()
    assert not torch.isnan(g).any(), "NaN in a bundle (unwritten?)"
    return codes, ((g - w).norm() / w.norm().clamp(min=1e-30)).item()


def check_swiglu_bwd_quant_cuda(device, big=False):
    """quant_fp8_cuda.swiglu_bwd_quant (GPU only: csrc/) against its twin
    (rows_ref.swiglu_bwd_quant_ref): both activations, scored (a zero score, a row without a
    score address, parts per 128, 64 and 32 columns) and not, both scale rules, 40 experts (the
    segment search's second pass), a host row bound above R (blocks past the last segment
    return), on poisoned outputs with room past R and past the used padded rows that must stay
    poisoned. Its bf16 values are the twin's up to the kernel's exp and reciprocal
    approximations, so its bundles may differ where a value sits on an e4m3 rounding boundary:
    the bound is twice what the composed Triton path (swiglu_bwd_rows, then quantize_rows_cols
    twice) gets against the same twin, which carries approximations of the same kind (floors:
    1e-3 of the codes, 1e-3 norm-wise)."""
    lens, _offs, _R = _segments(big, device)
    F = 3072 if big else 256
    cases = [("swiglu", False, 128, True), ("swiglu", True, 128, True),
             ("swiglu_clamped", False, 128, False), ("swiglu_clamped", True, 64, True),
             ("swiglu", True, 32, False)]
    g = torch.Generator().manual_seed(17)
    for kind, scored, part_cols, pow2 in cases:
        _swiglu_bwd_quant_case(device, lens, F, kind, scored, part_cols, pow2, g)
    many = torch.randint(0, 300, (40,), generator=g)
    many[[3, 17, 33, 39]] = 0
    _swiglu_bwd_quant_case(device, many.tolist(), 256, "swiglu", True, 128, True, g)


def _swiglu_bwd_quant_case(device, lens, F, kind, scored, part_cols, pow2, g):
    from megatron_dist_moe.kernels import quant_fp8_cuda
    from megatron_dist_moe.kernels.quant_fp8 import quantize_rows_cols, swiglu_bwd_rows
    from megatron_dist_moe.kernels.rows_ref import swiglu_bwd_quant_ref
    E, R = len(lens), sum(lens)
    offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)
    max_rows = R + 300                                   # the host bound the grid covers
    Rp = padded_rows(R, E)
    used = int(Q.padded_offsets(offs.cpu())[-1])
    nrows = offs[-1:].clone()
    h1 = (torch.randn(R, 2 * F, generator=g) * 3).to(torch.bfloat16).to(device)  # past +-7 too
    u = torch.randn(R, F, generator=g).to(torch.bfloat16).to(device)
    act = Activation(kind)
    rc = Q.BlockScaling(pow2)
    h1q = Q.quantize_rows(h1, rc)
    kw, tkw, s, buf, tbuf = {}, {}, None, None, None
    if scored:
        s = torch.rand(R, generator=g).to(device)
        s[2] = 0.0                                       # a zero score
        s[3] = 0.0                                       # row 3 has no score address: s = 0
        buf = torch.full((R, 1 + F // part_cols), float("nan"), device=device)
        buf[:, 0] = s
        tbuf = buf.clone()

        def score_table(b):   # row r's score address, parts at + 4 + 4 * part
            p = b.data_ptr() + torch.arange(max_rows, device=device) * b.stride(0) * 4
            p[3] = 0
            p[R:] = 0
            return dict(score_ptrs=p, score_grad_delta=4, part_stride=4)
        kw, tkw = score_table(buf), score_table(tbuf)
    want = swiglu_bwd_quant_ref(u, h1q, offs, Rp, act, s, part_cols, rc)
    actkw = dict(activation=kind, swiglu_alpha=act.alpha, swiglu_limit=act.limit)

    def outs():   # 8 rows past R in the row bundle, the padded rows past `used` in the columns
        return ((torch.full((R + 8, 2 * F), 0xFF, dtype=U8, device=device).view(F8),
                 torch.full((R + 8, 2 * F // 128), float("nan"), device=device)),
                (torch.full((2 * F, Rp), 0xFF, dtype=U8, device=device).view(F8),
                 torch.full((Rp // 128, 2 * F), float("nan"), device=device)),
                (torch.full((F, Rp), 0xFF, dtype=U8, device=device).view(F8),
                 torch.full((Rp // 128, F), float("nan"), device=device)))
    # the composed Triton path: the bound's base
    tr = outs()
    uh2 = u.clone()
    gh1 = torch.empty(R, 2 * F, dtype=torch.bfloat16, device=device)
    swiglu_bwd_rows(uh2, h1q, gh1, nrows, max_rows, F, block_n=part_cols, **tkw, **actkw)
    quantize_rows_cols(gh1, offs, max_rows, 2 * F, rows=tr[0], cols=tr[1], recipe=rc)
    quantize_rows_cols(uh2, offs, max_rows, F, cols=tr[2], recipe=rc)
    # the fused kernel
    cu = outs()
    quant_fp8_cuda.swiglu_bwd_quant(u, h1q, offs, max_rows, F, gh1_rows=cu[0], gh1_cols=cu[1],
                                    h2_cols=cu[2], recipe=rc, part_cols=part_cols, **kw,
                                    **actkw)
    what = f"{kind} E={E} scored={scored} part_cols={part_cols} pow2={pow2}"
    assert (cu[0][0][R:].view(U8) == 0xFF).all() and cu[0][1][R:].isnan().all(), (
        f"{what}: row-bundle rows past R written")
    for q, sc in cu[1:]:
        assert (q[:, used:].view(U8) == 0xFF).all() and sc[used // 128:].isnan().all(), (
            f"{what}: column-bundle rows past the used padded rows written")
    for i, name in enumerate(("grad_h1 rows", "grad_h1 cols", "h2 cols")):
        t_i, c_i = tr[i], cu[i]
        if not i:
            t_i, c_i = (t_i[0][:R], t_i[1][:R]), (c_i[0][:R], c_i[1][:R])
        t_codes, t_err = _bundle_gap(t_i, want[i], used if i else None)
        c_codes, c_err = _bundle_gap(c_i, want[i], used if i else None)
        print(f"{name} {what}: codes differing / norm-wise error vs the twin: CUDA "
              f"{c_codes:.2e} / {c_err:.2e}, Triton path {t_codes:.2e} / {t_err:.2e}")
        assert c_codes <= max(2 * t_codes, 1e-3) and c_err <= max(2 * t_err, 1e-3), (
            f"{name} {what}: {c_codes:.2e} of the codes differ from the twin, norm-wise "
            f"error {c_err:.2e} (the Triton path: {t_codes:.2e}, {t_err:.2e})")
    if scored:
        # a part sums u round(act(h1)) over part_cols columns; where the kernel's act(h1) rounds
        # to the neighbouring bf16 value (its exp and reciprocal are approximations), a term
        # moves by at most one bf16 unit, 2^-7 of it: the bound is 2^-7 of the part's sum of
        # |terms| (a part written to a wrong slot, or a term lost, is off by a whole term)
        h2r = act.forward(Q.dequantize_rows(*h1q)).to(torch.bfloat16).float()
        mag = (u.float().abs() * h2r.abs()).view(R, F // part_cols, part_cols).sum(-1)
        live = torch.arange(R, device=device) != 3
        got, ref = buf[live, 1:].double(), want[3][live].double()
        assert not got.isnan().any(), f"parts {what}: NaN (unwritten?)"
        over = (got - ref).abs() - 2 ** -7 * mag[live].double()
        assert (over <= 1e-6 * ref.abs().max()).all(), (
            f"parts {what}: {(over > 0).sum().item()} parts off by more than 2^-7 of their "
            f"|terms| (worst excess {over.max().item():.3e})")
        assert buf[3, 1:].isnan().all(), "parts written for a row without a score address"
        assert torch.equal(buf[:, 0], s), "a score was overwritten"


def check_fp8_wgrad(device, big=False):
    from megatron_dist_moe.kernels.grouped_gemm import ExpertOutTable
    from megatron_dist_moe.kernels.grouped_gemm.fp8 import fp8_grouped_wgrad
    lens, offs, R, E, D, F, *_ = _gemm_problem(device, big)
    g = torch.Generator().manual_seed(11)
    a = torch.randn(R, D, generator=g).to(torch.bfloat16).to(device)
    b = torch.randn(R, F, generator=g).to(torch.bfloat16).to(device)
    Rp = padded_rows(R, E)
    ac = Q.quantize_cols(a, offs.long(), Rp)
    bc = Q.quantize_cols(b, offs.long(), Rp)
    po = Q.padded_offsets(offs).tolist()
    ad, bd = Q.dequantize_cols(*ac), Q.dequantize_cols(*bc)
    ref = torch.stack([ad[po[e]:po[e + 1]].T @ bd[po[e]:po[e + 1]] for e in range(E)])
    out = torch.full((E, D, F), float("nan"), device=device)
    fp8_grouped_wgrad(ac, bc, offs, out)
    _close("wgrad fp32", out, ref, _acc_tol(device))
    assert not out[1].any(), "an expert without rows must get exact zeros"
    out16 = torch.full((E, D, F), float("nan"), dtype=torch.bfloat16, device=device)
    fp8_grouped_wgrad(ac, bc, offs, out16)
    _close("wgrad bf16", out16.float(), ref, 8e-3)    # one bf16 unit
    accs = [torch.full((D, F), 2.0, device=device) for _ in range(E)]
    fp8_grouped_wgrad(ac, bc, offs, ExpertOutTable.of(accs), accumulate=True)
    _close("wgrad accumulate", torch.stack(accs) - 2.0, ref, _acc_tol(device))


CHECKS = {n[len("check_"):]: f for n, f in sorted(globals().items()) if n.startswith("check_")}
GPU_ONLY = ("fp8_fprop_cutlass", "swiglu_bwd_quant_cuda")   # CUDA C++: not in the interpreter's list

"""Child of tests/cpu/test_fp8_cutlass_wiring.py (TRITON_INTERPRET=1): fp8_block's kernels
with a stand-in for the CUTLASS FP8 unit (the test's docstring says what is checked)."""

from __future__ import annotations

import json
import traceback
import warnings

import torch

import megatron_dist_moe as dm
from megatron_dist_moe.quant import fp8_block as Q


def _close(name, got, want, tol):
    g, w = got.double(), want.double()
    assert not torch.isnan(g).any(), f"{name}: NaN (unwritten?)"
    err = ((g - w).abs().max() / w.abs().max().clamp(min=1e-30)).item()
    assert err <= tol, f"{name}: max error {err:.3e} x max|ref| > {tol:.1e}"


class _StandIn:
    """GroupedFp8FpropSm90's call signature on the Triton store epilogue; counts its calls."""

    def __init__(self, max_rows):
        self.max_rows, self.calls = max_rows, []

    def __call__(self, a, w, w_scales, expert_offsets, out):
        from megatron_dist_moe.kernels.grouped_gemm.fp8 import fp8_grouped_mm
        self.calls.append(tuple(w.shape))
        fp8_grouped_mm(a=a, w=w, w_scales=w_scales, expert_offsets=expert_offsets,
                       max_rows=self.max_rows, epilogue="store", out=out)


def routes_the_w13_fprop_and_splits_the_w2_dgrad(scored):
    from megatron_dist_moe.backends.cuda.experts import Fp8BlockKernels
    from megatron_dist_moe.kernels.grouped_gemm.fp8 import fp8_config
    E, D, F, counts = 2, 256, 128, [21, 14]
    R = sum(counts)
    cfg = dm.Config(num_local_input_tokens=R, hidden_dim=D, intermediate_dim=F, top_k=1,
                    num_experts=E, precision="fp8_block", backend="cuda")
    g = torch.Generator().manual_seed(3)
    offs = torch.tensor([0, counts[0], R], dtype=torch.int32)
    nrows = offs[-1:].clone()
    x = torch.randn(R, D, generator=g).to(torch.bfloat16)
    h1 = torch.randn(R, 2 * F, generator=g).to(torch.bfloat16)
    g3 = torch.randn(R, D, generator=g).to(torch.bfloat16)
    W = Q.prepare_weights((torch.randn(E, 2 * F, D, generator=g) / 16).to(torch.bfloat16),
                          (torch.randn(E, D, F, generator=g) / 11).to(torch.bfloat16))
    xq, h1q, g3q = Q.quantize_rows(x), Q.quantize_rows(h1), Q.quantize_rows(g3)

    tri = Fp8BlockKernels(cfg, E, R, "triton", torch.device("cpu"))
    cut = Fp8BlockKernels(cfg, E, R, "triton", torch.device("cpu"))
    cut.cutlass_fprop = stand_in = _StandIn(R)
    assert tri.cutlass_fprop is None

    # W13 FPROP: the unit, with the same operands and output
    h1_tri = torch.full((R, 2 * F), float("nan"), dtype=torch.bfloat16)
    h1_cut = h1_tri.clone()
    tri.mm(xq, W.w13, W.w13_s, offs, "store", out=h1_tri)
    cut.mm(xq, W.w13, W.w13_s, offs, "store", out=h1_cut)
    assert stand_in.calls == [tuple(W.w13.shape)]
    assert torch.equal(h1_cut, h1_tri)

    # W2 DGRAD: the GEMM storing u (Triton, or the unit) + the SwiGLU-backward pass and the
    # quantizer (fp8_quant "triton": the interpreter's) on both GEMM engines, bitwise alike; against the fused epilogue
    # (fp8_grouped_mm "swiglu_bwd", u in fp32 inside) and the quantizer over its bf16 outputs
    from megatron_dist_moe.kernels.grouped_gemm.fp8 import fp8_grouped_mm
    from megatron_dist_moe.kernels.quant_fp8 import quantize_rows_cols
    from megatron_dist_moe.layout import padded_rows
    parts = F // fp8_config(torch.device("cpu")).block_n
    Rp = padded_rows(R, E)
    used = int(Q.padded_offsets(offs)[-1])

    def bundles(K):
        return ((torch.zeros(R, K, dtype=torch.float8_e4m3fn), torch.zeros(R, K // 128)),
                (torch.zeros(K, Rp, dtype=torch.float8_e4m3fn), torch.zeros(Rp // 128, K)))
    outs = {}
    for name in ("triton", "unit", "fused"):
        (gq, gs), (gqc, gsc) = bundles(2 * F)
        _, (hqc, hsc) = bundles(F)
        sc, buf = {}, None
        if scored:
            s = torch.rand(R, generator=torch.Generator().manual_seed(5))
            buf = torch.zeros(R, 1 + parts)
            buf[:, 0] = s
            ptrs = buf.data_ptr() + torch.arange(R) * (1 + parts) * 4
            ptrs[6] = 0                      # a row without a score address
            sc = dict(score_ptrs=ptrs, score_grad_delta=4, part_stride=4)
        if name == "fused":
            gh1 = torch.full((R, 2 * F), float("nan"), dtype=torch.bfloat16)
            h2 = torch.full((R, F), float("nan"), dtype=torch.bfloat16)
            fp8_grouped_mm(a=g3q, w=W.w2_t, w_scales=W.w2_t_s, expert_offsets=offs, max_rows=R,
                           epilogue="swiglu_bwd", out=gh1, h1q=h1q, h2=h2, **sc)
            quantize_rows_cols(gh1, offs, R, 2 * F, rows=(gq, gs), cols=(gqc, gsc))
            quantize_rows_cols(h2, offs, R, F, cols=(hqc, hsc))
        else:
            gh1 = torch.full((R, 2 * F), float("nan"), dtype=torch.bfloat16)
            u = torch.full((R, F), float("nan"), dtype=torch.bfloat16)
            k = tri if name == "triton" else cut
            k.w2_dgrad(g3q, W, offs, nrows, h1q, u, gh1, (gq, gs), (gqc, gsc), (hqc, hsc), **sc)
        outs[name] = (Q.dequantize_rows(gq, gs), Q.dequantize_cols(gqc, gsc)[:used],
                      Q.dequantize_cols(hqc, hsc)[:used], buf)
    assert stand_in.calls[-1] == tuple(W.w2_t.shape), "the W2 DGRAD's GEMM is the unit's"
    t, c, f = outs["triton"], outs["unit"], outs["fused"]
    for a, b in zip(t[:3], c[:3]):
        assert torch.equal(a, b), "the two engines' W2 DGRADs differ"
    # one more bf16 rounding of u, then E4M3 (3 mantissa bits): a flipped rounding moves a
    # value by up to one E4M3 step, 1/8 of its block's scale range
    for what, a, b in zip(("grad_h1 rows", "grad_h1 columns", "h2 columns"), c[:3], f[:3]):
        _close(what, a, b, 0.07)
    if scored:
        sb, fb = c[3], f[3]
        assert torch.equal(sb, t[3])
        _close("score parts", sb[:, 1:].sum(1), fb[:, 1:].sum(1), 3e-2)
        assert torch.equal(sb[:, 0], fb[:, 0]), "the scores themselves are not written"
        assert not sb[6, 1:].any(), "parts written for a row without a score address"
        assert not c[0][6].any(), "a row without a score address has s = 0: zero grad_h1"
    # W13 DGRAD: the unit's dense rows (into the dead g3 buffer) + one scatter launch, against
    # the GEMM that scatters from its epilogue: the same sums, so the same bits
    from megatron_dist_moe.kernels.common import device_ptr
    gh1q = Q.quantize_rows(torch.randn(R, 2 * F, generator=g).to(torch.bfloat16))
    outs = []
    for k in (tri, cut):
        dst = torch.full((R + 3, D), float("nan"), dtype=torch.bfloat16)
        perm = torch.randperm(R + 3, generator=torch.Generator().manual_seed(1))[:R]
        ptrs = device_ptr(dst) + perm * D * 2
        ptrs = ptrs.view(-1).clone()
        ptrs[4] = 0                                  # a route without a destination
        dense = torch.full((R, D), float("nan"), dtype=torch.bfloat16)
        k.w13_dgrad(gh1q, W, offs, nrows, ptrs, dense)
        outs.append((dst, perm))
    assert stand_in.calls[-1] == tuple(W.w13_t.shape), "the W13 DGRAD's GEMM is the unit's"
    (dt, pt), (dc, pc) = outs
    assert torch.equal(pt, pc)
    keep = torch.arange(R) != 4
    assert not torch.isnan(dc[pc[keep]].float()).any(), "scattered rows left unwritten"
    assert torch.equal(dc[pc[keep]], dt[pt[keep]]), "split W13 DGRAD differs from the fused"
    assert torch.isnan(dc[pc[4]].float()).all(), "the row with address 0 was written"
    return dict(unit_calls=len(stand_in.calls))


if __name__ == "__main__":
    warnings.simplefilter("ignore", UserWarning)
    for scored in (False, True):
        name = f"wiring_scored={scored}"
        try:
            res = dict(name=name, ok=True, **routes_the_w13_fprop_and_splits_the_w2_dgrad(scored))
        except Exception as ex:
            res = dict(name=name, ok=False, error=f"{type(ex).__name__}: {ex}",
                       trace=traceback.format_exc()[-2000:])
        print("RESULT " + json.dumps(res), flush=True)

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

    # W2 DGRAD: the GEMM storing u (Triton, or the unit) + the pass on both engines, bitwise
    # alike; against the fused epilogue (fp8_grouped_mm "swiglu_bwd", u in fp32 inside)
    from megatron_dist_moe.kernels.grouped_gemm.fp8 import fp8_grouped_mm
    parts = F // fp8_config(torch.device("cpu")).block_n
    outs = {}
    for name in ("triton", "unit", "fused"):
        gh1 = torch.full((R, 2 * F), float("nan"), dtype=torch.bfloat16)
        h2 = torch.full((R, F), float("nan"), dtype=torch.bfloat16)
        sc, buf = {}, None
        if scored:
            s = torch.rand(R, generator=torch.Generator().manual_seed(5))
            buf = torch.zeros(R, 1 + parts)
            buf[:, 0] = s
            ptrs = buf.data_ptr() + torch.arange(R) * (1 + parts) * 4
            ptrs[6] = 0                      # a row without a score address
            sc = dict(score_ptrs=ptrs, score_grad_delta=4, part_stride=4)
        if name == "fused":
            fp8_grouped_mm(a=g3q, w=W.w2_t, w_scales=W.w2_t_s, expert_offsets=offs, max_rows=R,
                           epilogue="swiglu_bwd", out=gh1, h1q=h1q, h2=h2, **sc)
        else:
            (tri if name == "triton" else cut).w2_dgrad(g3q, W, offs, nrows, gh1, h1q, h2, **sc)
        outs[name] = (gh1, h2, buf)
    assert stand_in.calls[-1] == tuple(W.w2_t.shape), "the W2 DGRAD's GEMM is the unit's"
    (tg, th, tb), (sg, sh, sb), (fg, fh, fb) = outs["triton"], outs["unit"], outs["fused"]
    assert torch.equal(sg, tg) and torch.equal(sh, th), "the two engines' splits differ"
    _close("grad_h1", sg.float(), fg.float(), 2e-2)
    _close("h2", sh.float(), fh.float(), 8e-3)
    if scored:
        assert torch.equal(sb, tb)
        _close("score parts", sb[:, 1:].sum(1), fb[:, 1:].sum(1), 3e-2)
        assert torch.equal(sb[:, 0], fb[:, 0]), "the scores themselves are not written"
        assert not sb[6, 1:].any(), "parts written for a row without a score address"
        assert not sg[6].float().any() and not sh[6].float().any(), (
            "a row without a score address has s = 0: zero grad_h1 and h2")
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

"""fp8_block kernels at the guide's expert shape on one GPU, beside bf16 and torch._scaled_mm.

    python benchmarks/bench_fp8_gemm.py --out bench_out [--shape 6x2048x7168x3072] [--no-cutlass]

Every kernel is checked against its torch twin first (the same math on the dequantized
operands; exit 1 on a mismatch), then timed as a CUDA graph with the guide's method
(benchmarks/common.py). Rows (CSV `bench_fp8_gemm.csv`, plot `bench_fp8_gemm.png`):

  GEMMs (useful TFLOP/s; ratio = fp8 over our bf16 kernel of the same product)
    w13_fprop     h1 = x W13^T            fp8: store epilogue   bf16: ours with the SwiGLU epilogue
    w2_fprop      h3 = h2 W2^T, scattered to rows by address
    w2_dgrad      u = g3 W2 with the SwiGLU backward and score parts in the epilogue
    w2_dgrad split   the same as the layer runs it: Triton's store epilogue writes u (bf16), one
                  pass (quant_fp8.swiglu_bwd_rows) the SwiGLU backward (grad_h1, h2 in bf16)
                  and the score parts: what the fused epilogue of the w2_dgrad row writes (the
                  quantizers of grad_h1 and h2 follow either, rows quant_gh1, quant_h2_cols)
    w13_dgrad     grad_x = grad_h1 W13, scattered
    w13_wgrad / w2_wgrad   the two weight gradients (bf16 out)
    w13_fprop cutlass_<config>, w13_wgrad cutlass_<config>, w2_wgrad cutlass_<config>   the same
                  GEMMs on CUTLASS's sm_90a blockwise-scaled FP8 grouped kernels; w2_dgrad
                  cutlass_<config>: the FPROP unit storing u = g3 W2 plus swiglu_bwd_rows,
                  w13_dgrad cutlass_<config>: the unit's dense
                  rows plus one scatter launch (rows.scatter_rows), as the layer runs them on
                  the CUTLASS engine; w2_fprop cutlass_<config>: the same split for the W2
                  FPROP (the layer runs the unit's dense rows alone at EP = 1, where the
                  owner's combine reads them; the scatter kernel is measured here only)
                  (kernels/grouped_gemm_sm90: GroupedFp8FpropSm90 and GroupedFp8WgradSm90,
                  every configuration), right after our Triton row; note: x
                  over Triton. Skipped where the library cannot be built (nvcc, CUTLASS
                  headers) or with --no-cutlass; the first run builds it (minutes)
    scaled_mm     torch._scaled_mm on ONE dense [R, D] x [D, 2F] product with the same 1x128 /
                  128x128 scales: the vendor block-scaled rate at this size (not grouped)
  Quantization (GB/s of bytes read + written)
    quant_x       x_g rows and columns, swiglu_quant (h1 -> h1q, h2q), quant_w13 / quant_w2
                  (both orientations), quant_gh1 (grad_h1 rows + columns), quant_h2_cols,
                  swiglu_bwd_rows (u, h1q -> bf16 grad_h1, h2, score parts: the W2 DGRAD's
                  pass after its GEMM)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import append_csv_fields, git_commit, pyplot, time_windows  # noqa: E402
from megatron_dist_moe.kernels.grouped_gemm import (  # noqa: E402
    grouped_mm_dgrad, grouped_mm_fwd, grouped_mm_wgrad)
from megatron_dist_moe.kernels.grouped_gemm.fp8 import (  # noqa: E402
    fp8_config, fp8_grouped_mm, fp8_grouped_wgrad)
from megatron_dist_moe.kernels.rows import device_ptr, scatter_rows  # noqa: E402
from megatron_dist_moe.kernels.quant_fp8 import (  # noqa: E402
    quantize_rows_cols, quantize_weight, swiglu_bwd_rows, swiglu_quant)
from megatron_dist_moe.layout import padded_rows  # noqa: E402
from megatron_dist_moe.quant import fp8_block as Q  # noqa: E402

FIELDS = ["commit", "gpu", "precision", "kernel", "shape", "ms", "ms_min", "ms_max",
          "useful_tflops", "gbps", "ratio_to_bf16", "note"]
BF = torch.bfloat16
F8 = torch.float8_e4m3fn


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cutlass_gemms(E: int, dev: torch.device) -> dict:
    """{"fprop" | "wgrad": {config: GroupedFp8FpropSm90 | GroupedFp8WgradSm90}} of CUTLASS's FP8
    units, or {} (with the reason printed) where the library cannot be built or run here."""
    from megatron_dist_moe.kernels import grouped_gemm_sm90 as sm90
    if not sm90.available():
        print("cutlass: skipped (nvcc, the CUTLASS headers or csrc/ missing)", flush=True)
        return {}
    try:
        return {"fprop": {c: sm90.GroupedFp8FpropSm90(E, dev, c) for c in sm90.FP8_FPROP_CONFIGS},
                "wgrad": {c: sm90.GroupedFp8WgradSm90(E, dev, c) for c in sm90.FP8_WGRAD_CONFIGS}}
    except (RuntimeError, ValueError) as e:   # not a Hopper GPU, or the build failed
        print(f"cutlass: skipped ({type(e).__name__}: {str(e)[:300]})", flush=True)
        return {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--shape", default="6x2048x7168x3072", help="E x rows per expert x D x F")
    ap.add_argument("--sweep", action="store_true",
                    help="also time pipeline-depth and grouping candidates of the fp8 GEMMs")
    ap.add_argument("--no-cutlass", dest="cutlass", action="store_false",
                    help="skip the CUTLASS FP8 rows (they build the csrc/ library first)")
    args = ap.parse_args(argv)
    E, n, D, F = map(int, args.shape.split("x"))
    R = E * n
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, device=dev, generator=g) * scale).to(BF)  # noqa
    offs = torch.arange(0, R + 1, n, dtype=torch.int32, device=dev)
    x, g3, h1 = rnd(R, D), rnd(R, D), rnd(R, 2 * F)
    w13, w2 = rnd(E, 2 * F, D, scale=D ** -0.5), rnd(E, D, F, scale=F ** -0.5)
    W = Q.prepare_weights(w13, w2)
    xq, g3q, h1q = Q.quantize_rows(x), Q.quantize_rows(g3), Q.quantize_rows(h1)
    h2 = rnd(R, F)
    h2q = Q.quantize_rows(h2)
    gh1 = rnd(R, 2 * F, scale=0.1)
    gh1q = Q.quantize_rows(gh1)
    Rp = padded_rows(R, E)
    cols = {k: Q.quantize_cols(v, offs.long(), Rp) for k, v in
            (("x", x), ("g3", g3), ("h2", h2), ("gh1", gh1))}
    out_h1 = torch.empty(R, 2 * F, dtype=BF, device=dev)
    out_h2 = torch.empty(R, F, dtype=BF, device=dev)
    dst = torch.empty(R, D, dtype=BF, device=dev)
    row_ptrs = dst.data_ptr() + torch.arange(R, device=dev, dtype=torch.int64) * D * 2
    scores = torch.rand(R, device=dev)
    sbuf = torch.zeros(R, 1 + F // 64, device=dev)   # parts of n-tiles down to 64 wide
    sbuf[:, 0] = scores
    sptrs = sbuf.data_ptr() + torch.arange(R, device=dev) * sbuf.shape[1] * 4
    wg13 = torch.empty(E, 2 * F, D, dtype=BF, device=dev)
    wg2 = torch.empty(E, D, F, dtype=BF, device=dev)

    deq = Q.dequantize_rows
    w13d, w2d = Q.dequantize_weight(W.w13, W.w13_s), Q.dequantize_weight(W.w2, W.w2_s)
    per = lambda f: torch.cat([f(e, e * n, (e + 1) * n) for e in range(E)])  # noqa: E731
    fp8 = {
        "w13_fprop": (lambda c=None: fp8_grouped_mm(config=c, a=xq, w=W.w13, w_scales=W.w13_s,
                                             expert_offsets=offs, max_rows=R, epilogue="store",
                                             out=out_h1), 2 * R * 2 * F * D,
                      lambda: rel(out_h1, per(lambda e, a, b: deq(*xq)[a:b] @ w13d[e].T))),
        "w2_fprop": (lambda c=None: fp8_grouped_mm(config=c, a=h2q, w=W.w2, w_scales=W.w2_s, expert_offsets=offs,
                                            max_rows=R, epilogue="scatter",
                                            out_row_ptrs=row_ptrs), 2 * R * D * F,
                     lambda: rel(dst, per(lambda e, a, b: deq(*h2q)[a:b] @ w2d[e].T))),
        "w2_dgrad": (lambda c=None: fp8_grouped_mm(config=c, a=g3q, w=W.w2_t, w_scales=W.w2_t_s,
                                            expert_offsets=offs, max_rows=R,
                                            epilogue="swiglu_bwd", out=out_h1, h1q=h1q,
                                            h2=out_h2, score_ptrs=sptrs, score_grad_delta=4,
                                            part_stride=4), 2 * R * D * F,
                     lambda: rel(sbuf[:, 1:].sum(1), (per(lambda e, a, b: deq(*g3q)[a:b] @ w2d[e])
                                                      * torch.nn.functional.silu(deq(*h1q)[:, :F])
                                                      .mul(deq(*h1q)[:, F:]).to(BF).float())
                                 .sum(1))),
        "w13_dgrad": (lambda c=None: fp8_grouped_mm(config=c, a=gh1q, w=W.w13_t, w_scales=W.w13_t_s,
                                             expert_offsets=offs, max_rows=R,
                                             epilogue="scatter", out_row_ptrs=row_ptrs),
                      2 * R * D * 2 * F,
                      lambda: rel(dst, per(lambda e, a, b: deq(*gh1q)[a:b] @ w13d[e]))),
        "w13_wgrad": (lambda c=None: fp8_grouped_wgrad(cols["gh1"], cols["x"], offs, wg13, config=c),
                      2 * R * D * 2 * F,
                      lambda: rel(wg13[0].float(), Q.dequantize_cols(*cols["gh1"])[:n].T
                                  @ Q.dequantize_cols(*cols["x"])[:n])),
        "w2_wgrad": (lambda c=None: fp8_grouped_wgrad(cols["g3"], cols["h2"], offs, wg2, config=c),
                     2 * R * D * F, None),
    }
    bf16 = {
        "w13_fprop": lambda: grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=R, a=x,
                                            epilogue="swiglu", h1=out_h1, h2=out_h2),
        "w2_fprop": lambda: grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=R, a=h2,
                                           epilogue="scatter", out_row_ptrs=row_ptrs),
        "w2_dgrad": lambda: grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=R, a=g3,
                                             epilogue="swiglu_bwd", h1=out_h1, h2=out_h2),
        "w13_dgrad": lambda: grouped_mm_dgrad(w=w13, expert_offsets=offs, max_rows=R, a=gh1,
                                              epilogue="scatter", out_row_ptrs=row_ptrs),
        "w13_wgrad": lambda: grouped_mm_wgrad(gh1, x, offs, wg13, dtype=BF),
        "w2_wgrad": lambda: grouped_mm_wgrad(g3, h2, offs, wg2, dtype=BF),
    }
    gpu, commit = torch.cuda.get_device_name(), git_commit()
    shape = f"E{E}x{n} D{D} F{F}"
    rows, failed = [], False

    def row(precision, kernel, t, flops=None, nbytes=None, ratio="", note=""):
        r = dict(commit=commit, gpu=gpu, precision=precision, kernel=kernel, shape=shape,
                 ms=round(t.median_ms, 4), ms_min=round(t.min_ms, 4), ms_max=round(t.max_ms, 4),
                 useful_tflops=round(flops / t.median_ms / 1e9, 1) if flops else "",
                 gbps=round(nbytes / t.median_ms / 1e6, 1) if nbytes else "",
                 ratio_to_bf16=ratio, note=note)
        rows.append(r)
        print(f"{precision:<9} {kernel:<12} {t.median_ms:8.3f} ms  "
              + (f"{r['useful_tflops']:7.1f} TFLOP/s" if flops else f"{r['gbps']:7.1f} GB/s")
              + (f"  x{ratio} vs bf16" if ratio != "" else "") + (f"  {note}" if note else ""),
              flush=True)
        return r

    def poison():   # no check passes on another kernel's (or candidate's) output
        for buf in (out_h1, out_h2, dst, wg13, wg2):
            buf.fill_(float("nan"))
        sbuf[:, 1:].zero_()

    # the CUTLASS FP8 GEMMs: a call of each configuration's unit and its check (the Triton
    # row's twin; the WGRADs against expert 0's product, as the w13_wgrad row)
    cutlass = cutlass_gemms(E, dev) if args.cutlass else {}

    def wgrad_case(a, b, out):
        return (lambda gemm: (lambda: gemm(a, b, offs, out)),
                lambda: rel(out[0].float(), Q.dequantize_cols(*a)[:n].T
                            @ Q.dequantize_cols(*b)[:n]))
    nrows = offs[-1:].clone()
    bn = fp8_config(dev).block_n     # the score parts the layer's W2 DGRAD writes per row

    # what the quantizers after the layer's W2 DGRAD write: grad_h1's row and column bundles,
    # h2's column bundle
    gh1_rows = (torch.empty(R, 2 * F, dtype=F8, device=dev),
                torch.empty(R, 2 * F // 128, device=dev))
    gh1_cols = (torch.empty(2 * F, Rp, dtype=F8, device=dev),
                torch.empty(Rp // 128, 2 * F, device=dev))
    h2_cols = (torch.empty(F, Rp, dtype=F8, device=dev), torch.empty(Rp // 128, F, device=dev))

    def swiglu_bwd_after_u():    # what the fused epilogue computes, from the stored u
        swiglu_bwd_rows(out_h2, h1q, out_h1, nrows, R, F, score_ptrs=sptrs, score_grad_delta=4,
                        part_stride=4, block_n=bn)

    def w2_dgrad_split(gemm):
        def fn():
            gemm(g3q, W.w2_t, W.w2_t_s, offs, out_h2)       # u into h2's buffer
            swiglu_bwd_after_u()
        return fn
    dense = torch.empty(R, D, dtype=BF, device=dev)
    dense_ptr = device_ptr(dense)

    def split_scatter(a, w, ws):
        def make(gemm):
            def fn():
                gemm(a, w, ws, offs, dense)
                scatter_rows(dense_ptr, row_ptrs, nrows, D, BF, R)
            return fn
        return make
    cutlass_cases = {
        "w13_fprop": ("fprop", lambda gemm: (lambda: gemm(xq, W.w13, W.w13_s, offs, out_h1)),
                      fp8["w13_fprop"][2]),
        "w2_dgrad": ("fprop", w2_dgrad_split, fp8["w2_dgrad"][2]),
        "w13_dgrad": ("fprop", split_scatter(gh1q, W.w13_t, W.w13_t_s), fp8["w13_dgrad"][2]),
        "w2_fprop": ("fprop", split_scatter(h2q, W.w2, W.w2_s), fp8["w2_fprop"][2]),
        "w13_wgrad": ("wgrad", *wgrad_case(cols["gh1"], cols["x"], wg13)),
        "w2_wgrad": ("wgrad", *wgrad_case(cols["g3"], cols["h2"], wg2)),
    }

    def cutlass_rows(k, flops, tb, t8):
        nonlocal failed
        kind, call, check = cutlass_cases[k]
        for cfg, gemm in cutlass.get(kind, {}).items():
            fn = call(gemm)
            poison()
            fn()
            torch.cuda.synchronize()
            err = check()
            if not err < 2e-2:
                print(f"MISMATCH {k} cutlass_{cfg}: rel err {err:.2e} vs its torch twin",
                      flush=True)
                failed = True
                continue
            t = time_windows(fn, graph=True)
            row("fp8_block", f"{k} cutlass_{cfg}", t, flops,
                ratio=round(tb.median_ms / t.median_ms, 3),
                note=f"CUTLASS sm90 FP8 blockwise; x{t8.median_ms / t.median_ms:.3f} vs Triton")

    for k, (fn, flops, check) in fp8.items():
        poison()
        fn()
        torch.cuda.synchronize()
        if check is not None:
            err = check()
            if not err < 2e-2:
                print(f"MISMATCH {k}: rel err {err:.2e} vs its torch twin", flush=True)
                failed = True
                continue
        t8 = time_windows(fn, graph=True)
        tb = time_windows(bf16[k], graph=True)
        row("bf16", k, tb, flops)
        row("fp8_block", k, t8, flops, ratio=round(tb.median_ms / t8.median_ms, 3))
        if k == "w2_dgrad":
            split = w2_dgrad_split(lambda a, w, ws, o, out: fp8_grouped_mm(
                a=a, w=w, w_scales=ws, expert_offsets=o, max_rows=R, epilogue="store", out=out))
            poison()
            split()
            torch.cuda.synchronize()
            err = check()
            if not err < 2e-2:
                print(f"MISMATCH w2_dgrad split: rel err {err:.2e} vs its torch twin", flush=True)
                failed = True
            else:
                ts = time_windows(split, graph=True)
                row("fp8_block", "w2_dgrad split", ts, flops,
                    ratio=round(tb.median_ms / ts.median_ms, 3),
                    note=f"Triton store + swiglu_bwd_rows; x{t8.median_ms / ts.median_ms:.3f} "
                         "vs the fused epilogue")
        if k in cutlass_cases:
            cutlass_rows(k, flops, tb, t8)
    if args.sweep:
        # candidates around the default (one warpgroup, 64 x 128, two programs per SM):
        # pipeline depth, grouping, one program per SM, and the two-warpgroup 128 x 128 tile
        # (Triton waits for each block's wgmma before scaling it, so only a second resident
        # program overlaps that; docs/decisions.md)
        from megatron_dist_moe.kernels.grouped_gemm.fp8 import FP8_CONFIG
        two_wg = FP8_CONFIG.replace(block_m=128, num_warps=8, group_m=8, programs_per_sm=1)
        cands = [FP8_CONFIG.replace(num_stages=4), FP8_CONFIG.replace(group_m=8),
                 FP8_CONFIG.replace(programs_per_sm=1), two_wg, two_wg.replace(num_stages=4),
                 FP8_CONFIG.replace(block_m=128, block_n=64)]
        for k, (fn, flops, check) in fp8.items():
            for c in cands:
                try:
                    poison()
                    fn(c)
                    torch.cuda.synchronize()
                    err = check() if check is not None else 0.0
                    if not err < 2e-2:
                        print(f"MISMATCH {k} [{c}]: rel err {err:.2e} vs its torch twin",
                              flush=True)
                        failed = True
                        continue
                    row("fp8_block", f"{k} [{c}]", time_windows(lambda c=c: fn(c), graph=True),
                        flops, note="sweep")
                except Exception as e:   # a candidate that does not compile: say so, go on
                    print(f"sweep {k} [{c}]: {type(e).__name__}: {str(e)[:150]}", flush=True)
    try:   # the vendor block-scaled GEMM on one dense product of the W13 size
        a, sa = xq
        b, sb = W.w13[0], W.w13_s[0]
        fn = lambda: torch._scaled_mm(a, b.t(), scale_a=sa.t().contiguous().t(),  # noqa: E731
                                      scale_b=sb.t(), out_dtype=BF)
        ref = deq(a, sa) @ Q.dequantize_weight(W.w13[:1], W.w13_s[:1])[0].T
        err = rel(fn().float(), ref)
        note = f"one dense [{R}, {D}] x [{D}, {2 * F}] product; rel err {err:.1e} vs the twin"
        t = time_windows(fn, graph=True)
        row("fp8_block", "scaled_mm", t, 2 * R * 2 * F * D, note=note)
    except Exception as e:   # older torch, or a layout this torch does not take
        print(f"scaled_mm: unavailable ({type(e).__name__}: {str(e)[:120]})", flush=True)
    # quantization kernels: bytes read + written
    xr = (torch.empty(R, D, dtype=F8, device=dev), torch.empty(R, D // 128, device=dev))
    xc = (torch.empty(D, Rp, dtype=F8, device=dev), torch.empty(Rp // 128, D, device=dev))
    nr = offs[-1:].clone()
    hq = (torch.empty(R, 2 * F, dtype=F8, device=dev), torch.empty(R, 2 * F // 128, device=dev))
    h2o = (torch.empty(R, F, dtype=F8, device=dev), torch.empty(R, F // 128, device=dev))
    quant = {
        "quant_x": (lambda: quantize_rows_cols(x, offs, R, D, rows=xr, cols=xc),
                    R * D * 2 + 2 * R * D * 1.03),
        "swiglu_quant": (lambda: swiglu_quant(h1, nr, R, F, h2q=h2o, h1q=hq),
                         R * 2 * F * 2 + R * 3 * F * 1.03),
        "quant_w13": (lambda: quantize_weight(w13), E * 2 * F * D * (2 + 2)),
        "quant_w2": (lambda: quantize_weight(w2), E * D * F * (2 + 2)),
        "quant_gh1": (lambda: quantize_rows_cols(out_h1, offs, R, 2 * F, rows=gh1_rows,
                                                 cols=gh1_cols), R * 2 * F * 2 + 2 * R * 2 * F * 1.03),
        "quant_h2_cols": (lambda: quantize_rows_cols(out_h2, offs, R, F, cols=h2_cols),
                          R * F * 2 + R * F * 1.03),
        # u in place (read + h2 written) and h1q read, grad_h1 written (the scores' parts: ~0)
        "swiglu_bwd_rows": (lambda: swiglu_bwd_rows(out_h2, h1q, out_h1, nr, R, F,
                                                    score_ptrs=sptrs, score_grad_delta=4,
                                                    part_stride=4, block_n=bn),
                            R * F * (2 + 2) + R * 2 * F * 1.03 + R * 2 * F * 2),
    }
    for k, (fn, nbytes) in quant.items():
        row("fp8_block", k, time_windows(fn, graph=True), nbytes=nbytes)
    os.makedirs(args.out, exist_ok=True)
    append_csv_fields(os.path.join(args.out, "bench_fp8_gemm.csv"), rows, FIELDS)
    plt = pyplot()
    if plt is not None:
        gem = [r for r in rows if r["useful_tflops"] != ""]
        ks = list(dict.fromkeys(r["kernel"] for r in gem))
        fig, ax = plt.subplots(figsize=(10, 4.5))
        for i, prec in enumerate(("bf16", "fp8_block")):
            xs = [j + 0.4 * i for j, k in enumerate(ks)
                  if any(r["kernel"] == k and r["precision"] == prec for r in gem)]
            ys = [r["useful_tflops"] for k in ks for r in gem
                  if r["kernel"] == k and r["precision"] == prec]
            ax.bar(xs, ys, 0.4, label=prec)
            for xv, yv in zip(xs, ys):
                ax.text(xv, yv, f"{yv:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + 0.2 for j in range(len(ks))], ks, rotation=20)
        ax.set_ylabel("useful TFLOP/s")
        ax.set_title(f"{gpu}, {shape}, commit {commit}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "bench_fp8_gemm.png"), dpi=120)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

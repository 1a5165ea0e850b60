"""The NVFP4 grouped GEMM at the guide's expert shapes on one GPU: decode variants and tile shapes
beside our bf16 GEMM on the dequantized weights.

    python benchmarks/bench_nvfp4_gemm.py --out bench_out [--rows 48,192,768,12288] [--sweep]

Per total row count R (spread evenly over E=6 experts: R=48 is T=8 tokens x K=6 routes, R=12288
is the guide's training load) and GEMM (w13: N=6144, K=7168; w2: N=7168, K=3072):

    nvfp4 <decode>/<tiles>   kernels/grouped_gemm/nvfp4.py with that decode ("f16_asm": packed
                             PTX; "f16": the same bits in Triton ops) and tile shape (BMxBNxBK,
                             warps, stages, programs per SM); "+A once": the A rows decoded
                             by quant_nvfp4.dequantize_rows first (timed with it), as the
                             pipeline runs it, instead of by every program
    bf16                     our bf16 grouped GEMM (store epilogue) on the dequantized weights
                             and rows: what the bf16 path runs at the same R
    dense+A once             nvfp4_dense.py: the weights decoded into fp16 per call (in groups
                             within its scratch bound), then our fp16 GEMM with the global
                             scales in its epilogue; "weights decode alone": that pass by itself

Every variant's output is checked against the twin math (dequantized operands, fp32 matmul)
within one bf16 unit of the output first (exit 1 on a mismatch), then timed as a CUDA graph
(benchmarks/common.py). Rows (CSV bench_nvfp4_gemm.csv, plot bench_nvfp4_gemm.png): commit,
GPU, shape, µs, useful TFLOP/s, weight GB/s (the bytes of the NVFP4 weights over the time: the
decode regime's figure of merit), ratio to bf16.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import append_csv_fields, git_commit, pyplot, time_windows  # noqa: E402
from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_fwd  # noqa: E402
from megatron_dist_moe.kernels.grouped_gemm import nvfp4_decode, nvfp4_dense, nvfp4_wgmma  # noqa: E402
from megatron_dist_moe.kernels.grouped_gemm.nvfp4 import (  # noqa: E402
    Nvfp4Tiles, default_tiles, nvfp4_grouped_mm)
from megatron_dist_moe.kernels.quant_nvfp4 import dequantize_rows  # noqa: E402
from megatron_dist_moe.quant import nvfp4 as NV  # noqa: E402

FIELDS = ["commit", "gpu", "precision", "kernel", "variant", "shape", "rows", "ms", "ms_min",
          "ms_max", "useful_tflops", "weight_gbps", "ratio_to_bf16", "note"]
BF = torch.bfloat16
E = 6
GEMMS = {"w13": (6144, 7168), "w2": (7168, 3072)}
# --sweep: tile candidates around each regime's default (f16_asm decode, A decoded once). Without
# the pre-decoded A each warp of a 16-row tile decodes the whole A tile (the MMA's M side): per
# weight value 1 + num_warps x 16 / BN values, which the "A once" form removes.
DECODE_SWEEP = [Nvfp4Tiles(16, 64, 128, 4, 3, 2), Nvfp4Tiles(16, 128, 128, 4, 3, 4),
                Nvfp4Tiles(16, 128, 128, 2, 3, 4), Nvfp4Tiles(16, 128, 128, 2, 3, 8),
                Nvfp4Tiles(16, 256, 128, 4, 3, 2), Nvfp4Tiles(32, 64, 128, 4, 3, 2),
                Nvfp4Tiles(32, 128, 128, 4, 3, 2)]
# 256-row tiles decode each weight tile half as often as 128-row ones (the decoded W tile sits
# in shared memory for both warpgroups' wgmma)
LARGE_SWEEP = [Nvfp4Tiles(128, 128, 64, 8), Nvfp4Tiles(128, 256, 64, 8),
               Nvfp4Tiles(256, 128, 64, 8), Nvfp4Tiles(256, 128, 64, 8, 4),
               Nvfp4Tiles(256, 128, 64, 8, 5)]


def tiles_name(t: Nvfp4Tiles) -> str:
    return (f"{t.block_m}x{t.block_n}x{t.block_k}_w{t.num_warps}_s{t.num_stages}"
            f"_p{t.programs_per_sm}")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def problem(R: int, N: int, K: int, dev):
    g = torch.Generator().manual_seed(R + N)
    lens = [R // E + (1 if e < R % E else 0) for e in range(E)]
    offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(R, K, generator=g).to(BF).to(dev)
    w = (torch.randn(E, N, K, generator=g) / K ** 0.5).to(BF).to(dev)
    wq = NV.quantize_weight(w.float())       # (packed, scales, global) per expert
    from megatron_dist_moe.prepared import PreparedWeight
    W = PreparedWeight(*wq, (E, N, K))
    a = NV.quantize_row_bytes(x)
    xd, wd = NV.dequantize_row_bytes(a, K), W.dequantize()
    o = offs.tolist()
    ref = torch.cat([xd[o[e]:o[e + 1]] @ wd[e].T for e in range(E)])
    return dict(offs=offs.to(dev), a=a, W=W, ref=ref, xd=xd.to(BF), wd=wd.to(BF))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--rows", default="48,192,768,12288")
    ap.add_argument("--gemms", default="w13,w2")
    ap.add_argument("--sweep", action="store_true", help="also time the tile shapes of SWEEP "
                    "and every variant of the CUDA decode GEMM")
    ap.add_argument("--cuda-sweep", action="store_true",
                    help="every variant of the CUDA decode and wgmma GEMMs (not the Triton "
                    "tiles)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    commit, gpu = git_commit(), torch.cuda.get_device_name()
    rows, failed = [], False
    for R in (int(r) for r in args.rows.split(",")):
        for gemm in args.gemms.split(","):
            N, K = GEMMS[gemm]
            p = problem(R, N, K, dev)
            out = torch.empty(R, N, dtype=BF, device=dev)
            flops = 2 * R * N * K
            wbytes = E * N * K // 2 + E * (N // 16) * (K // 16)
            default = default_tiles(R, E)
            # (decode, tiles, A decoded once by dequantize_rows (timed with the GEMM) or not)
            variants = [("bf16", None, False), ("f16_asm", default, True),
                        ("f16_asm", default, False), ("f16", default, True),
                        ("dense", None, True), ("wdecode", None, False)]
            scratch = torch.empty(nvfp4_dense.scratch_numel([(E, N, K)]), dtype=torch.float16,
                                  device=dev)
            if args.sweep:
                variants += [("f16_asm", t, True) for t in (DECODE_SWEEP if R <= 64 * E else
                                                             LARGE_SWEEP) if t != default]
            cuda_default = nvfp4_decode.default_variant(R, E, K)
            # the decode GEMM: its default up to its MAX_ROWS_PER_EXPERT, swept up to 32
            if nvfp4_decode.loads(dev) and (cuda_default is not None or (
                    (args.sweep or args.cuda_sweep) and R <= 32 * E)):
                variants += [("cuda", v, True) for v in nvfp4_decode.variants()
                             if args.sweep or args.cuda_sweep or v == cuda_default]
            if nvfp4_decode.loads(dev):
                wg_default = nvfp4_wgmma.default_variant(R, E, K)
                variants += [("wgmma", v, True) for v in nvfp4_wgmma.variants()
                             if args.sweep or args.cuda_sweep or v == wg_default]
            a16 = torch.empty(R, K, dtype=torch.float16, device=dev)
            nrows = torch.tensor([R], dtype=torch.int32, device=dev)
            t_bf16 = None
            for decode, tiles, pre in variants:
                if decode == "bf16":
                    def fn(p=p, out=out):
                        grouped_mm_fwd(w=p["wd"], expert_offsets=p["offs"], max_rows=R,
                                       a=p["xd"], epilogue="store", out=out)
                    name, tol = "bf16 (ours, dequantized operands)", 2e-2
                elif decode == "wdecode":
                    G = nvfp4_dense.scratch_experts(N, K, E)

                    def fn(p=p, G=G, scratch=scratch):
                        for e0 in range(0, E, G):
                            nvfp4_dense.decode_weights(p["W"], e0, min(E, e0 + G), scratch)
                    name, tol = "weights decode alone", None
                else:
                    def fn(p=p, out=out, decode=decode, tiles=tiles, pre=pre, a16=a16,
                           nrows=nrows, K=K):
                        if pre:
                            dequantize_rows(p["a"], nrows, R, K, out=a16,
                                            order="fragment" if decode == "wgmma" else "k")
                        if decode == "dense":
                            nvfp4_dense.nvfp4_dense_mm(
                                a=p["a"], a16=a16, weight=p["W"], expert_offsets=p["offs"],
                                max_rows=R, epilogue="store", out=out, scratch=scratch)
                            return
                        if decode == "wgmma":
                            nvfp4_wgmma.nvfp4_wgmma_mm(
                                a=p["a"], a16=a16, weight=p["W"], expert_offsets=p["offs"],
                                max_rows=R, epilogue="store", out=out, variant=tiles)
                            return
                        if decode == "cuda":
                            nvfp4_decode.nvfp4_decode_mm(
                                a=p["a"], a16=a16, weight=p["W"], expert_offsets=p["offs"],
                                max_rows=R, epilogue="store", out=out, variant=tiles)
                            return
                        nvfp4_grouped_mm(a=p["a"], weight=p["W"], expert_offsets=p["offs"],
                                         max_rows=R, epilogue="store", out=out, tiles=tiles,
                                         decode=decode, a16=a16 if pre else None)
                    name = ("dense+A once (weights decoded per call)" if decode == "dense" else
                            f"cuda decode+A once/{tiles}" if decode == "cuda" else
                            f"cuda wgmma+A once/{tiles}" if decode == "wgmma" else
                            f"{decode}{'+A once' if pre else ''}/{tiles_name(tiles)}")
                    tol = 8e-3
                out.fill_(float("nan"))
                try:
                    fn()
                    torch.cuda.synchronize()
                except Exception as e:      # a sweep tile shape may not compile or fit
                    print(f"  R={R} {gemm} {name}: FAILED to run ({type(e).__name__}: "
                          f"{str(e)[:200]})", flush=True)
                    failed = failed or tiles == default or decode == "bf16"
                    continue
                err = 0.0 if tol is None else rel(out.float(), p["ref"])
                ok = tol is None or err < tol
                print(f"  check R={R} {gemm} {name}: " + (
                    "no output here (nvfp4 kernel checks: check_nvfp4_dense_mm)" if tol is None
                    else f"{err:.2e} {'OK' if ok else 'MISMATCH'}"), flush=True)
                if not ok:
                    failed = True
                    continue
                t = time_windows(fn, graph=True)
                us = t.median_ms * 1e3
                if decode == "bf16":
                    t_bf16 = t.median_ms
                rows.append(dict(
                    commit=commit, gpu=gpu, precision="bf16" if decode == "bf16" else "nvfp4",
                    kernel=gemm, variant=name, shape=f"{E}x{N}x{K}", rows=R,
                    ms=round(t.median_ms, 4), ms_min=round(t.min_ms, 4),
                    ms_max=round(t.max_ms, 4),
                    useful_tflops=round(flops / (t.median_ms * 1e-3) / 1e12, 1),
                    weight_gbps=round((2 * E * N * K if decode == "bf16" else wbytes)
                                      / (t.median_ms * 1e-3) / 1e9),
                    ratio_to_bf16="" if t_bf16 is None else round(t_bf16 / t.median_ms, 3),
                    note=("no output (the dense form's first pass)" if decode == "wdecode" else
                          "kernels/grouped_gemm/nvfp4_dense.py" if decode == "dense" else
                          "CUDA decode GEMM (csrc/nvfp4_decode_mm.cu)" if decode == "cuda" else
                          "CUDA wgmma GEMM (csrc/nvfp4_wgmma_mm.cu)" if decode == "wgmma" else
                          "the pipeline's form" if tiles == default and pre and
                          decode == "f16_asm" else "")))
                print(f"  R={R:<6} {gemm:<4} {name:<40} {us:9.1f} us "
                      f"{rows[-1]['useful_tflops']:7.1f} TFLOP/s {rows[-1]['weight_gbps']:6d} "
                      f"GB/s of weights  x{rows[-1]['ratio_to_bf16'] or 1:.2f} vs bf16", flush=True)
    os.makedirs(args.out, exist_ok=True)
    append_csv_fields(os.path.join(args.out, "bench_nvfp4_gemm.csv"), rows, FIELDS)
    plot(rows, os.path.join(args.out, "bench_nvfp4_gemm.png"))
    return 1 if failed else 0


def plot(rows, path):
    plt = pyplot()
    if plt is None or not rows:
        return
    keys = list(dict.fromkeys((r["rows"], r["kernel"]) for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 4.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rs = [r for r in rows if (r["rows"], r["kernel"]) == key]
        ax.barh([r["variant"] for r in rs], [r["ms"] * 1e3 for r in rs],
                color=["tab:gray" if r["precision"] == "bf16" else "tab:blue" for r in rs])
        ax.set_title(f"R={key[0]} {key[1]}")
        ax.set_xlabel("µs")
        ax.tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


if __name__ == "__main__":
    sys.exit(main())

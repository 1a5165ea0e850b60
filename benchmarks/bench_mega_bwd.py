"""The Mega backward's two launches against the standard backward's four, at the guide's load.

    python benchmarks/bench_mega_bwd.py --out OUTDIR [--rows 2048] [--lags 0,1,6]

Per direction of the backward (one GPU, E_local=6 experts of D=7168, F=3072, `--rows` rows
each, bf16, score gradients on the expert side as Config's default):

    standard   W2: grouped_mm_dgrad (SwiGLU backward, score parts) + grouped_mm_wgrad
               W13: grouped_mm_dgrad (scatter) + grouped_mm_wgrad
    mega lag=L one launch of DGRAD and WGRAD work records (mega_bwd.py) whose list puts expert
               e's WGRAD range after expert (e + L)'s DGRAD range (L >= E: every DGRAD first)

Correctness first: every Mega variant's grad_h1, h2, score parts, scattered grad_x and weight
gradients equal the standard launches' bit for bit (exit 1 otherwise). Each timed call restores
h1 (the W2 DGRAD writes grad_h1 over it); the restore is timed alone and subtracted. CSV rows
(commit, GPU, precision, shape, ms, useful TFLOP/s, ratio to standard) and a bar plot.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import append_csv, git_commit, plot_rows, time_windows  # noqa: E402

D, F, E = 7168, 3072, 6


def make_problem(rows: int, dev):
    from megatron_dist_moe.kernels.grouped_gemm.mega import MegaFlags
    g = torch.Generator().manual_seed(7)
    R = E * rows
    bf = torch.bfloat16
    p = dict(R=R, offs=torch.arange(0, R + 1, rows, dtype=torch.int32, device=dev))
    p["w13"] = (torch.randn(E, 2 * F, D, generator=g) / D ** 0.5).to(bf).to(dev)
    p["w2"] = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(bf).to(dev)
    p["x_g"] = torch.randn(R, D, generator=g).to(bf).to(dev)
    p["g3"] = torch.randn(R, D, generator=g).to(bf).to(dev)
    p["h1_0"] = (torch.randn(R, 2 * F, generator=g) * 2).to(bf).to(dev)
    # each route's score with room for its score-gradient parts after it
    parts = -(-F // 128)
    p["sbuf"] = torch.zeros(R, 1 + parts, dtype=torch.float32, device=dev)
    p["sbuf"][:, 0] = (torch.rand(R, generator=g) + 0.5).to(dev)
    p["score_ptrs"] = p["sbuf"].data_ptr() + torch.arange(R, device=dev) * p["sbuf"].stride(0) * 4
    p["dx"] = torch.empty(R, D, dtype=bf, device=dev)
    perm = torch.randperm(R, generator=g).to(dev)
    p["x_ptrs"] = p["dx"].data_ptr() + perm.long() * D * 2
    p["flags"] = MegaFlags(R, E, dev)
    return p


def run_standard(p, bufs, which):
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_dgrad, grouped_mm_wgrad
    h1, h2, o13, o2 = bufs
    if which == "w2":
        grouped_mm_dgrad(w=p["w2"], expert_offsets=p["offs"], max_rows=p["R"], a=p["g3"],
                         epilogue="swiglu_bwd", h1=h1, h2=h2, score_ptrs=p["score_ptrs"],
                         score_grad_delta=4, part_stride=4)
        grouped_mm_wgrad(p["g3"], h2, p["offs"], o2, dtype=torch.bfloat16)
    else:
        grouped_mm_dgrad(w=p["w13"], expert_offsets=p["offs"], max_rows=p["R"], a=h1,
                         epilogue="scatter", out_row_ptrs=p["x_ptrs"])
        grouped_mm_wgrad(h1, p["x_g"], p["offs"], o13, dtype=torch.bfloat16)


def run_mega(p, bufs, which, lag):
    from megatron_dist_moe.kernels.grouped_gemm.mega_bwd import mega_bwd_w2, mega_bwd_w13
    h1, h2, o13, o2 = bufs
    if which == "w2":
        mega_bwd_w2(g3=p["g3"], w2=p["w2"], h1=h1, h2=h2, expert_offsets=p["offs"],
                    max_rows=p["R"], grad_w2=o2, flags=p["flags"], score_ptrs=p["score_ptrs"],
                    score_grad_delta=4, part_stride=4, lag=lag)
    else:
        mega_bwd_w13(grad_h1=h1, w13=p["w13"], x_g=p["x_g"], expert_offsets=p["offs"],
                     max_rows=p["R"], grad_x_row_ptrs=p["x_ptrs"], grad_w13=o13,
                     flags=p["flags"], lag=lag)


def new_bufs(p):
    bf = torch.bfloat16
    return (p["h1_0"].clone(), torch.empty(p["R"], F, dtype=bf, device=p["h1_0"].device),
            torch.empty(E, 2 * F, D, dtype=bf, device=p["h1_0"].device),
            torch.empty(E, D, F, dtype=bf, device=p["h1_0"].device))


def outputs(p, bufs):
    h1, h2, o13, o2 = bufs
    return [h1, h2, o13, o2, p["sbuf"].clone(), p["dx"].clone()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--rows", type=int, default=2048, help="rows per expert")
    ap.add_argument("--lags", default="0,1,6")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    p = make_problem(args.rows, dev)
    lags = [int(v) for v in args.lags.split(",")]
    # correctness: both directions in order (the W13 launch reads the W2 launch's grad_h1)
    ref = new_bufs(p)
    run_standard(p, ref, "w2")
    run_standard(p, ref, "w13")
    want = outputs(p, ref)
    for lag in lags:
        b = new_bufs(p)
        p["sbuf"][:, 1:].zero_()
        p["dx"].zero_()
        run_mega(p, b, "w2", lag)
        run_mega(p, b, "w13", lag)
        got = outputs(p, b)
        names = ["grad_h1", "h2", "grad_w13", "grad_w2", "score parts", "grad_x"]
        for n, g_, w_ in zip(names, got, want):
            if not torch.equal(g_, w_):
                print(f"FAIL lag={lag}: {n} differs from the standard launches")
                return 1
        print(f"check lag={lag}: every output equals the standard launches' bits")
    assert int(p["flags"].status[0]) == 0, "a wait gave up"

    bufs = new_bufs(p)
    h1 = bufs[0]
    restore = time_windows(lambda: h1.copy_(p["h1_0"]), graph=True).median_ms
    flops = {"w2": 2 * 2 * p["R"] * D * F, "w13": 2 * 2 * p["R"] * D * 2 * F}
    rows, commit = [], git_commit()
    gpu = torch.cuda.get_device_name()
    for which in ("w2", "w13"):
        paths = [("standard", lambda: run_standard(p, bufs, which))]
        paths += [(f"mega_lag{lag}", (lambda lag=lag: run_mega(p, bufs, which, lag)))
                  for lag in lags]
        base = None
        for name, fn in paths:
            t = time_windows(lambda fn=fn: (h1.copy_(p["h1_0"]), fn()), graph=True)
            ms = t.median_ms - restore
            base = base or ms
            rows.append(dict(commit=commit, gpu=gpu, ep=1, case=f"guide_{which}", T=p["R"] // 6,
                             D=D, F=F, K=6, E_local=E, imbalance=1.0, precision="bf16",
                             path=name, mode="bwd", ms=round(ms, 4),
                             ms_min=round(t.min_ms - restore, 4),
                             ms_max=round(t.max_ms - restore, 4),
                             useful_tflops=round(flops[which] / (ms * 1e-3) / 1e12, 1),
                             ratio_to_baseline=round(base / ms, 4),
                             note=f"{which} DGRAD + WGRAD; h1 restore {restore:.3f} ms "
                                  "subtracted"))
            print(f"{which:4s} {name:12s} {ms:8.3f} ms  {rows[-1]['useful_tflops']:7.1f} TFLOP/s"
                  f"  standard/this {base / ms:.3f}")
    append_csv(os.path.join(args.out, "bench_mega_bwd.csv"), rows)
    plot_rows(rows, os.path.join(args.out, "bench_mega_bwd.png"),
              "Mega backward vs standard launches, one H200")
    return 0


if __name__ == "__main__":
    sys.exit(main())

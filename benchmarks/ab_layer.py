"""Interleaved A/B timing of the CUDA backend: two settings, one process, alternating windows.

    torchrun --nproc-per-node=2 benchmarks/ab_layer.py --b-config "save_route_outputs=1" \\
        [--a "gemm_engine=torch"] [--case guide] [--pipeline standard] [--modes fwd,fwdbwd] \\
        [--rounds 16] --out OUT

Separate benchmark runs of the same binary drift by about ±0.2 ms at the guide load (three
runs within 20 minutes measured 9.08, 9.28, 9.29 ms fwd+bwd), which hides levers worth 0.1-0.2 ms.
Here both settings live in one process: context A is created (and its CUDA graph captured) with
A's Config changes and execution overrides, context B with B's, then windows of 30 graph replays
alternate A B B A A B ... so clock and thermal drift fall on both alike. Reported per mode: the median
window of each (max over ranks, as the guide's method), and the median of the per-round paired
differences B - A with its interquartile range; B is called faster (or slower) only when the
whole interquartile range lies below (above) zero.

A setting is Config field changes (--a-config / --b-config, e.g. "pipeline=staged") and
execution overrides (--a / --b, execution.OVERRIDES, e.g. "gemm_engine=torch"), both given to
create_context. Correctness first:
A's and B's outputs and input gradients are compared with baseline (a) (all-to-all +
torch._grouped_mm) before any timing; a mismatch exits 1. Writes OUT/ab_layer.csv (the common
benchmark columns, ratio = A ms / B ms) and OUT/ab_layer.png (paired differences per round).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import megatron_dist_moe as dm  # noqa: E402
from megatron_dist_moe.execution import parse_overrides  # noqa: E402
from baselines import a2a_grouped_mm_experts  # noqa: E402
from bench_layer import (  # noqa: E402
    CASES,
    FP8_CHECK,
    check_against_reference,
    dist_moe_fns,
    layer_config,
    make_layer_inputs,
    useful_flops,
)
from common import ITERS, WARMUP, append_csv, capture_graph, git_commit  # noqa: E402
from common import parse_config_overrides as parse_config  # noqa: E402
from plotting import pyplot  # noqa: E402


def round_order(rounds: int) -> list[str]:
    """A B, B A, A B, ...: each setting goes first in half of the rounds."""
    return [s for r in range(rounds) for s in (("A", "B") if r % 2 == 0 else ("B", "A"))]


def paired_summary(a_ms: list[float], b_ms: list[float]) -> dict:
    """Medians of A and B, and the median and interquartile range of the paired B - A."""
    if len(a_ms) != len(b_ms) or len(a_ms) < 4:
        raise ValueError(f"need >= 4 paired rounds, got {len(a_ms)} and {len(b_ms)}")
    d = sorted(b - a for a, b in zip(a_ms, b_ms))
    q1, _, q3 = statistics.quantiles(d, n=4)
    verdict = "B faster" if q3 < 0 else "B slower" if q1 > 0 else "no difference"
    return dict(a_ms=statistics.median(a_ms), b_ms=statistics.median(b_ms),
                diff_ms=statistics.median(d), diff_q1=q1, diff_q3=q3, verdict=verdict)


def _window(g: torch.cuda.CUDAGraph, iters: int) -> float:
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    b.synchronize()
    t = torch.tensor([a.elapsed_time(b) / iters], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def plot(results: dict, path: str, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (mode, (a_ms, b_ms, s)) in zip(axes[0], results.items()):
        ax.plot([b - a for a, b in zip(a_ms, b_ms)], "o-")
        ax.axhline(0, color="k", lw=0.8)
        ax.axhspan(s["diff_q1"], s["diff_q3"], alpha=0.2)
        ax.set_title(f"{mode}: B - A = {s['diff_ms']:+.3f} ms ({s['verdict']})", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("ms")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", default="", help="execution overrides of A (default: none)")
    ap.add_argument("--b", default="", help='execution overrides of B, e.g. "gemm_engine=torch"')
    ap.add_argument("--a-config", default="", help='Config overrides of A, e.g. "save_route_outputs=1"')
    ap.add_argument("--b-config", default="", help="Config overrides of B")
    ap.add_argument("--case", default="guide", choices=sorted(CASES))
    ap.add_argument("--pipeline", default="standard", choices=["standard", "staged"])
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    exe = {"A": parse_overrides(args.a, "--a"), "B": parse_overrides(args.b, "--b")}
    over = {"A": parse_config(args.a_config), "B": parse_config(args.b_config)}
    rank = int(os.environ.get("RANK", 0))
    EP = int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    c = CASES[args.case]
    T, D, F, K, E_local = c["T"], c["D"], c["F"], c["K"], c["E_local"]
    inp = make_layer_inputs(c, rank, EP, dev)    # the same inputs and scratch as bench_layer
    x, ids, s, w13, w2, gy = (inp[k] for k in ("x", "ids", "s", "w13", "w2", "gy"))
    factor = inp["scratch_factor"]
    y = a2a_grouped_mm_experts(x, ids, s, w13, w2)
    ref_gx, = torch.autograd.grad(y, (x,), gy)
    ref_y = y.detach()
    del y
    cfg = layer_config(c, EP, factor, args.pipeline)
    graphs, ctxs = {}, []
    for name in ("A", "B"):
        ctx = dm.create_context(config=cfg.replace(**over[name]), device=dev,
                                execution_overrides=exe[name])
        ctxs.append(ctx)
        y = dm.routed_experts(x, ids, s, w13, w2, ctx)
        gx, = torch.autograd.grad(y, (x,), gy)
        quant = ctx.config.precision != "bf16"    # block-scaled: bench_layer's FP8 band
        if not check_against_reference(f"{name} ({args.a if name == 'A' else args.b} "
                                       f"{args.pipeline})".replace("( ", "("),
                                       y.detach(), gx, ref_y, ref_gx, rank,
                                       FP8_CHECK if quant else (0.0, 2e-2)):
            sys.exit(1)
        del y, gx
        fwd, fwdbwd = dist_moe_fns(ctx, inp)
        for mode in args.modes.split(","):
            g = capture_graph(fwd if mode == "fwd" else fwdbwd)
            for _ in range(WARMUP):
                g.replay()
            graphs[(name, mode)] = g
    torch.cuda.synchronize()
    results, rows = {}, []
    commit, gpu = git_commit(), torch.cuda.get_device_name()
    for mode in args.modes.split(","):
        times = {"A": [], "B": []}
        for name in round_order(args.rounds):
            times[name].append(_window(graphs[(name, mode)], ITERS))
        summ = paired_summary(times["A"], times["B"])
        results[mode] = (times["A"], times["B"], summ)
        flops = useful_flops(T, K, D, F, mode)
        for name, sw in (("A", f"{args.a} {args.a_config}".strip()),
                         ("B", f"{args.b} {args.b_config}".strip())):
            ms = summ[f"{name.lower()}_ms"]
            rows.append(dict(commit=commit, gpu=gpu, ep=EP, case=args.case,
                             precision=ctxs["AB".index(name)].config.precision,
                             T=T, D=D, F=F, K=K,
                             E_local=E_local, imbalance=c["imbalance"],
                             path=f"dist_moe_{args.pipeline}[{name}]", mode=mode,
                             ms=round(ms, 4), ms_min=round(min(times[name]), 4),
                             ms_max=round(max(times[name]), 4),
                             useful_tflops=round(flops / (ms * 1e-3) / 1e12, 1),
                             ratio_to_baseline=round(summ["a_ms"] / ms, 4),
                             note=f"setting: {sw or 'defaults'}; B-A median "
                                  f"{summ['diff_ms']:+.4f} ms IQR [{summ['diff_q1']:+.4f}, "
                                  f"{summ['diff_q3']:+.4f}] over {args.rounds} rounds: "
                                  f"{summ['verdict']}"))
        if rank == 0:
            print(f"{args.case} {args.pipeline} {mode}: A {summ['a_ms']:.3f} ms  B "
                  f"{summ['b_ms']:.3f} ms  B-A {summ['diff_ms']:+.3f} ms "
                  f"[IQR {summ['diff_q1']:+.3f}, {summ['diff_q3']:+.3f}]  {summ['verdict']}",
                  flush=True)
    graphs.clear()
    for ctx in ctxs:
        ctx.close()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        append_csv(os.path.join(args.out, "ab_layer.csv"), rows)
        plot(results, os.path.join(args.out, "ab_layer.png"),
             f"{args.case} {args.pipeline}: A = {args.a or 'defaults'}, B = {args.b} ({commit})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The Mega forward kernel against the standard pipeline's two launches (W13 + SwiGLU, W2 +
scatter) on the same gathered rows, at the guide shape: kernel times alone (CUDA events,
alternating rounds), or a few launches of each for a profiler to look at:

    python3 scripts/device/mega_once.py --rounds 5
    ncu --clock-control none -k regex:"mega_fwd|grouped_mm" --launch-skip 6 \
        --launch-count 3 --section SpeedOfLight --section WarpStateStats \
        python3 scripts/device/mega_once.py --rounds 0

Rows are split evenly over the experts (the guide load at EP=1: 2,048 per expert); y's rows land
at a random permutation of an output buffer, as the combine rows do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_fwd  # noqa: E402
from megatron_dist_moe.kernels.grouped_gemm.mega import (  # noqa: E402
    MegaFlags, mega_config, mega_fwd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--experts", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=3072)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (0: three launches "
                    "of each, for a profiler)")
    ap.add_argument("--iters", type=int, default=20, help="launches per timed window")
    ap.add_argument("--no-h1", action="store_true", help="store no h1 (an inference forward)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    E, R, D, F = args.experts, args.rows, args.hidden, args.ffn
    g = torch.Generator(device="cpu").manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(R, D, generator=g).to(bf).to(dev)
    w13 = (torch.randn(E, 2 * F, D, generator=g) / D ** 0.5).to(bf).to(dev)
    w2 = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(bf).to(dev)
    lens = [R // E + (e < R % E) for e in range(E)]
    offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=dev)
    h1 = None if args.no_h1 else torch.empty(R, 2 * F, dtype=bf, device=dev)
    h2 = torch.empty(R, F, dtype=bf, device=dev)
    out = torch.empty(R, D, dtype=bf, device=dev)
    perm = torch.randperm(R, generator=g).to(dev)
    ptrs = out.data_ptr() + perm.long() * D * 2
    cfg = mega_config(2 * F, D, dev, R, E)
    flags = MegaFlags(R, E, dev)

    def mega():
        mega_fwd(xg=x, w13=w13, w2=w2, expert_offsets=offs, max_rows=R, h2=h2, h1=h1,
                 out_row_ptrs=ptrs, flags=flags)

    def standard():
        grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=R, a=x, epilogue="swiglu", h1=h1,
                       h2=h2, config=cfg)
        grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=R, a=h2, epilogue="scatter",
                       out_row_ptrs=ptrs, config=cfg)

    # the same rows from both (tests/mega_kernel_checks.py's bound)
    standard()
    ref = out.float()
    mega()
    torch.cuda.synchronize()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= 8e-3, f"the Mega kernel's rows differ from the two launches': {err:.2e}"
    print(f"y: Mega vs the two launches {err:.2e} (relative)", flush=True)
    fns = {"mega": mega, "standard": standard}
    if args.rounds == 0:
        for _ in range(3):
            for f in fns.values():
                f()
        torch.cuda.synchronize()
        return
    flops = 6 * R * D * F   # W13 (2F outputs) and W2, 2 FLOPs per multiply-add
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(args.rounds):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for name in order:
            f = fns[name]
            for _ in range(3):
                f()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(args.iters):
                f()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b) / args.iters)
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:9s} median {med:.3f} ms ({flops / med / 1e9:.0f} TFLOP/s); rounds "
              + " ".join(f"{t:.3f}" for t in ts), flush=True)
    diff = statistics.median(times["mega"]) - statistics.median(times["standard"])
    print(f"mega - standard: {diff:+.3f} ms (h1 {'not ' if args.no_h1 else ''}stored)")


if __name__ == "__main__":
    main()

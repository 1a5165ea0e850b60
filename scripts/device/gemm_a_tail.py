"""The decode-tile FPROPs (W13 + SwiGLU, then W2) at 1 / 8 / 32 rows per expert at the guide's
expert shapes, with A's TMA descriptor over R rows (a tile's box past R takes TMA's
out-of-bounds path) or over R + 128 readable rows (`a_tail_rows=128`, what an inference call's
layout provides). The tail rows hold NaN, so a tail row that reached a stored row would show.
Prints µs per W13 + W2 pair (CUDA graph of 10 pairs, 5 replays) and whether y is bitwise the
same both ways:

    python3 scripts/device/gemm_a_tail.py [--rows-per-expert 1,8,32]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from megatron_dist_moe.kernels.common import device_ptr  # noqa: E402
from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_fwd  # noqa: E402
from megatron_dist_moe.kernels.grouped_gemm.config import select_config  # noqa: E402

E, D, F, TAIL = 6, 7168, 3072, 128


def time_pairs(step) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            step()
    g.replay()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1000 / 50


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows-per-expert", default="1,8,32")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * F, D, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16) * 0.02
    for rpe in (int(v) for v in args.rows_per_expert.split(",")):
        R = E * rpe
        offs = torch.arange(0, R + 1, rpe, dtype=torch.int32, device=dev)
        x = torch.randn(R + TAIL, D, device=dev, dtype=torch.bfloat16)
        x[R:] = float("nan")
        h2 = torch.full((R + TAIL, F), float("nan"), device=dev, dtype=torch.bfloat16)
        y = torch.zeros(R, D, device=dev, dtype=torch.bfloat16)
        xp, h2p, yp = device_ptr(x), device_ptr(h2), device_ptr(y)
        c13 = select_config("fwd", n=2 * F, kd=D, device=dev, rows_per_expert=rpe)
        c2 = select_config("fwd", n=D, kd=F, device=dev, rows_per_expert=rpe)
        ys = {}
        for tail in (0, TAIL, 0, TAIL):
            def step():
                grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=R, a=xp, epilogue="swiglu",
                               h2=h2p, config=c13, a_tail_rows=tail)
                grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=R, a=h2p, epilogue="store",
                               out=yp, config=c2, a_tail_rows=tail)
            us = time_pairs(step)
            ys.setdefault(tail, y.clone())
            same = torch.equal(ys[0], y) if 0 in ys else True
            print(f"rows/expert {rpe:3d} a_tail_rows {tail:3d}: W13 + W2 {us:7.1f} us "
                  f"(y bitwise as a_tail_rows=0: {same})", flush=True)


if __name__ == "__main__":
    main()

"""Run fp8_block's CUTLASS W13 WGRAD or W13 FPROP unit a few times at the guide shape, for a
profiler (ncu, nsys) to look at one launch:

    ncu --clock-control none -k device_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight \
        python3 scripts/device/fp8_gemm_once.py --gemm wgrad

Why: at 2048 tokens per expert the W13 WGRAD runs at ~830 TFLOP/s where the W13 FPROP on the
same tile and mainloop runs at ~1,080 (one H100); the profile says which resource the WGRAD
waits on. Inputs are random bundles of the layer's shapes (E=6, 2048 rows per expert, D=7168,
2F=6144); nothing is checked here (bench_fp8_gemm.py and the GPU tests check both units).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from megatron_dist_moe.kernels import grouped_gemm_sm90 as sm90  # noqa: E402
from megatron_dist_moe.layout import padded_rows  # noqa: E402
from megatron_dist_moe.quant import fp8_block as Q  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gemm", default="wgrad", choices=("wgrad", "fprop"))
    ap.add_argument("--rows-per-expert", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=4)
    args = ap.parse_args()
    E, n, D, F2 = 6, args.rows_per_expert, 7168, 6144
    R, dev = E * n, torch.device("cuda")
    offs = torch.arange(0, R + 1, n, dtype=torch.int32, device=dev)
    x = torch.randn(R, D, device=dev).to(torch.bfloat16)
    if args.gemm == "wgrad":
        gh1 = (torch.randn(R, F2, device=dev) * 0.1).to(torch.bfloat16)
        Rp = padded_rows(R, E)
        a = Q.quantize_cols(gh1, offs.long(), Rp)
        b = Q.quantize_cols(x, offs.long(), Rp)
        out = torch.empty(E, F2, D, dtype=torch.bfloat16, device=dev)
        gemm = sm90.GroupedFp8WgradSm90(E, dev)
        for _ in range(args.iters):
            gemm(a, b, offs, out)
    else:
        w13 = (torch.randn(E, F2, D, device=dev) * D ** -0.5).to(torch.bfloat16)
        W = Q.prepare_weights(w13, (torch.randn(E, D, F2 // 2, device=dev)).to(torch.bfloat16))
        xq = Q.quantize_rows(x)
        out = torch.empty(R, F2, dtype=torch.bfloat16, device=dev)
        gemm = sm90.GroupedFp8FpropSm90(E, dev)
        for _ in range(args.iters):
            gemm(xq, W.w13, W.w13_s, offs, out)
    torch.cuda.synchronize()
    print(f"{args.gemm}: {args.iters} launches of {gemm.config!r} done")


if __name__ == "__main__":
    main()

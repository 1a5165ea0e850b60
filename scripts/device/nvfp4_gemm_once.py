"""Run one NVFP4 grouped GEMM of the CUDA engine a few times at a guide shape, for a profiler
(ncu, nsys) to look at one launch:

    ncu -k regex:nvfp4_wgmma --launch-skip 2 --launch-count 1 --section WarpStateStats \
        python3 scripts/device/nvfp4_gemm_once.py --rows 12288 --gemm w13 --variant 5012824

The variant picks the GEMM (nvfp4_wgmma.run): a decode GEMM's code (nvfp4_decode.variants(), the
regime of up to 32 rows per expert; ncu -k regex:nvfp4_decode) or the wgmma GEMM's; by default
the CUDA engine's choice for the rows (nvfp4_wgmma.cuda_variant).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from megatron_dist_moe.kernels.grouped_gemm import nvfp4_wgmma  # noqa: E402
from megatron_dist_moe.kernels.quant_nvfp4 import dequantize_rows  # noqa: E402
from megatron_dist_moe.prepared import PreparedWeight  # noqa: E402
from megatron_dist_moe.quant import nvfp4 as NV  # noqa: E402

GEMMS = {"w13": (6144, 7168), "w2": (7168, 3072)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--gemm", default="w13", choices=sorted(GEMMS))
    ap.add_argument("--experts", type=int, default=6)
    ap.add_argument("--variant", type=int, default=None)
    ap.add_argument("--iters", type=int, default=4)
    args = ap.parse_args()
    (N, K), E, R, dev = GEMMS[args.gemm], args.experts, args.rows, torch.device("cuda")
    lens = [R // E + (e < R % E) for e in range(E)]
    offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=dev)
    W = PreparedWeight(*NV.quantize_weight(torch.randn(E, N, K, device=dev) / K ** 0.5),
                       (E, N, K))
    a = NV.quantize_row_bytes(torch.randn(R, K, device=dev).to(torch.bfloat16))
    variant = args.variant or nvfp4_wgmma.cuda_variant(R, E, K)
    a16 = torch.empty(R, K, dtype=torch.float16, device=dev)
    dequantize_rows(a, offs[-1:], R, K, out=a16, order=nvfp4_wgmma.a16_order(variant))
    out = torch.empty(R, N, dtype=torch.bfloat16, device=dev)
    for _ in range(args.iters):
        nvfp4_wgmma.run(variant, a=a, a16=a16, weight=W, expert_offsets=offs, max_rows=R,
                        out=out)
    torch.cuda.synchronize()
    print(f"{args.gemm} R={R} {nvfp4_wgmma.cuda_describe(variant)}: ran {args.iters} times")


if __name__ == "__main__":
    main()

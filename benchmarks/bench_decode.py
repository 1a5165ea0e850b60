"""Decode-regime benchmark: the routed-expert forward at small T, next to its weight-read floor.

    torchrun --nproc-per-node=1 benchmarks/bench_decode.py --out OUTDIR
             [--tokens 1,8,32,128,512,2048] [--precisions bf16,fp8_block,mxfp8,nvfp4]
             [--pipelines standard,mega] [--no-a2a]

At small batch an MoE layer is bound by reading its experts' weights, not by arithmetic: at the
guide's expert shapes (D=7168, F=3072, 6 experts per GPU) one GPU's experts hold 793 MB of bf16
weights, a ~200 µs floor at ~4 TB/s. Per T (tokens per GPU, K=6 routes each) and precision:

    dist_moe   ours on an inference context (Config.inference=True), forward in a CUDA graph
               (dist_moe_mega: the Mega pipeline, --pipelines; each precision's path name
               carries its precision, e.g. dist_moe_nvfp4)
    a2a        baseline (a): NCCL all-to-all + torch._grouped_mm experts (eager: host syncs)
    floor      the bytes of the weights in the form the precision's GEMMs read, over the HBM
               read bandwidth measured in the same run (a sum over a 2 GiB buffer):
               bf16 2 bytes per weight; fp8_block 1 (+ scales); mxfp8 2 (its GEMMs read bf16
               copies of the MXFP8 values); nvfp4 0.5 (+ scales)

Correctness first: every precision's y against baseline (a)'s (bf16 within 2e-2, the
block-scaled ones within bench_layer's FP8_CHECK band; a mismatch exits 1 before timing). The
block-scaled training precisions prepare their weights inside every forward
(backends/cuda/experts/), which the note of their rows says with the share it takes; nvfp4
reads weights prepared once (dm.prepare_expert_weights), judged within NVFP4_CHECK. CSV rows (commit, GPU, precision,
T, ms, useful TFLOP/s, ratio to baseline (a), fraction of the floor) and a plot of ms against T.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import megatron_dist_moe as dm  # noqa: E402
from common import append_csv, git_commit, profile_graph, time_windows  # noqa: E402

GUIDE = dict(D=7168, F=3072, K=6, E_local=6)
FP8_CHECK = (1e-2, 0.15)     # bench_layer's band for the block-scaled paths vs bf16
NVFP4_CHECK = (0.05, 0.3)    # 4-bit activations and weights against bf16: ~15-17 % norm-wise
PRECISION_PATHS = {"bf16": "dist_moe", "fp8_block": "dist_moe_fp8", "mxfp8": "dist_moe_mxfp8",
                   "nvfp4": "dist_moe_nvfp4"}


def weight_read_bytes(precision: str, E: int, D: int, F: int) -> int:
    """Bytes of one GPU's expert weights (W13 [E, 2F, D] and W2 [E, D, F]) in the form the
    precision's GEMMs read them."""
    n = E * 3 * F * D
    if precision in ("bf16", "mxfp8"):
        return 2 * n
    if precision == "fp8_block":
        return n + 4 * n // (128 * 128)          # E4M3 values, one fp32 scale per 128 x 128 tile
    if precision == "nvfp4":
        return n // 2 + n // 256 + 4 * 2 * E     # E2M1 values, E4M3 per 16 x 16 tile, 2 globals
    raise ValueError(f"unknown precision {precision!r}")


def floor_us(precision: str, E: int, D: int, F: int, hbm_gbps: float) -> float:
    """The weight-read floor in µs at hbm_gbps GB/s."""
    return weight_read_bytes(precision, E, D, F) / (hbm_gbps * 1e9) * 1e6


def hbm_read_gbps(device, nbytes: int = 2 << 30) -> tuple[float, float]:
    """HBM rates (median of graph-replayed windows): (read, copy). read: a sum over an nbytes
    buffer (bytes read per second; the rate a stream of weight reads approaches, used for the
    floor); copy: a device copy of it (bytes read + written per second)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t_read = time_windows(lambda: src.sum(dtype=torch.float32), graph=True)
    t_copy = time_windows(lambda: dst.copy_(src), graph=True)
    return (nbytes / (t_read.median_ms * 1e-3) / 1e9,
            2 * nbytes / (t_copy.median_ms * 1e-3) / 1e9)


def make_inputs(T: int, c: dict, rank: int, EP: int, dev) -> dict:
    from bench_layer import make_routing
    gen = torch.Generator().manual_seed(4321 + rank + 97 * T)
    ids, s = make_routing(T, c["K"], c["E_local"], EP, 1.0, gen, dev)
    D, F, E = c["D"], c["F"], c["E_local"]
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16).to(dev)
    w13 = (torch.randn(E, 2 * F, D, generator=gen) / D ** 0.5).to(torch.bfloat16).to(dev)
    w2 = (torch.randn(E, D, F, generator=gen) / F ** 0.5).to(torch.bfloat16).to(dev)
    return dict(x=x, ids=ids, s=s.float(), w13=w13, w2=w2)


def rel(a, b) -> float:
    e = torch.tensor([(a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)],
                     device=b.device)
    if dist.is_initialized():
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
    return float(e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--tokens", default="1,8,32,128,512,2048")
    ap.add_argument("--precisions", default="bf16,fp8_block,mxfp8,nvfp4")
    ap.add_argument("--pipelines", default="standard,mega",
                    help="each (precision, pipeline) the CUDA backend runs (execution.RUNS)")
    ap.add_argument("--no-a2a", action="store_true", help="skip baseline (a)")
    ap.add_argument("--profile-tokens", default="",
                    help="T values whose graphs are also profiled per kernel (OUT/profile_*.txt)")
    args = ap.parse_args()
    rank, EP = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    from baselines import a2a_grouped_mm_experts
    from megatron_dist_moe.execution import runs
    c = dict(GUIDE)
    D, F, K, E = c["D"], c["F"], c["K"], c["E_local"]
    commit, gpu = git_commit(), torch.cuda.get_device_name()
    gbps, copy_gbps = hbm_read_gbps(dev)
    if rank == 0:
        print(f"HBM read bandwidth (a sum over 2 GiB): {gbps:.0f} GB/s; device copy (read + "
              f"write): {copy_gbps:.0f} GB/s", flush=True)
        for p in args.precisions.split(","):
            print(f"  floor {p}: {weight_read_bytes(p, E, D, F) / 1e6:.0f} MB of weights -> "
                  f"{floor_us(p, E, D, F, gbps):.1f} us", flush=True)
    rows, failed = [], False
    for T in (int(t) for t in args.tokens.split(",")):
        inp = make_inputs(T, c, rank, EP, dev)
        ref = a2a_grouped_mm_experts(inp["x"], inp["ids"], inp["s"], inp["w13"], inp["w2"])
        base_ms = None
        if not args.no_a2a:
            tb = time_windows(lambda: a2a_grouped_mm_experts(inp["x"], inp["ids"], inp["s"],
                                                             inp["w13"], inp["w2"]),
                              graph=False)
            base_ms = tb.median_ms
            rows.append(row(commit, gpu, EP, T, c, "bf16", "a2a", tb, base_ms,
                            floor_us("bf16", E, D, F, gbps), "baseline (a), eager"))
        for precision, pipeline in ((p, q) for p in args.precisions.split(",")
                                    for q in args.pipelines.split(",")):
            if not runs("cuda", precision, pipeline):
                if rank == 0 and T == int(args.tokens.split(",")[0]):
                    print(f"  {precision} / {pipeline}: the CUDA backend does not run it; "
                          "skipped")
                continue
            # nvfp4: the default engine, and the Triton GEMMs beside it (same run) where the
            # default is the CUDA GEMMs
            decode_gemm = False
            for engine in (("", "triton") if precision == "nvfp4" else ("",)):
                if engine and not decode_gemm:   # the default ran Triton's GEMMs already
                    continue
                path = (PRECISION_PATHS[precision] + ("" if pipeline == "standard" else
                                                       f"_{pipeline}") + (f"_{engine}" if engine
                                                                          else ""))
                cfg = dm.Config(num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F,
                                top_k=K, num_experts=E * EP, backend="cuda", inference=True,
                                pipeline=pipeline,
                                num_activation_slots=0, precision=precision,
                                device_scratch_capacity_factor=float(EP))
                w13, w2 = inp["w13"], inp["w2"]
                if precision == "nvfp4":       # prepared once, outside the timed call
                    prepared = dm.prepare_expert_weights(w13, w2, precision="nvfp4")
                    w13, w2 = prepared.w13, prepared.w2
                overrides = {"nvfp4_gemm": engine} if engine else None
                with dm.create_context(config=cfg, device=dev,
                                       execution_overrides=overrides) as ctx:
                    variant = getattr(ctx.backend.experts, "cuda_variants", None)
                    decode_gemm = decode_gemm or variant is not None
                    with torch.no_grad():
                        y = dm.routed_experts(inp["x"], inp["ids"], inp["s"], w13, w2, ctx)
                    e = rel(y, ref)
                    lo, hi = ((0.0, 2e-2) if precision == "bf16" else
                              NVFP4_CHECK if precision == "nvfp4" else FP8_CHECK)
                    ok = lo <= e < hi
                    if rank == 0:
                        print(f"  check T={T} {path}: y vs a2a {e:.2e} "
                              f"{'OK' if ok else 'MISMATCH'}", flush=True)
                    if not ok:
                        failed = True
                        continue

                    def fwd(ctx=ctx, w13=w13, w2=w2):
                        with torch.no_grad():
                            dm.routed_experts(inp["x"], inp["ids"], inp["s"], w13, w2, ctx)
                    t = time_windows(fwd, graph=True)
                    note = "CUDA graph"
                    if precision == "nvfp4":
                        note += ("; GEMMs: weights decoded per call (nvfp4_dense)"
                                 if ctx.backend.experts.dense else
                                 "; GEMMs: CUDA W13 / W2 variants %d / %d" % variant
                                 if variant else "; GEMMs: Triton")
                    if str(T) in args.profile_tokens.split(","):
                        os.makedirs(args.out, exist_ok=True)
                        suffix = f"_rank{rank}" if EP > 1 else ""
                        profile_graph(fwd, os.path.join(
                            args.out, f"profile_decode_T{T}_{path}{suffix}.txt"),
                            iter_ms=t.median_ms)
                    if precision in ("fp8_block", "mxfp8"):
                        ex = ctx.backend.experts
                        prep = (lambda: ex.k.weights(inp["w13"], inp["w2"], False)) \
                            if precision == "fp8_block" else (
                            lambda: ex.mx.weights(inp["w13"], inp["w2"]))
                        tw = time_windows(prep, graph=True)
                        note += (f"; weight preparation {tw.median_ms * 1e3:.0f} us of it "
                                 f"(without: {(t.median_ms - tw.median_ms) * 1e3:.0f} us)")
                    rows.append(row(commit, gpu, EP, T, c, precision, path,
                                    t, base_ms, floor_us(precision, E, D, F, gbps), note))
    if rank == 0:
        for r in rows:
            print(f"  T={r['T']:<5} {r['precision']:<10} {r['path']:<15} {r['ms'] * 1e3:9.1f} us"
                  f"  floor {r['floor_us']:7.1f} us ({r['of_floor']})  {r['note']}", flush=True)
        os.makedirs(args.out, exist_ok=True)
        append_csv(os.path.join(args.out, "bench_decode.csv"), rows)
        plot(rows, os.path.join(args.out, "bench_decode.png"))
    dist.destroy_process_group()
    if failed:
        sys.exit(1)


def row(commit, gpu, EP, T, c, precision, path, t, base_ms, floor, note) -> dict:
    D, F, K = c["D"], c["F"], c["K"]
    tf = 6 * T * K * D * F / (t.median_ms * 1e-3) / 1e12
    return dict(commit=commit, gpu=gpu, ep=EP, case=f"decode_T{T}", T=T, D=D, F=F, K=K,
                E_local=c["E_local"], imbalance=1.0, precision=precision, path=path,
                mode="fwd", ms=round(t.median_ms, 4), ms_min=round(t.min_ms, 4),
                ms_max=round(t.max_ms, 4), useful_tflops=round(tf, 2),
                ratio_to_baseline="" if base_ms is None else round(base_ms / t.median_ms, 3),
                note=f"floor {floor:.1f} us; {note}", floor_us=round(floor, 1),
                of_floor=f"{floor / (t.median_ms * 1e3):.0%} of the floor")


def plot(rows, path):
    from plotting import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys((r["precision"], r["path"]) for r in rows):
        rs = [r for r in rows if (r["precision"], r["path"]) == key]
        line, = ax.plot([r["T"] for r in rs], [r["ms"] * 1e3 for r in rs], "o-",
                        label=f"{key[1]} ({key[0]})")
        if key[1] != "a2a":
            ax.axhline(rs[0]["floor_us"], color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per GPU (T)")
    ax.set_ylabel("forward µs")
    ax.set_title("decode: forward time vs weight-read floor (dotted)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()

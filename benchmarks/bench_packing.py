"""Ten-layer activation packing benchmark (design guide §04/§07 "packing workload").

    torchrun --nproc-per-node=2 benchmarks/bench_packing.py --out OUTDIR [--factors 2.5,1.0]
             [--precisions bf16,mxfp8,fp8_block]

Ten MoE layers with independent inputs and weights and a different routing imbalance per layer
(the hot rank alternates) run all forwards, then all backwards in reverse order, inside one CUDA
graph. For each activation factor two policies hold the same total saved-state bytes:
    shared    one slot for all ten layers (max_moe_layers_per_activation_slot=10)
    per_layer ten slots of a tenth each, one layer per slot (MoK-style per-layer budgets)
Reported per case: iteration time (guide timing method), saved-state bytes per rank at the end of
the forwards, the context's device memory (arena, symmetric buffers), the peak GPU memory of one
eager iteration above what was allocated before the case (context, saved state, scratch, the
layers' outputs and gradients; read before the comparison copies and the timing graph pool
exist), and each layer's save (S) / replay (R) flag. Correctness
first: the shared policy's gradients of every layer are compared with the per-layer policy's.

Every precision gets the same slot bytes: bf16's plan at the factor (a factor below what bf16's
ten layers need makes bf16 replay; a block-scaled precision, whose saved state is about half,
fits more layers into the same bytes).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import megatron_dist_moe as dm  # noqa: E402
from bench_layer import make_routing  # noqa: E402
from common import append_csv, git_commit, time_windows  # noqa: E402

L = 10
IMBALANCE = (1.0, 1.6, 1.0, 1.9, 1.2, 1.0, 1.8, 1.4, 1.0, 1.7)   # tracked-rank factor per layer


def build_layers(T, D, F, K, E_local, EP, rank, dev):
    layers = []
    for i in range(L):
        gen = torch.Generator().manual_seed(7000 + 31 * i + rank)
        ids, scores = make_routing(T, K, E_local, EP, IMBALANCE[i], gen, dev)
        hot = i % EP      # alternate the hot rank: rank `hot` gets the extra rows
        ids = torch.where(ids >= 0, (ids + hot * E_local) % (E_local * EP), ids)
        x = torch.randn(T, D, generator=gen).to(torch.bfloat16).to(dev).requires_grad_()
        s = scores.float().requires_grad_()
        w13 = (torch.randn(E_local, 2 * F, D, generator=gen) / D ** 0.5).to(torch.bfloat16).to(dev).requires_grad_()
        w2 = (torch.randn(E_local, D, F, generator=gen) / F ** 0.5).to(torch.bfloat16).to(dev).requires_grad_()
        gy = torch.randn(T, D, generator=gen).to(torch.bfloat16).to(dev)
        layers.append(dict(x=x, ids=ids, s=s, w13=w13, w2=w2, gy=gy))
    return layers


def run_all(ctx, layers, slots, first_microbatch=None):
    """All forwards (slot per layer as given), then reverse-order backwards; first_microbatch:
    routed_experts(is_first_microbatch=...) (weight_cache.py)."""
    ys = []
    for i, p in enumerate(layers):
        if slots == "shared":
            if i == 0:
                ctx.select_activation_slot(0, L)
        else:
            ctx.select_activation_slot(i, 1)
        ys.append(dm.routed_experts(p["x"], p["ids"], p["s"], p["w13"], p["w2"], ctx,
                                    is_first_microbatch=first_microbatch))
    saved_after_fwd = ctx.planner.saved_bytes.clone()
    grads = [None] * L
    for i in reversed(range(L)):
        p = layers[i]
        grads[i] = torch.autograd.grad(ys[i], (p["x"], p["s"], p["w13"], p["w2"]), p["gy"])
    return grads, saved_after_fwd


def run_case(args, factor, precision, layers, T, D, F, K, E_local, EP, rank, dev, commit, gpu):
    """Both policies of one factor and precision: their CSV rows."""
    rows = []
    bf16 = dm.Config(num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K,
                     num_experts=E_local * EP, backend="cuda", wgrad_dtype="bf16",
                     device_scratch_capacity_factor=float(EP),
                     save_route_outputs=bool(args.save_route_outputs))
    total = dm.plan_memory(bf16.replace(max_moe_layers_per_activation_slot=L,
                                        activation_slot_capacity_factor=factor), EP).slot_bytes
    base = bf16.replace(precision=precision)
    shared_cfg = base.replace(max_moe_layers_per_activation_slot=L, activation_slot_bytes=total)
    per_layer_cfg = base.replace(num_activation_slots=L, max_moe_layers_per_activation_slot=1,
                                 activation_slot_bytes=total // L)
    grads_by = {}
    for policy, cfg in (("shared", shared_cfg), ("per_layer", per_layer_cfg)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_alloc = torch.cuda.memory_allocated()   # inputs, weights, earlier results
        with dm.create_context(config=cfg, device=dev) as ctx:
            torch.cuda.synchronize()
            ctx_bytes = torch.cuda.memory_allocated() - base_alloc
            ctx.backend.decision_trace = []
            # with the weight cache: this eager iteration quantizes each layer's weights into
            # its entry, the timed ones reuse them (a step's later microbatches)
            cached = args.weight_cache and precision != "bf16"
            grads, saved = run_all(ctx, layers, policy, True if cached else None)
            torch.cuda.synchronize()
            # The peak of one eager iteration (context + saved state + scratch + the ten
            # layers' outputs and gradients), read before the fp32 comparison copies and the
            # timing harness's graph pool exist, so both policies are measured alike.
            peak = torch.cuda.max_memory_allocated() - base_alloc
            flags = "".join("R" if bool(t) else "S" for t in ctx.backend.decision_trace)
            ctx.backend.decision_trace = None
            # bf16 copies for the comparison (outputs may live in reused context buffers)
            grads_by[policy] = [tuple(g.clone() for g in gs) for gs in grads]
            del grads
            t = time_windows(lambda: run_all(ctx, layers, policy, False if cached else None),
                             graph=True)
            saved_rank = int(saved.sum(0)[rank]) if policy == "per_layer" else int(saved[0, rank])
        n_replay = flags.count("R")
        case = (f"packing_f{factor}" + ("_routes" if args.save_route_outputs else "")
                + ("" if precision == "bf16" else f"_{precision}")
                + ("_cached" if cached else ""))
        rows.append(dict(commit=commit, gpu=gpu, ep=EP, case=case, T=T, D=D,
                         F=F, K=K, E_local=E_local, imbalance="/".join(map(str, IMBALANCE)),
                         precision=precision,
                         path=policy, mode="10fwd+10bwd", ms=round(t.median_ms, 3),
                         ms_min=round(t.min_ms, 3), ms_max=round(t.max_ms, 3),
                         useful_tflops=round(3 * 6 * T * K * D * F * L / (t.median_ms * 1e-3) / 1e12, 1),
                         ratio_to_baseline="",
                         note=f"flags={flags} replays={n_replay} saved_bytes_rank{rank}={saved_rank} "
                              f"slot_total={total} context_GiB={ctx_bytes / 2**30:.2f} "
                              f"peak_alloc_GiB={peak / 2**30:.2f}"))
        if rank == 0:
            print(f"factor {factor} {precision:<9} {policy:<9} {t.median_ms:8.2f} ms [{t.min_ms:.2f}-{t.max_ms:.2f}] "
                  f"flags={flags} saved={saved_rank / 2**30:.2f} GiB of {total / 2**30:.2f} GiB "
                  f"context={ctx_bytes / 2**30:.2f} GiB peak={peak / 2**30:.2f} GiB", flush=True)
    worst = 0.0
    for a, b in zip(grads_by["shared"], grads_by["per_layer"]):
        for ga, gb in zip(a, b):
            ga, gb = ga.float(), gb.float()
            worst = max(worst, float((ga - gb).norm() / gb.norm().clamp_min(1e-30)))
    ok = worst < 1e-2     # replay vs save differ only in where bf16 state lives: near-equal
    if rank == 0:
        print(f"factor {factor} {precision}: shared vs per-layer gradients max rel diff {worst:.2e} "
              f"{'OK' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        sys.exit(1)
    per, sh = rows[-1], rows[-2]
    sh["ratio_to_baseline"] = round(per["ms"] / sh["ms"], 3)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--factors", default="2.5,1.0")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--weight-cache", action="store_true",
                    help="fp8_block / mxfp8: weights quantized once (is_first_microbatch=True "
                         "in the untimed iteration, False in the timed ones)")
    ap.add_argument("--precisions", default="bf16",
                    help="comma-separated; each runs at bf16's slot bytes for the factor")
    ap.add_argument("--save-route-outputs", type=int, choices=[0, 1], default=0,
                    help="Config.save_route_outputs (0, the default: a third less full state per "
                         "layer; 1: the guide's layout with the route outputs)")
    args = ap.parse_args()
    rank, EP = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    T, D, F, K, E_local = args.tokens, 7168, 3072, 6, 6
    layers = build_layers(T, D, F, K, E_local, EP, rank, dev)
    rows = []
    commit, gpu = git_commit(), torch.cuda.get_device_name()
    for factor in (float(f) for f in args.factors.split(",")):
        for precision in args.precisions.split(","):
            rows += run_case(args, factor, precision, layers, T, D, F, K, E_local, EP, rank, dev,
                             commit, gpu)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        append_csv(os.path.join(args.out, "bench_packing.csv"), rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

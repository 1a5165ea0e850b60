"""Routed-expert layer benchmark on EP GPUs: our CUDA backend vs the all-to-all baselines.

    torchrun --nproc-per-node=2 benchmarks/bench_layer.py --out OUTDIR [--cases guide,dsv3,...]
             [--paths dist_moe,dist_moe_staged,dist_moe_mega,dist_moe_torchgemm,dist_moe_fp8,
                      dist_moe_mxfp8,a2a,megatron_a2a]
             [--modes fwd,fwdbwd] [--profile] [--profile-paths dist_moe,...]

Paths:
    dist_moe, dist_moe_staged, dist_moe_mega, dist_moe_torchgemm
                   ours (standard / staged / Mega pipeline / torch GEMMs)
    dist_moe_fp8   ours at precision fp8_block (standard pipeline). Every forward quantizes the
                   weights (inside the timed graph too); the weight quantization alone is timed
                   as well and its share named in the row's note
    dist_moe_mxfp8 ours at precision mxfp8 (standard pipeline), timed as dist_moe_fp8 (its
                   weight preparation: the bf16 copies of the 32 x 32 tile quantization)
    dist_moe_fp8_cached, dist_moe_mxfp8_cached
                   the same with routed_experts(is_first_microbatch=False): the weights are
                   quantized once into the context's cache (an untimed True call, as a step's
                   first microbatch does) and every timed call reuses them (weight_cache.py)
    a2a            baseline (a): NCCL all-to-all + torch._grouped_mm experts (baselines.py)
    megatron_a2a   baseline (b): Megatron-Core's alltoall dispatcher + its experts
                   (TEGroupedMLP with TransformerEngine, else SequentialMLP; the CSV note says
                   which), fed the same routes and weights (megatron_baseline.py). In the
                   default --paths only when megatron.core imports; skipped with a message
                   otherwise.

For every case it first checks correctness (every path's output and input gradient against
baseline (a), all bf16 paths of the same function: norm-wise relative difference < 2e-2, else
MISMATCH and exit 1), then times each path with the guide's method (benchmarks/common.py), and
writes CSV rows (commit, GPU, shape, ms, useful TFLOP/s, ratio to the a2a baseline) plus a plot
to OUTDIR. Both baselines are timed eagerly (their host syncs prevent graph capture).
Useful FLOPs per GPU: 6·T·K·D·F forward, 3x that for forward+backward. The floor of each row
is its useful FLOPs over the dense bf16 matmul rate (torch.mm 8192^3 on every rank), timed first
in the same run with the same method (a "peak" row; --no-peak skips it), so a GPU that runs
slower today moves the floor with it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import megatron_dist_moe as dm  # noqa: E402
from baselines import a2a_grouped_mm_experts  # noqa: E402
from common import (  # noqa: E402
    DENSE_N,
    append_csv,
    dense_mm_peak,
    git_commit,
    parse_config_overrides,
    plot_rows,
    profile_graph,
    time_windows,
)
from megatron_baseline import (  # noqa: E402  (imports megatron.core only when used)
    MegatronA2AExperts,
    destroy_megatron_state,
    megatron_available,
)

DEFAULT_PATHS = ("dist_moe,dist_moe_staged,dist_moe_mega,dist_moe_torchgemm,dist_moe_fp8,"
                 "dist_moe_mxfp8,a2a")
# block-scaled paths and their precisions
QUANT_PATHS = {"dist_moe_fp8": "fp8_block", "dist_moe_mxfp8": "mxfp8",
               "dist_moe_fp8_cached": "fp8_block", "dist_moe_mxfp8_cached": "mxfp8"}
# the same with routed_experts(is_first_microbatch=False): the weights quantized once (per
# optimizer step, by the step's first microbatch; not timed), the timed calls reuse them
CACHED_PATHS = ("dist_moe_fp8_cached", "dist_moe_mxfp8_cached")
PIPELINE_PATHS = {"dist_moe_staged": "staged", "dist_moe_mega": "mega"}
# fp8_block / mxfp8 against the bf16 reference: E4M3 with block scales differs from bf16 by
# ~6-8 % norm-wise on these random inputs (dist_check holds it to 2x the emulated quantization);
# a wrong row or expert costs far more, and less than 1 % would mean it was not quantized
FP8_CHECK = (1e-2, 0.15)


def weight_preparation(ctx, precision, w13, w2, training):
    """The call that makes a precision's weight copies (what a graph replay repeats)."""
    experts = ctx.backend.experts
    if precision == "fp8_block":
        return lambda: experts.k.weights(w13, w2, training)
    return lambda: experts.mx.weights(w13, w2)

CASES = {
    "guide": dict(T=2048, D=7168, F=3072, K=6, E_local=6, imbalance=1.0),
    "dsv3": dict(T=2048, D=7168, F=2048, K=8, E_local=8, imbalance=1.0),
    "imb1.5": dict(T=2048, D=7168, F=3072, K=6, E_local=6, imbalance=1.5),
    "imb_all": dict(T=2048, D=7168, F=3072, K=6, E_local=6, imbalance=-1),  # all routes to rank 0
    "F1024": dict(T=2048, D=7168, F=1024, K=6, E_local=6, imbalance=1.0),
    "F2048": dict(T=2048, D=7168, F=2048, K=6, E_local=6, imbalance=1.0),
    "F4096": dict(T=2048, D=7168, F=4096, K=6, E_local=6, imbalance=1.0),
    "small": dict(T=512, D=2048, F=1024, K=4, E_local=4, imbalance=1.0),
}


def make_routing(T, K, E_local, EP, imbalance, gen, device):
    """IDs/scores where rank 0's experts get `imbalance` x their balanced share of routes
    (imbalance = -1: every route goes to rank 0's experts)."""
    E = E_local * EP
    if imbalance == -1:
        p0 = 1.0
    else:
        p0 = min(1.0, imbalance / EP)
    n0 = torch.distributions.Binomial(K, torch.full((T,), p0)).sample().to(torch.int64)
    n0 = n0.clamp(max=E_local)
    if EP > 1:
        n0 = n0.clamp(min=max(0, K - (E - E_local)))
    r0 = torch.argsort(torch.rand(T, E_local, generator=gen), 1)
    r1 = torch.argsort(torch.rand(T, max(E - E_local, 1), generator=gen), 1) + E_local
    j = torch.arange(K)[None, :]
    from0 = j < n0[:, None]
    ids = torch.where(from0, r0.gather(1, j.clamp(max=E_local - 1).expand(T, K)),
                      r1.gather(1, (j - n0[:, None]).clamp(min=0, max=r1.shape[1] - 1)))
    if EP == 1:
        ids = r0[:, :K]
    scores = torch.softmax(torch.randn(T, K, generator=gen), -1)
    return ids.to(torch.int32).to(device), scores.to(device)


def make_layer_inputs(c: dict, rank: int, EP: int, dev) -> dict:
    """One case's inputs on this rank (x, ids, s, w13, w2 with grads where autograd needs them,
    gy), the rows each rank receives (all-reduced) and the scratch factor that holds them."""
    T, D, F, K, E_local = c["T"], c["D"], c["F"], c["K"], c["E_local"]
    gen = torch.Generator().manual_seed(1234 + rank)
    ids, scores = make_routing(T, K, E_local, EP, c["imbalance"], gen, dev)
    x = (torch.randn(T, D, generator=gen)).to(torch.bfloat16).to(dev).requires_grad_()
    s = scores.float().requires_grad_()
    w13 = (torch.randn(E_local, 2 * F, D, generator=gen) / D ** 0.5).to(torch.bfloat16).to(dev).requires_grad_()
    w2 = (torch.randn(E_local, D, F, generator=gen) / F ** 0.5).to(torch.bfloat16).to(dev).requires_grad_()
    gy = torch.randn(T, D, generator=gen).to(torch.bfloat16).to(dev)
    rows_all = torch.zeros(EP, dtype=torch.int64, device=dev)
    owner = ids.to(torch.int64)[ids >= 0] // E_local
    rows_all.scatter_add_(0, owner, torch.ones_like(owner))
    dist.all_reduce(rows_all)
    return dict(x=x, ids=ids, s=s, w13=w13, w2=w2, gy=gy, rows_EP=rows_all.tolist(),
                scratch_factor=max(2.0, float(rows_all.max()) / (T * K) * 1.05))


def layer_config(c: dict, EP: int, scratch_factor: float, pipeline: str = "standard"):
    """Our path's Config for case c (bf16 WGRAD; scratch and slot sized by make_layer_inputs'
    scratch_factor): the one every layer benchmark times."""
    return dm.Config(pipeline=pipeline, num_local_input_tokens=c["T"], hidden_dim=c["D"],
                     intermediate_dim=c["F"], top_k=c["K"], num_experts=c["E_local"] * EP,
                     backend="cuda", device_scratch_capacity_factor=scratch_factor,
                     activation_slot_capacity_factor=scratch_factor, wgrad_dtype="bf16")


def dist_moe_fns(ctx, p: dict, is_first_microbatch=None):
    """(fwd, fwdbwd) callables of our path on context ctx over make_layer_inputs' p."""
    kw = dict(is_first_microbatch=is_first_microbatch)

    def fwd():
        with torch.no_grad():
            dm.routed_experts(p["x"], p["ids"], p["s"], p["w13"], p["w2"], ctx, **kw)

    def fwdbwd():
        y = dm.routed_experts(p["x"], p["ids"], p["s"], p["w13"], p["w2"], ctx, **kw)
        torch.autograd.grad(y, (p["x"], p["s"], p["w13"], p["w2"]), p["gy"])
    return fwd, fwdbwd


def useful_flops(T, K, D, F, mode):
    f = 6 * T * K * D * F
    return f if mode == "fwd" else 3 * f


def resolve_paths(paths_arg: str | None, rank: int) -> list[str]:
    """--paths as a list; megatron_a2a joins the default list when megatron.core imports and is
    dropped (with a message saying why) when it does not."""
    paths = (paths_arg or DEFAULT_PATHS).split(",")
    if paths_arg is not None and "megatron_a2a" not in paths:
        return paths   # not asked for: do not pay for importing megatron.core
    ok, why = megatron_available()
    if ok and paths_arg is None:
        paths.append("megatron_a2a")
    if not ok and "megatron_a2a" in paths:
        paths.remove("megatron_a2a")
    if rank == 0:
        if ok:
            print("megatron_a2a (baseline b): " + ("on" if "megatron_a2a" in paths else
                                                   "available, not in --paths"), flush=True)
        else:
            print(f"megatron_a2a (baseline b): SKIPPED, megatron.core does not import ({why}); "
                  "put megatron-core on PYTHONPATH to measure it", flush=True)
    return paths


def check_against_reference(path, y, gx, ref_y, ref_gx, rank, band=(0.0, 2e-2)) -> bool:
    """y and grad_x of `path` vs baseline (a) (norm-wise within `band`: < 2e-2 for bf16 paths,
    FP8_CHECK for fp8; worst rank: every rank takes the same decision, so none goes on to time
    a path the others skipped); True without a reference."""
    if ref_y is None:
        return True
    e = torch.stack([(y.float() - ref_y.float()).norm() / ref_y.float().norm(),
                     (gx.float() - ref_gx.float()).norm() / ref_gx.float().norm()])
    if dist.is_initialized():
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
    e_y, e_g = e.tolist()
    lo, hi = band
    ok = lo <= e_y < hi and lo <= e_g < hi
    if rank == 0:
        print(f"  check {path}: rel diff vs a2a y={e_y:.2e} grad_x={e_g:.2e} "
              f"{'OK' if ok else 'MISMATCH'}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--cases", default="guide,dsv3,imb1.5,imb_all,F1024,F2048,F4096")
    ap.add_argument("--paths", default=None,
                    help=f"default: {DEFAULT_PATHS}, plus megatron_a2a when megatron.core imports")
    ap.add_argument("--megatron-swiglu-fusion", action="store_true",
                    help="megatron_a2a: Megatron's fused weighted SwiGLU (bias_activation_fusion)")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--profile", action="store_true", help="write per-kernel times of our path")
    ap.add_argument("--profile-paths", default="dist_moe",
                    help="with --profile: the paths profiled (comma-separated)")
    ap.add_argument("--no-peak", action="store_true",
                    help="skip timing the dense bf16 mm whose rate gives each row's floor")
    ap.add_argument("--set", default="", dest="overrides",
                    help='Config overrides of our paths, e.g. "save_route_outputs=1"')
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", 0))
    EP = int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    paths = resolve_paths(args.paths, rank)
    overrides = parse_config_overrides(args.overrides)
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "bench_layer.csv")
    gpu = torch.cuda.get_device_name()
    commit = git_commit()
    rows = []
    failed = False
    peak_tf = None
    if not args.no_peak:   # the floor's peak, timed like every row below, in the same run
        t, peak_tf = dense_mm_peak(dev)
        rows.append(dict(commit=commit, gpu=gpu, ep=EP, case="peak", T=DENSE_N, D=DENSE_N,
                         F=DENSE_N, K="", E_local="", imbalance="", precision="bf16",
                         path="dense_mm", mode="mm",
                         ms=round(t.median_ms, 4), ms_min=round(t.min_ms, 4),
                         ms_max=round(t.max_ms, 4), useful_tflops=round(peak_tf, 1),
                         ratio_to_baseline="", note=f"bf16 torch.mm {DENSE_N}^3 on every rank: "
                         "the rate each row's floor is computed from"))
        if rank == 0:
            print(f"dense bf16 mm {DENSE_N}^3: {t.median_ms:.3f} ms [{t.min_ms:.3f}-"
                  f"{t.max_ms:.3f}]  {peak_tf:.1f} TFLOP/s (the floors' peak)", flush=True)
    for case in args.cases.split(","):
        c = CASES[case]
        T, D, F, K, E_local = c["T"], c["D"], c["F"], c["K"], c["E_local"]
        inp = make_layer_inputs(c, rank, EP, dev)
        x, ids, s, w13, w2, gy = (inp[k] for k in ("x", "ids", "s", "w13", "w2", "gy"))
        scratch_factor = inp["scratch_factor"]
        note = f"rows per rank {inp['rows_EP']}"
        if rank == 0:
            print(f"[{case}] T={T} D={D} F={F} K={K} E_local={E_local} EP={EP} {note}", flush=True)

        results = {}
        wq_ms = {}
        ref_y = ref_gx = None
        if "a2a" in paths or "megatron_a2a" in paths:   # the reference of every check
            y = a2a_grouped_mm_experts(x, ids, s, w13, w2)
            ref_gx, = torch.autograd.grad(y, (x,), gy)
            ref_y = y.detach()
            del y
        for path in paths:
            mega = None
            row_note = note
            if path == "a2a":
                fwd = lambda: a2a_grouped_mm_experts(x, ids, s, w13, w2)  # noqa: E731

                def fwdbwd():
                    y = a2a_grouped_mm_experts(x, ids, s, w13, w2)
                    torch.autograd.grad(y, (x, s, w13, w2), gy)
                graph = False
                ctx = None
            elif path == "megatron_a2a":
                ctx = None
                mega = MegatronA2AExperts(T, D, F, K, E_local, dtype=torch.bfloat16, device=dev,
                                          swiglu_fusion=args.megatron_swiglu_fusion)
                mega.load_weights(w13.detach(), w2.detach())
                row_note = f"{note}; {mega.note}"
                if rank == 0:
                    print(f"  {path}: {mega.note}", flush=True)
                mparams = (x, s, *mega.expert_params())
                y = mega(x, ids, s)   # validate=True: every route active, IDs distinct
                gx, = torch.autograd.grad(y, (x,), gy)
                y = y.detach()
                if not check_against_reference(path, y, gx, ref_y, ref_gx, rank):
                    failed = True
                    mega = mparams = None
                    continue

                def fwd(mega=mega):
                    mega(x, ids, s, validate=False)

                def fwdbwd(mega=mega, mparams=mparams):
                    y = mega(x, ids, s, validate=False)
                    torch.autograd.grad(y, mparams, gy)
                graph = False
            else:
                exe = {"gemm_engine": "torch"} if path == "dist_moe_torchgemm" else {}
                cfg = layer_config(c, EP, scratch_factor, PIPELINE_PATHS.get(path, "standard")
                                   ).replace(**overrides)
                quant = QUANT_PATHS.get(path)
                if quant:
                    cfg = cfg.replace(precision=quant)
                if overrides:
                    row_note = f"{note}; set {args.overrides}"
                ctx = dm.create_context(config=cfg, device=dev, execution_overrides=exe)
                cached = path in CACHED_PATHS
                if cached:
                    row_note = f"{row_note}; is_first_microbatch=False (weights quantized once)"
                if quant == "fp8_block":   # which engines ran (Execution.fp8_gemm, fp8_quant)
                    row_note = (f"{row_note}; fp8 GEMMs: {ctx.execution.fp8_gemm}; fp8 "
                                f"quantizing kernels: {ctx.execution.fp8_quant}")
                y = dm.routed_experts(x, ids, s, w13, w2, ctx,
                                      is_first_microbatch=True if cached else None)
                gx, = torch.autograd.grad(y, (x,), gy)
                y = y.detach()   # drop the autograd graph before any capture
                if not check_against_reference(path, y, gx, ref_y, ref_gx, rank,
                                               FP8_CHECK if quant else (0.0, 2e-2)):
                    failed = True
                    ctx.close()
                    continue

                fwd, fwdbwd = dist_moe_fns(ctx, inp, False if cached else None)
                graph = True
                if quant and not cached:   # the weight quantization alone, as the graph runs it
                    for training, mode in ((False, "fwd"), (True, "fwdbwd")):
                        tq = time_windows(weight_preparation(ctx, quant, w13.detach(),
                                                             w2.detach(), training), graph=True)
                        wq_ms[(path, mode)] = tq.median_ms
            for mode in args.modes.split(","):
                fn = fwd if mode == "fwd" else fwdbwd
                try:
                    t = time_windows(fn, graph=graph)
                except Exception as e:  # a path that cannot be graphed is timed eagerly
                    if rank == 0:
                        print(f"  {path} {mode}: graph timing failed ({e!r}); timing eagerly")
                    t = time_windows(fn, graph=False)
                tf = useful_flops(T, K, D, F, mode) / (t.median_ms * 1e-3) / 1e12
                results[(path, mode)] = t
                floor = ""
                if peak_tf:
                    floor_ms = useful_flops(T, K, D, F, mode) / (peak_tf * 1e12) * 1e3
                    floor = (f"; floor {floor_ms:.3f} ms at {peak_tf:.0f} TFLOP/s "
                             f"({tf / peak_tf:.0%} of it)")
                precision = QUANT_PATHS.get(path, "bf16")
                wq = ""
                if (path, mode) in wq_ms:
                    wq = (f"; weight quantization {wq_ms[(path, mode)]:.3f} ms of it (without: "
                          f"{t.median_ms - wq_ms[(path, mode)]:.3f} ms)")
                rows.append(dict(commit=commit, gpu=gpu, ep=EP, case=case, T=T, D=D, F=F, K=K,
                                 E_local=E_local, imbalance=c["imbalance"], precision=precision,
                                 path=path, mode=mode,
                                 ms=round(t.median_ms, 4), ms_min=round(t.min_ms, 4),
                                 ms_max=round(t.max_ms, 4), useful_tflops=round(tf, 1),
                                 ratio_to_baseline="", note=row_note + floor + wq))
                if rank == 0:
                    print(f"  {path:<20} {mode:<7} {t.median_ms:8.3f} ms "
                          f"[{t.min_ms:.3f}-{t.max_ms:.3f}]  {tf:7.1f} TFLOP/s"
                          + (f"  {tf / peak_tf:4.0%} of the dense peak" if peak_tf else "")
                          + wq, flush=True)
            if (args.profile and ctx is not None and case == "guide"
                    and path in args.profile_paths.split(",")):
                for mode, f in (("fwd", fwd), ("fwdbwd", fwdbwd)):
                    if (path, mode) not in results:   # a mode --modes left out
                        continue
                    # every rank's profile: the iteration is the slowest rank's, and the
                    # ranks' barrier waits tell which one that is
                    suffix = "" if rank == 0 else f"_rank{rank}"
                    out = os.path.join(args.out, f"profile_{case}_{path}_{mode}{suffix}.txt")
                    profile_graph(f, out, iter_ms=results[(path, mode)].median_ms)
            if ctx is not None:
                ctx.close()
            mega = mparams = fwd = fwdbwd = None   # free the Megatron layer before the next path
        for r in rows:
            if r["case"] == case and ("a2a", r["mode"]) in results:
                r["ratio_to_baseline"] = round(results[("a2a", r["mode"])].median_ms / r["ms"], 3)
    if rank == 0:
        append_csv(csv_path, rows)
        plot_rows([r for r in rows if r["case"] != "peak"],
                  os.path.join(args.out, "bench_layer.png"),
                  f"{EP}x {gpu}" + (f" (dense bf16 peak {peak_tf:.0f} TFLOP/s)" if peak_tf else ""))
        print(f"\n{'case':<8} {'path':<20} {'mode':<7} {'ms':>8} {'TFLOP/s':>8} {'vs a2a':>7}"
              + (f" {'of peak':>8}" if peak_tf else ""))
        for r in rows:
            print(f"{r['case']:<8} {r['path']:<20} {r['mode']:<7} {r['ms']:8.3f} "
                  f"{r['useful_tflops']:8.1f} {r['ratio_to_baseline']!s:>7}"
                  + (f" {r['useful_tflops'] / peak_tf:8.0%}" if peak_tf else ""))
    destroy_megatron_state()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

"""Multi-rank correctness checks of the CUDA backend against an fp64 oracle (run under torchrun).

    torchrun --nproc-per-node=2 tests/gpu/dist_check.py [--quick] [--json out.json]

Every rank draws the *global* problem from one seed (all ranks' x, IDs, scores and all experts'
weights), runs its share through routed_experts, and compares its outputs and gradients with an
fp64 autograd oracle of the whole problem. Tolerances: bf16 operands and bf16 storage of h1, h2,
h3 give norm-wise relative errors of a few 1e-3; 2e-2 flags real bugs (a missing route, a wrong
row or expert is O(1e-1..1)).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

import megatron_dist_moe as dm
from megatron_dist_moe.activation import Activation

TOL_FLOOR = 6e-3


class _RoundBF16(torch.autograd.Function):
    """Round to bf16 in forward, identity in backward: where the kernels store bf16."""

    @staticmethod
    def forward(ctx, t):
        return t.to(torch.bfloat16).to(t.dtype)

    @staticmethod
    def backward(ctx, g):
        # the kernels also store grad_h1, grad_h2 and grad_h3 in bf16
        return g.to(torch.bfloat16).to(g.dtype)


def oracle(x_all, ids_all, s_all, w13_all, w2_all, gy_all, cfg, bf16_points=False):
    """fp64 forward and gradients of the whole EP problem (bf16_points: round h1, h2, h3 to bf16
    where the kernels store them — its error vs the exact oracle sets the tolerance).
    Shapes: x_all [EP,T,D], ids/s [EP,T,K],
    w13_all [E,2F,D], w2_all [E,D,F], gy_all [EP,T,D]."""
    x = x_all.double().requires_grad_()
    s = s_all.double().requires_grad_()
    w13 = w13_all.double().requires_grad_()
    w2 = w2_all.double().requires_grad_()
    EP, T, D = x.shape
    K = ids_all.shape[-1]
    y = torch.zeros(EP, T, D, dtype=torch.float64, device=x.device)
    xf = x.reshape(-1, D)
    yf = y.reshape(-1, D)
    ids = ids_all.reshape(-1, K)
    sf = s.reshape(-1, K)
    outs = []
    for e in range(w13.shape[0]):
        tok, kk = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        rnd = _RoundBF16.apply if bf16_points else (lambda t: t)
        h1 = rnd(xf[tok] @ w13[e].t())
        h3 = rnd(rnd(Activation.of(cfg).forward(h1)) @ w2[e].t())
        outs.append((tok, h3 * sf[tok, kk][:, None]))
    y = torch.zeros_like(yf)
    for tok, v in outs:
        y = y.index_add(0, tok, v)
    y = y.view(EP, T, D)
    (y * gy_all.double()).sum().backward()
    return y.detach(), x.grad, s.grad, w13.grad, w2.grad


def emulation(prob, cfg):
    """The same computation at the precision's own rounding points: bf16 stores (oracle with
    bf16_points), or a block-scaled format's quantization (testing.block_quant_emulation). Its error against
    the exact oracle sets the tolerance."""
    if cfg.precision == "bf16":
        return oracle(prob["x"], prob["ids"], prob["s"], prob["w13"], prob["w2"], prob["gy"],
                      cfg, bf16_points=True)
    from megatron_dist_moe import testing as tt
    EP, T, D = prob["x"].shape
    K = prob["ids"].shape[-1]
    E, F2, _ = prob["w13"].shape
    P = tt.Problem.from_ep(prob["x"], prob["ids"], prob["s"], prob["w13"], prob["w2"], prob["gy"])
    em = tt.block_quant_emulation(P, cfg)
    return (em["y"].view(EP, T, D), em["grad_x"].view(EP, T, D),
            em["grad_scores"].view(EP, T, K), em["grad_w13"].view(E, F2, D), em["grad_w2"])


def relerr(a, b):
    a = a.double()
    b = b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


NAMES = ("y", "grad_x", "grad_scores", "grad_w13", "grad_w2")


def compare(got, prob, cfg, rank, sl):
    """Norm-wise relative errors vs the exact fp64 oracle, and tolerances: 2x the error of the
    same computation at the precision's rounding points (`emulation`: the precision's own
    error), floored at TOL_FLOOR."""
    args = (prob["x"], prob["ids"], prob["s"], prob["w13"], prob["w2"], prob["gy"], cfg)
    exact = oracle(*args)
    emul = emulation(prob, cfg)
    pick = (lambda t: t[rank], lambda t: t[rank], lambda t: t[rank], lambda t: t[sl],
            lambda t: t[sl])
    # NOTE: the clamped activation's derivative jumps at +-limit; an h1 element within a bf16
    # ulp of the bound lands on either side depending on accumulation order, and a handful of
    # such flips moves grad_x / grad_w13 by ~1e-2. The emulation cannot reproduce our flips,
    # so clamped gradients get a 3e-2 floor (a wrong row or expert costs >1e-1).
    clamped = cfg.activation == "swiglu_clamped"
    errs, tols = {}, {}
    for name, g, ex, em, p in zip(NAMES, got, exact, emul, pick):
        errs[name] = relerr(g.reshape(p(ex).shape), p(ex))
        floor = 3e-2 if clamped and name in ("grad_x", "grad_w13") else TOL_FLOOR
        tols[name] = max(floor, 2 * relerr(p(em), p(ex)))
    return errs, tols


def make_problem(cfg, EP, T, seed, routing="random", device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    E, K, D, F = cfg.num_experts, cfg.top_k, cfg.hidden_dim, cfg.intermediate_dim
    x = torch.randn(EP, T, D, generator=g)
    w13 = torch.randn(E, 2 * F, D, generator=g) / D ** 0.5
    w2 = torch.randn(E, D, F, generator=g) / F ** 0.5
    if routing == "hot_rank":        # every route goes to rank 0's experts
        E_loc = E // EP
        ids = torch.stack([torch.randperm(E_loc, generator=g)[:K] for _ in range(EP * T)])
    elif routing == "hot_expert":     # expert 1 on every token, the rest random
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(EP * T)])
        has = (ids == 1).any(1)
        ids[~has, 0] = 1
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(EP * T)])
    ids = ids.view(EP, T, K)
    s = torch.softmax(torch.randn(EP, T, K, generator=g), -1)
    if routing in ("inactive", "random"):
        drop = torch.rand(EP, T, K, generator=g) < (0.25 if routing == "inactive" else 0.0)
        if routing == "inactive":
            drop[:, : max(1, T // 8)] = True       # all-inactive rows
        ids = torch.where(drop, -1, ids)
        s = torch.where(drop, 0.0, s)
    gy = torch.randn(EP, T, D, generator=g)
    bf = lambda t: t.to(torch.bfloat16).to(device)
    return dict(x=bf(x), ids=ids.to(torch.int32).to(device), s=s.float().to(device), w13=bf(w13),
                w2=bf(w2), gy=bf(gy))


def run_case(name, cfg, ctx, prob, rank, EP, results, w13_4d=False, repeat=1, wgrad_into=False,
             offset_views=False):
    """wgrad_into: the weight gradients are added into fp32 per-expert accumulators holding
    small integers (exact in fp32; routed_experts(wgrad_into=...)); judged as (after - before),
    and w13/w2 must receive exact zeros.
    offset_views: w13 and w2 are views at a non-zero offset into a larger parameter (one extra
    expert in front), as the Megatron plugin passes its packed weights; the extra expert must
    get an exact zero gradient."""
    E_loc = cfg.num_experts // EP
    sl = slice(rank * E_loc, (rank + 1) * E_loc)
    x = prob["x"][rank].clone().requires_grad_()
    s = prob["s"][rank].clone().requires_grad_()
    w13 = prob["w13"][sl].clone()
    if w13_4d:
        w13 = w13.view(E_loc, 2, cfg.intermediate_dim, cfg.hidden_dim)
    w13 = w13.requires_grad_()
    w2 = prob["w2"][sl].clone().requires_grad_()
    bases = None
    if offset_views:
        bases = [torch.cat([w.detach()[:1] * 0 + 7, w.detach()]).requires_grad_()
                 for w in (w13, w2)]
        w13, w2 = bases[0][1:], bases[1][1:]
    ids = prob["ids"][rank]
    into = start = None
    if wgrad_into:
        g = torch.Generator(device="cuda").manual_seed(31 + rank)
        start = [torch.randint(-3, 4, w.shape, generator=g, device="cuda").float()
                 for w in (w13.detach().reshape(E_loc, -1, cfg.hidden_dim), w2.detach())]
        into = tuple([t.clone() for t in st] for st in start)
    for _ in range(repeat):
        x.grad = s.grad = None
        if bases is None:
            w13.grad = w2.grad = None
        y = dm.routed_experts(x, ids, s, w13, w2, ctx, wgrad_into=into)
        y.backward(prob["gy"][rank])
    if bases is not None:
        zero_w = not bool(bases[0].grad[0].any()) and not bool(bases[1].grad[0].any())
        got = (y, x.grad, s.grad, bases[0].grad[1:].reshape(E_loc, -1, cfg.hidden_dim),
               bases[1].grad[1:])
    elif wgrad_into:
        zero_w = not bool(w13.grad.any()) and not bool(w2.grad.any())
        got = (y, x.grad, s.grad) + tuple(torch.stack(acc) - st for acc, st in zip(into, start))
    else:
        zero_w = True
        got = (y, x.grad, s.grad, w13.grad.reshape(E_loc, -1, cfg.hidden_dim), w2.grad)
    errs, tols = compare(got, prob, cfg, rank, sl)
    inactive_rows = (ids < 0).all(1)
    exact_zero = bool((y[inactive_rows] == 0).all()) and bool((x.grad[inactive_rows] == 0).all())
    ok = (all(errs[k] <= tols[k] for k in errs) and exact_zero and zero_w
          and bool(torch.isfinite(y).all()))
    results.append(dict(case=name, rank=rank, ok=ok, exact_zero_rows=exact_zero, **errs,
                        tol_max=max(tols.values()),
                        **({} if zero_w else dict(msg="w13/w2 (or the extra expert in front of "
                                                      "the views) got non-zero gradients"))))
    return ok


def capture(step):
    """(graph, outputs) of step() captured once, after two warm-up runs on a side stream (every
    rank at a barrier before the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def run_graph_case(cfg, ctx, EP, rank, results, T):
    """Capture forward+backward once, replay with new routing/inputs at the same addresses."""
    E_loc = cfg.num_experts // EP
    sl = slice(rank * E_loc, (rank + 1) * E_loc)
    p0 = make_problem(cfg, EP, T, seed=100)
    x = p0["x"][rank].clone().requires_grad_()
    s = p0["s"][rank].clone().requires_grad_()
    ids = p0["ids"][rank].clone()
    gy = p0["gy"][rank].clone()
    w13 = p0["w13"][sl].clone().requires_grad_()
    w2 = p0["w2"][sl].clone().requires_grad_()

    def step():
        y = dm.routed_experts(x, ids, s, w13, w2, ctx)
        return (y,) + torch.autograd.grad(y, (x, s, w13, w2), gy)

    graph, outs = capture(step)
    ok_all = True
    for seed, routing in ((101, "random"), (102, "hot_expert"), (103, "inactive")):
        p = make_problem(cfg, EP, T, seed=seed, routing=routing)
        with torch.no_grad():
            x.copy_(p["x"][rank]); s.copy_(p["s"][rank]); ids.copy_(p["ids"][rank])
            gy.copy_(p["gy"][rank]); w13.copy_(p["w13"][sl]); w2.copy_(p["w2"][sl])
            for o in outs:
                o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        errs, tols = compare(outs, p, cfg, rank, sl)
        ok = all(errs[k] <= tols[k] for k in errs)
        ok_all &= ok
        results.append(dict(case=f"graph_replay_{routing}", rank=rank, ok=ok, **errs,
                            tol_max=max(tols.values())))
    del graph
    return ok_all


def run_sync_free_case(cfg, ctx, EP, rank, results, T):
    p = make_problem(cfg, EP, T, seed=7)
    E_loc = cfg.num_experts // EP
    sl = slice(rank * E_loc, (rank + 1) * E_loc)
    x = p["x"][rank].clone().requires_grad_()
    s = p["s"][rank].clone().requires_grad_()
    w13 = p["w13"][sl].clone().requires_grad_()
    w2 = p["w2"][sl].clone().requires_grad_()
    y = dm.routed_experts(x, p["ids"][rank], s, w13, w2, ctx)   # warm-up (compiles kernels)
    y.backward(p["gy"][rank])
    torch.cuda.synchronize()
    ok, msg = True, ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = dm.routed_experts(x, p["ids"][rank], s, w13, w2, ctx)
        y.backward(p["gy"][rank])
    except RuntimeError as e:
        ok, msg = False, str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    results.append(dict(case="no_host_sync", rank=rank, ok=ok, msg=msg))
    return ok


def run_deterministic_case(name, cfg, ctx, EP, rank, results, T):
    """Three identical training calls (forward + backward): every output bit-equal across the
    runs, the score gradients included (their parts are summed in a fixed order)."""
    E_loc = cfg.num_experts // EP
    sl = slice(rank * E_loc, (rank + 1) * E_loc)
    p = make_problem(cfg, EP, T, seed=41, routing="hot_expert")
    outs = []
    for _ in range(3):
        x = p["x"][rank].clone().requires_grad_()
        s = p["s"][rank].clone().requires_grad_()
        w13 = p["w13"][sl].clone().requires_grad_()
        w2 = p["w2"][sl].clone().requires_grad_()
        y = dm.routed_experts(x, p["ids"][rank], s, w13, w2, ctx)
        y.backward(p["gy"][rank])
        outs.append([t.detach().clone() for t in (y, x.grad, s.grad, w13.grad, w2.grad)])
    differ = [n for i, n in enumerate(NAMES) if not all(torch.equal(outs[0][i], o[i])
                                                           for o in outs[1:])]
    results.append(dict(case=name, rank=rank, ok=not differ,
                        **({"msg": f"not bitwise reproducible: {differ}"} if differ else {})))


def run_weight_cache_case(name, cfg, ctx, EP, rank, results, T):
    """routed_experts(is_first_microbatch=...) (weight_cache.py), forward + backward, every
    output bitwise: True gives the bits of a call that quantizes its own weights, False reuses
    them, also after the weights changed in place, until the next True; a CUDA graph captured
    with False reads the entry at its fixed address, so an eager True call refreshes what the
    graph's replays read."""
    E_loc = cfg.num_experts // EP
    sl = slice(rank * E_loc, (rank + 1) * E_loc)
    p = make_problem(cfg, EP, T, seed=43, routing="hot_expert")
    x = p["x"][rank].clone().requires_grad_()
    s = p["s"][rank].clone().requires_grad_()
    w13 = p["w13"][sl].clone().requires_grad_()
    w2 = p["w2"][sl].clone().requires_grad_()

    def step(mode):
        y = dm.routed_experts(x, p["ids"][rank], s, w13, w2, ctx, is_first_microbatch=mode)
        return [y] + list(torch.autograd.grad(y, (x, s, w13, w2), p["gy"][rank]))

    def same(a, b):
        return all(torch.equal(u, v) for u, v in zip(a, b))

    def update(scale):   # an optimizer step: in place, through .data
        w13.data.mul_(scale)
        w2.data.add_(0.01)
    checks = {}
    own0 = [t.clone() for t in step(None)]
    checks["first_eq_own"] = same(step(True), own0)
    checks["reuse_eq_first"] = same(step(False), own0)
    update(1.25)
    checks["stale_eq_old"] = same(step(False), own0)
    own1 = [t.clone() for t in step(None)]
    checks["new_differs"] = not same(own1, own0)
    checks["refresh_eq_new"] = same(step(True), own1)
    # the graph on new leaves sharing the weights' storage (the cache key is the address):
    # leaves that eager calls already differentiated keep AccumulateGrad nodes of the default
    # stream, which a capture cannot depend on
    xg, sg = x.detach().requires_grad_(), s.detach().requires_grad_()
    w13g, w2g = w13.detach().requires_grad_(), w2.detach().requires_grad_()

    def gstep():
        y = dm.routed_experts(xg, p["ids"][rank], sg, w13g, w2g, ctx, is_first_microbatch=False)
        return [y] + list(torch.autograd.grad(y, (xg, sg, w13g, w2g), p["gy"][rank]))
    graph, outs = capture(gstep)
    update(0.8)
    own2 = [t.clone() for t in step(None)]
    graph.replay()
    checks["graph_reuses_entry"] = same(outs, own1)
    step(True)                                  # refresh in place, eagerly
    graph.replay()
    checks["graph_sees_refresh"] = same(outs, own2)
    torch.cuda.synchronize()
    del graph
    bad = [k for k, v in checks.items() if not v]
    results.append(dict(case=name, rank=rank, ok=not bad,
                        **({"msg": f"failed: {bad}"} if bad else {})))


def run_inference_case(name, cfg, ctx, EP, rank, results, T, graph=False):
    """Forward under no_grad against the fp64 oracle (eager; with graph, also captured once and
    replayed with new routing and inputs at the same addresses)."""
    E_loc = cfg.num_experts // EP
    sl = slice(rank * E_loc, (rank + 1) * E_loc)
    ok_all = True
    p0 = make_problem(cfg, EP, T, seed=51, routing="inactive")
    x, s, ids = (p0[k][rank].clone() for k in ("x", "s", "ids"))
    w13, w2 = p0["w13"][sl].clone(), p0["w2"][sl].clone()
    with torch.no_grad():
        y = dm.routed_experts(x, ids, s, w13, w2, ctx)
    runs = [("eager", p0, y)]
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            dm.routed_experts(x, ids, s, w13, w2, ctx)
        torch.cuda.current_stream().wait_stream(side)
        dist.barrier()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.no_grad():
            yg = dm.routed_experts(x, ids, s, w13, w2, ctx)
        for seed, routing in ((52, "hot_expert"), (53, "random")):
            p = make_problem(cfg, EP, T, seed=seed, routing=routing)
            x.copy_(p["x"][rank]); s.copy_(p["s"][rank]); ids.copy_(p["ids"][rank])
            w13.copy_(p["w13"][sl]); w2.copy_(p["w2"][sl])
            yg.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            runs.append((f"graph_{routing}", p, yg.clone()))
        del g
    for tag, p, y in runs:
        args = (p["x"], p["ids"], p["s"], p["w13"], p["w2"], p["gy"], cfg)
        exact, emul = oracle(*args)[0][rank], emulation(p, cfg)[0][rank]
        err = relerr(y, exact)
        tol = max(TOL_FLOOR, 2 * relerr(emul, exact))
        zero_rows = (p["ids"][rank] < 0).all(1)
        ok = err <= tol and bool(torch.isfinite(y).all()) and bool((y[zero_rows] == 0).all())
        ok_all &= ok
        results.append(dict(case=f"{name}_{tag}", rank=rank, ok=ok, y=err, tol_max=tol))
    return ok_all


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--engines", default="triton,torch")
    ap.add_argument("--pipelines", default="standard,staged,mega",
                    help="each one the CUDA backend runs (execution.RUNS); the others are skipped")
    ap.add_argument("--precisions", default="bf16,fp8_block,mxfp8")
    ap.add_argument("--fp8-gemms", default="cutlass,triton",
                    help="fp8_block's GEMM engines to check (Execution.fp8_gemm): each runs "
                         "the fp8_block cases once")
    ap.add_argument("--fp8-quants", default="cuda,triton",
                    help="fp8_block's quantizing engines to check (Execution.fp8_quant: the CUDA "
                         "kernels, or the Triton ones; each with each --fp8-gemms engine)")
    ap.add_argument("--save-route-outputs", default="0", choices=["0", "1"],
                    help="Config.save_route_outputs (0: score gradients on the expert side)")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    EP = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    results = []
    shapes = [dict(T=37, D=128, F=192, K=3, E_local=3)]
    if not args.quick:
        shapes.append(dict(T=256, D=1024, F=512, K=6, E_local=6))
    from megatron_dist_moe.execution import runs
    fp8_engines = [(g, q) for g in args.fp8_gemms.split(",") for q in args.fp8_quants.split(",")]
    combos = [(pr, e, p, f8) for pr in args.precisions.split(",")
              for e in args.engines.split(",") for p in args.pipelines.split(",")
              for f8 in (fp8_engines if pr == "fp8_block" else [None])
              if not (e == "torch" and (p != "standard" or pr != "bf16")) and runs("cuda", pr, p)
              and pr != "nvfp4"]     # nvfp4 runs inference only: inference_check.py
    for (precision, engine, pipeline, f8), sh in ((c, sh) for c in combos for sh in shapes):
        fp8_gemm, fp8_quant = f8 if f8 else (None, None)
        exe = {"gemm_engine": engine, **({"fp8_gemm": fp8_gemm, "fp8_quant": fp8_quant}
                                         if f8 else {})}
        T = sh["T"]
        F = sh["F"] if precision == "bf16" else -(-sh["F"] // 128) * 128   # block-scaled: % 128
        for activation in ("swiglu", "swiglu_clamped"):
            cfg = dm.Config(num_local_input_tokens=T, hidden_dim=sh["D"], intermediate_dim=F,
                            top_k=sh["K"], num_experts=sh["E_local"] * EP, backend="cuda",
                            activation=activation, device_scratch_capacity_factor=float(EP),
                            activation_slot_capacity_factor=1.5, wgrad_dtype="fp32",
                            swiglu_limit=3.0, pipeline=pipeline, precision=precision,
                            save_route_outputs=args.save_route_outputs == "1")
            tag = f"{precision}_{engine}_{pipeline}_T{T}_D{sh['D']}_F{F}_{activation}"
            if f8:
                tag += f"_fp8gemm-{fp8_gemm}_fp8quant-{fp8_quant}"
            if args.save_route_outputs == "0":
                tag += "_expert_score_grads"
            try:
                with dm.create_context(config=cfg, execution_overrides=exe) as ctx:
                    for routing in ("random", "inactive", "hot_rank", "hot_expert"):
                        prob = make_problem(cfg, EP, T, seed=sum(map(ord, routing)) + T, routing=routing)
                        run_case(f"{tag}_{routing}", cfg, ctx, prob, rank, EP, results)
                    prob = make_problem(cfg, EP, T, seed=5)
                    run_case(f"{tag}_w13_4d_repeat3", cfg, ctx, prob, rank, EP, results,
                             w13_4d=True, repeat=3)
                    prob = make_problem(cfg, EP, T, seed=6, routing="inactive")
                    run_case(f"{tag}_wgrad_into", cfg, ctx, prob, rank, EP, results,
                             wgrad_into=True)
                    prob = make_problem(cfg, EP, T, seed=8, routing="hot_expert")
                    run_case(f"{tag}_weights_offset_views", cfg, ctx, prob, rank, EP, results,
                             offset_views=True)
                    if activation == "swiglu":
                        run_graph_case(cfg, ctx, EP, rank, results, T)
                        run_sync_free_case(cfg, ctx, EP, rank, results, T)
                        run_deterministic_case(f"{tag}_bitwise_3x", cfg, ctx, EP, rank, results,
                                               T)
                        if precision in ("fp8_block", "mxfp8"):
                            run_weight_cache_case(f"{tag}_weight_cache", cfg, ctx, EP, rank,
                                                  results, T)
                        run_inference_case(f"{tag}_inference_after_training", cfg, ctx, EP,
                                           rank, results, T)
                # an inference context of the same shape: eager and graph-replayed forwards
                icfg = cfg.replace(inference=True, num_activation_slots=0,
                                   activation_slot_capacity_factor=None)
                with dm.create_context(config=icfg, execution_overrides=exe) as ictx:
                    run_inference_case(f"{tag}_inference", icfg, ictx, EP, rank, results, T,
                                       graph=True)
            except Exception as e:  # keep going: report every case
                results.append(dict(case=tag, rank=rank, ok=False, error=repr(e),
                                    tb=traceback.format_exc()[-2000:]))
    # replay: a minimum slot forces recompute
    exe = {"gemm_engine": args.engines.split(",")[0]}
    cfg = dm.Config(num_local_input_tokens=64, hidden_dim=128, intermediate_dim=128, top_k=2,
                    num_experts=4 * EP, backend="cuda", device_scratch_capacity_factor=float(EP),
                    max_moe_layers_per_activation_slot=1,
                    save_route_outputs=args.save_route_outputs == "1")
    try:
        with dm.create_context(config=cfg, execution_overrides=exe) as ctx:
            prob = make_problem(cfg, EP, 64, seed=11)
            run_case("replay_min_slot", cfg, ctx, prob, rank, EP, results)
    except Exception as e:
        results.append(dict(case="replay_min_slot", rank=rank, ok=False, error=repr(e),
                            tb=traceback.format_exc()[-2000:]))
    # host-backed (VMM) scratch: routing beyond the device scratch bound, within the total bound
    cfg = dm.Config(num_local_input_tokens=64, hidden_dim=128, intermediate_dim=128, top_k=2,
                    num_experts=4 * EP, backend="cuda", device_scratch_capacity_factor=0.5,
                    host_scratch_capacity_factor=float(EP), activation_slot_capacity_factor=1.0)
    try:
        with dm.create_context(config=cfg) as ctx:
            assert ctx.plan.host_scratch_bytes > 0
            for routing in ("hot_rank", "random"):
                prob = make_problem(cfg, EP, 64, seed=21, routing=routing)
                run_case(f"vmm_host_scratch_{routing}", cfg, ctx, prob, rank, EP, results)
    except Exception as e:
        results.append(dict(case="vmm_host_scratch", rank=rank, ok=False, error=repr(e),
                            tb=traceback.format_exc()[-2000:]))
    gathered = [None] * EP
    dist.all_gather_object(gathered, results)
    if rank == 0:
        flat = [r for rs in gathered for r in rs]
        for r in flat:
            errs = " ".join(f"{k}={r[k]:.2e}" for k in ("y", "grad_x", "grad_scores", "grad_w13", "grad_w2") if k in r)
            tol = f"tol<={r['tol_max']:.1e} " if "tol_max" in r else ""
            print(f"{'PASS' if r['ok'] else 'FAIL'} rank{r['rank']} {r['case']:<40} {errs} {tol}"
                  f"{r.get('msg', '')}{r.get('error', '')}")
            if "tb" in r:
                print(r["tb"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(flat, f, indent=1)
        n_fail = sum(not r["ok"] for r in flat)
        print(f"{len(flat) - n_fail} passed, {n_fail} failed")
    ok = all(r["ok"] for rs in gathered for r in rs)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Ten-layer activation packing on the GPU (run under torchrun; 1 or 2 ranks).

    torchrun --nproc-per-node=2 tests/gpu/packing_check.py [--json out.json]

Ten layers with independent inputs and weights and a different routing imbalance per layer run
all forwards, then all backwards in reverse order, inside ONE captured CUDA graph; the graph is
replayed with changed routing. Checked for each slot budget ("fits": no replay; "tight": most
layers replay; "worst_rank": a budget where one rank alone would fit but the worst rank does not):
    - gradients (x, scores, w13, w2) of every layer against the fp64 oracle,
    - each layer's need_recompute flag against the planner run on the CPU with the same rows,
    - every slot cursor back at its start after the backwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import megatron_dist_moe as dm  # noqa: E402
from dist_check import compare, make_problem  # noqa: E402
from megatron_dist_moe.planner import PlannerState, plan_forward  # noqa: E402

L = 10


def layer_problem(cfg, EP, T, layer, replay_round):
    shift = 2 if replay_round == 2 else 0     # rounds 0/1: layer 0 is hot_rank (all to rank 0)
    routing = ("hot_rank", "random", "hot_expert", "inactive")[(layer + shift) % 4]
    return make_problem(cfg, EP, T, seed=1000 * replay_round + layer, routing=routing)


def rows_per_rank(prob, E_loc, EP):
    ids = prob["ids"].reshape(-1).to(torch.int64).cpu()
    ids = ids[ids >= 0]
    return torch.bincount(ids // E_loc, minlength=EP)


def expected_flags(cfg, plan, probs, E_loc, EP, rank):
    st = PlannerState.create(plan, "cpu")
    st.select(0, L)
    return [bool(plan_forward(st, rows_per_rank(p, E_loc, EP), rank, plan).need_recompute)
            for p in probs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--save-route-outputs", default="0", choices=["0", "1"],
                    help="Config.save_route_outputs (0: score gradients on the expert side)")
    ap.add_argument("--precisions", default="bf16,fp8_block,mxfp8")
    ap.add_argument("--pipelines", default="standard,mega",
                    help="each (precision, pipeline) the CUDA backend runs (execution.RUNS)")
    args = ap.parse_args()
    rank, EP = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    T, D, F, K, E_loc = 128, 256, 256, 4, 4
    results = []
    from megatron_dist_moe.execution import runs
    for precision in args.precisions.split(","):
        for pipeline in args.pipelines.split(","):
            if runs("cuda", precision, pipeline):
                run_precision(precision, args, rank, EP, dev, T, D, F, K, E_loc, results,
                              pipeline)
            elif rank == 0:
                print(f"SKIP {precision} {pipeline}: the CUDA backend does not run it")
    gathered = [None] * EP
    dist.all_gather_object(gathered, results)
    flat = [r for rs in gathered for r in rs]
    if rank == 0:
        for r in flat:
            print(f"{'PASS' if r['ok'] else 'FAIL'} rank{r['rank']} {r['case']:<28} flags={r['flags']} "
                  f"expected={r['expected']} worst_err={r['worst_rel_err']:.2e} cursors_ok={r['cursors_ok']}")
        n_fail = sum(not r["ok"] for r in flat)
        print(f"{len(flat) - n_fail} passed, {n_fail} failed")
        if args.json:
            json.dump(flat, open(args.json, "w"), indent=1)
    ok = all(r["ok"] for r in flat)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


def run_precision(precision, args, rank, EP, dev, T, D, F, K, E_loc, results,
                  pipeline="standard"):
    base = dm.Config(precision=precision, pipeline=pipeline, num_local_input_tokens=T,
                     hidden_dim=D, intermediate_dim=F, top_k=K,
                     num_experts=E_loc * EP, backend="cuda", max_moe_layers_per_activation_slot=L,
                     device_scratch_capacity_factor=float(EP), wgrad_dtype="fp32",
                     save_route_outputs=args.save_route_outputs == "1")
    plan0 = dm.plan_memory(base, EP)
    budgets = {"fits": dict(activation_slot_capacity_factor=float(EP) * 1.2),
               "tight": dict(activation_slot_capacity_factor=0.3)}
    if EP > 1:
        # worst_rank: the first replayed round's layer 0 would fit on its lightest rank but not
        # on its hottest, so every rank must replay it.
        rows0 = rows_per_rank(layer_problem(base, EP, T, 0, 1), E_loc, EP)
        lo, hi = (plan0.layer.full_state(int(v)) for v in (rows0.min(), rows0.max()))
        reserve = (L - 1) * plan0.input_bytes
        budgets["worst_rank"] = dict(activation_slot_bytes=(lo + hi) // 2 + reserve)
    sl = slice(rank * E_loc, (rank + 1) * E_loc)
    for name, extra in budgets.items():
        cfg = base.replace(**extra)
        plan = dm.plan_memory(cfg, EP)
        with dm.create_context(config=cfg, device=dev) as ctx:
            probs = [layer_problem(cfg, EP, T, l, 0) for l in range(L)]
            xs = [p["x"][rank].clone().requires_grad_() for p in probs]
            ss = [p["s"][rank].clone().requires_grad_() for p in probs]
            ids = [p["ids"][rank].clone() for p in probs]
            gys = [p["gy"][rank].clone() for p in probs]
            w13s = [p["w13"][sl].clone().requires_grad_() for p in probs]
            w2s = [p["w2"][sl].clone().requires_grad_() for p in probs]

            def step():
                ctx.select_activation_slot(0, L)
                ys = [dm.routed_experts(xs[l], ids[l], ss[l], w13s[l], w2s[l], ctx)
                      for l in range(L)]
                grads = [None] * L
                for l in reversed(range(L)):
                    grads[l] = torch.autograd.grad(ys[l], (xs[l], ss[l], w13s[l], w2s[l]), gys[l])
                return ys, grads

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            dist.barrier()
            ctx.backend.decision_trace = []
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ys, grads = step()
            trace = ctx.backend.decision_trace
            ctx.backend.decision_trace = None
            for rnd in (1, 2):
                probs = [layer_problem(cfg, EP, T, l, rnd) for l in range(L)]
                with torch.no_grad():
                    for l, p in enumerate(probs):
                        xs[l].copy_(p["x"][rank]); ss[l].copy_(p["s"][rank])
                        ids[l].copy_(p["ids"][rank]); gys[l].copy_(p["gy"][rank])
                        w13s[l].copy_(p["w13"][sl]); w2s[l].copy_(p["w2"][sl])
                g.replay()
                torch.cuda.synchronize()
                flags = [bool(t) for t in trace]
                want = expected_flags(cfg, plan, probs, E_loc, EP, rank)
                worst_err, ok = 0.0, flags == want
                for l in range(L):
                    got = (ys[l],) + tuple(grads[l])
                    errs, tols = compare(got, probs[l], cfg, rank, sl)
                    ok &= all(errs[k] <= tols[k] for k in errs)
                    worst_err = max(worst_err, max(errs.values()))
                st = ctx.planner
                cursors_ok = (st.buffer_offsets.cpu().tolist() == plan.slot_ends()
                              and int(st.saved_bytes.abs().sum()) == 0
                              and int(st.layer_position.abs().sum()) == 0)
                ok &= cursors_ok
                tag = precision if pipeline == "standard" else f"{precision}_{pipeline}"
                results.append(dict(case=f"{tag}_{name}_replay{rnd}", rank=rank, ok=bool(ok),
                                    flags="".join("R" if f else "S" for f in flags),
                                    expected="".join("R" if f else "S" for f in want),
                                    worst_rel_err=worst_err, cursors_ok=cursors_ok))
            del g


if __name__ == "__main__":
    main()

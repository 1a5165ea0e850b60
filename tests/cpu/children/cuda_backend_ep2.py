"""Child of tests/cpu/test_cuda_backend_ep2_cpu_interp.py: CudaBackend on two ranks (threads of
one process) in the Triton interpreter. Prints one `RESULT <json>` line per case."""

import json
import torch
import megatron_dist_moe as dm
from megatron_dist_moe import testing as tt
import cuda_cpu_harness as H

H.install()
EP = 2
LAYERS = 3
shape = dict(num_local_input_tokens=16, hidden_dim=64, intermediate_dim=64, top_k=2,
             num_experts=4, backend="reference", max_moe_layers_per_activation_slot=LAYERS)


def slot_bytes(**kw):
    """Worst rank: the first layer keeps, the later ones replay (the hot rank gets up to all
    2*16*2 routes)."""
    p0 = dm.plan_memory(dm.Config(**shape, **kw), ep_size=EP)
    return 2 * p0.input_bytes + p0.layer.full_state(2 * 16 * 2)


def train_rank(group, cfg, problems, overrides):
    be = H.make_backend(cfg, group, overrides)
    out = H.run_layers(be, problems, group.rank)
    group.wait()          # no rank frees its buffers while the other may still read them
    be.close()
    return out


def run(variant, seed):
    kw = variant.get("cfg", {})
    cfg = dm.Config(**shape, **kw, activation_slot_bytes=slot_bytes(**kw),
                    pipeline=variant["pipeline"], activation=variant.get("activation", "swiglu"))
    problems = [tt.make_problem(cfg, EP, seed=seed + i, dtype=torch.bfloat16,
                                routing=("one_rank" if i == 0 else "hot_expert"))
                for i in range(LAYERS)]
    oracles = [tt.oracle_results(p, cfg) for p in problems]
    out = H.run_ranks(EP, train_rank, cfg, problems, variant["overrides"])
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise RuntimeError("\n".join(errors))
    errs = [[tt.rank_errors(out[r]["results"][i], oracles[i], problems[i], r)
             for i in range(LAYERS)] for r in range(EP)]
    return dict(errors=errs, needs=[o["needs"] for o in out],
                cursors_back=[o["cursors_back"] for o in out])


def rejected_rank(group, cfg, problem, overrides):
    """Rank 1's own validation fails (check_collective with its error); rank 0 runs forward."""
    try:
        be = H.make_backend(cfg, group, overrides)
        x, ids, scores, w13, w2 = H.rank_inputs(problem, group.rank)
        if group.rank == 1:
            be.check_collective(x, ValueError("expert_ids: bad on rank 1"))
        else:
            be.check_collective(x, None)
            be.forward(x, ids, scores, w13, w2, training=False)
        return dict(returned=True)
    except BaseException as ex:
        return dict(raised=f"{type(ex).__name__}: {ex}"[:500])


def run_two_ranks(worker, routing, seed):
    """`worker` on both ranks (torch GEMMs, the given routing tables): each rank's result."""
    cfg = dm.Config(**shape, activation_slot_bytes=slot_bytes())
    problem = tt.make_problem(cfg, EP, seed=seed, dtype=torch.bfloat16)
    out = H.run_ranks(EP, worker, cfg, problem, {"gemm_engine": "torch", "routing": routing},
                      timeout_s=120)
    return dict(rank0=out[0], rank1=out[1])


def schedule_rank(group, cfg, problem, overrides):
    """Training forwards after different slot selections (rank 0 plans 2 layers, rank 1 one):
    the routing check traps on both ranks (in the interpreter: prints, then raises), naming the
    peer's schedule word, instead of letting their planners decide differently."""
    try:
        be = H.make_backend(cfg, group, overrides)
        be.ctx.planner.select(0, 2 if group.rank == 0 else 1)
        be.forward(*H.rank_inputs(problem, group.rank), training=True)
        return dict(returned=True)
    except BaseException as ex:
        return dict(raised=f"{type(ex).__name__}: {ex}"[:500])


VARIANTS = {
    # torch routing tables and bookkeeping (the oracles of the Triton defaults) over two ranks
    "torch_gemm,torch_tables": dict(overrides={"gemm_engine": "torch", "routing": "torch",
                                               "bookkeeping": "torch"}, pipeline="standard"),
    "triton_gemm,standard,clamped": dict(overrides={}, pipeline="standard",
                                         activation="swiglu_clamped"),
    "triton_gemm,staged,saved_routes": dict(overrides={}, pipeline="staged",
                                            cfg=dict(save_route_outputs=True)),
    # score gradients summed on the expert side, stored into the other rank's routing region
    "expert_score_grads,triton_gemm,standard": dict(
        overrides={}, pipeline="standard", cfg=dict(save_route_outputs=False)),
    "torch_gemm,torch_tables,saved_routes": dict(
        overrides={"gemm_engine": "torch", "routing": "torch"}, pipeline="standard",
        cfg=dict(save_route_outputs=True)),
}

if __name__ == "__main__":
    for routing in ("torch", "triton"):
        for name, worker, seed in (("rejected", rejected_rank, 5), ("schedule", schedule_rank, 6)):
            res = dict(name=f"{name},{routing}_routing", ok=True,
                       **run_two_ranks(worker, routing, seed))
            print("RESULT " + json.dumps(res), flush=True)

    for v, (name, variant) in enumerate(VARIANTS.items()):
        try:
            res = dict(name=name, ok=True, **run(variant, 70 + 10 * v))
        except Exception as ex:
            res = dict(name=name, ok=False, error=f"{type(ex).__name__}: {ex}"[-3000:])
        print("RESULT " + json.dumps(res), flush=True)

"""The CUDA backend at EP=2 on CPU: two ranks as two threads of one process, Triton interpreter.

Both ranks live in one address space, so a "peer pointer" is just the other rank's buffer
(tests/cpu/cuda_cpu_harness.py: symmetric memory and device barriers stood in for by the
thread group, interpreted kernels one at a time). What this adds to
test_cuda_backend_cpu_interp.py (one rank): routing tables over two sources, peer gathers, W2 stores into the other rank's combine buffer, route input
gradients returned into the other rank's dispatch buffer, weight gradients landing on the owner,
and the worst-rank save/replay rule with different row counts per rank (one rank receives most
routes). Still not covered here: real concurrency, NVLink, TMA hardware, CUDA graphs (GPU tests).

Each variant runs three layers forward (keep / replay / replay on the worst rank) and backward
in reverse order on both ranks; every result must be within the bf16 bound of the fp64 oracle.
"""

from __future__ import annotations

import os

import pytest

from megatron_dist_moe import testing as tt

HERE = os.path.dirname(os.path.abspath(__file__))
BF16_TOL = 2e-2

CHILD = r'''
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


def train_rank(group, cfg, problems):
    be = H.make_backend(cfg, group)
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
    with H.variant_env(variant["env"]):
        out = H.run_ranks(EP, train_rank, cfg, problems)
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise RuntimeError("\n".join(errors))
    errs = [[tt.rank_errors(out[r]["results"][i], oracles[i], problems[i], r)
             for i in range(LAYERS)] for r in range(EP)]
    return dict(errors=errs, needs=[o["needs"] for o in out],
                cursors_back=[o["cursors_back"] for o in out])


def rejected_rank(group, cfg, problem):
    """Rank 1's own validation fails (check_collective with its error); rank 0 runs forward."""
    try:
        be = H.make_backend(cfg, group)
        x, ids, scores, w13, w2 = H.rank_inputs(problem, group.rank)
        if group.rank == 1:
            be.check_collective(x, ValueError("expert_ids: bad on rank 1"))
        else:
            be.check_collective(x, None)
            be.forward(x, ids, scores, w13, w2, training=False)
        return dict(returned=True)
    except BaseException as ex:
        return dict(raised=f"{type(ex).__name__}: {ex}"[:500])


def run_rejected(routing):
    cfg = dm.Config(**shape, activation_slot_bytes=slot_bytes())
    problem = tt.make_problem(cfg, EP, seed=5, dtype=torch.bfloat16)
    with H.variant_env({"DIST_MOE_GEMM": "torch", "DIST_MOE_ROUTING": routing}):
        out = H.run_ranks(EP, rejected_rank, cfg, problem, timeout_s=120)
    return dict(rank0=out[0], rank1=out[1])


VARIANTS = {
    # torch routing tables and bookkeeping (the oracles of the Triton defaults) over two ranks
    "torch_gemm,torch_tables": dict(env={"DIST_MOE_GEMM": "torch", "DIST_MOE_ROUTING": "torch",
                                         "DIST_MOE_BOOKKEEPING": "torch"}, pipeline="standard"),
    "triton_gemm,standard,clamped": dict(env={"DIST_MOE_GEMM": "triton"}, pipeline="standard",
                                         activation="swiglu_clamped"),
    "triton_gemm,staged,claim_slice_16,saved_routes": dict(
        env={"DIST_MOE_GEMM": "triton", "DIST_MOE_CLAIM_SLICE_K": "16"}, pipeline="staged",
        cfg=dict(save_route_outputs=True)),
    # score gradients summed on the expert side, stored into the other rank's routing region
    "expert_score_grads,triton_gemm,standard": dict(
        env={"DIST_MOE_GEMM": "triton"}, pipeline="standard",
        cfg=dict(save_route_outputs=False)),
    # one peer read per route (DIST_MOE_GATHER_FANOUT=0; the default fans each token row out)
    "row_gather,triton_gemm,standard": dict(
        env={"DIST_MOE_GEMM": "triton", "DIST_MOE_GATHER_FANOUT": "0"}, pipeline="standard"),
    "row_gather,torch_gemm,torch_tables,saved_routes": dict(
        env={"DIST_MOE_GEMM": "torch", "DIST_MOE_ROUTING": "torch", "DIST_MOE_GATHER_FANOUT": "0"},
        pipeline="standard", cfg=dict(save_route_outputs=True)),
}

for routing in ("torch", "triton"):
    res = dict(name=f"rejected,{routing}_routing", ok=True, **run_rejected(routing))
    print("RESULT " + json.dumps(res), flush=True)

for v, (name, variant) in enumerate(VARIANTS.items()):
    try:
        res = dict(name=name, ok=True, **run(variant, 70 + 10 * v))
    except Exception as ex:
        res = dict(name=name, ok=False, error=f"{type(ex).__name__}: {ex}"[-3000:])
    print("RESULT " + json.dumps(res), flush=True)
'''

NAMES = ["torch_gemm,torch_tables", "triton_gemm,standard,clamped",
         "triton_gemm,staged,claim_slice_16,saved_routes", "expert_score_grads,triton_gemm,standard",
         "row_gather,triton_gemm,standard", "row_gather,torch_gemm,torch_tables,saved_routes"]


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    out, stdout = tt.run_child_checks(["-c", CHILD], timeout_s=600, paths=(HERE,))
    return dict(out, stdout=stdout)


@pytest.mark.parametrize("routing", ["torch", "triton"])
def test_a_rank_with_bad_input_makes_its_peer_trap_instead_of_hang(results, routing):
    """Rank 1's validation fails: it meets rank 0 at the first device barrier with T = -1 in its
    header and returns (ops then raises its own error); rank 0's routing check traps (in the
    interpreter: prints the trap message, then raises) naming rank 1 instead of waiting."""
    r = results.get(f"rejected,{routing}_routing")
    assert r is not None, "no result"
    assert r["rank1"] == {"returned": True}, r["rank1"]
    assert "raised" in r["rank0"], f"rank 0 did not trap: {r['rank0']}"
    assert "a peer rank rejected its inputs" in results["stdout"]


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_match_oracle(results, name):
    r = results.get(name)
    assert r is not None, f"{name}: no result"
    assert r["ok"], f"{name}: {r['error']}"
    for rank, layers in enumerate(r["errors"]):
        for layer, errs in enumerate(layers):
            for k, e in errs.items():
                assert e < BF16_TOL, f"{name}: rank {rank} layer {layer} {k} error {e:.3e}"
    assert all(r["cursors_back"]), "slot cursors did not return to their start"
    # the worst-rank rule: both ranks take the same decisions; keep, then replay
    assert r["needs"][0] == r["needs"][1] == [False, True, True], r["needs"]

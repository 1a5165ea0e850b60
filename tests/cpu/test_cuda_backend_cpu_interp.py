"""The CUDA backend end to end on CPU: one rank, Triton interpreter.

What runs for real: SymmetricBuffers' layout (behind the stand-in for symmetric memory of
tests/cpu/cuda_cpu_harness.py, with one rank), the routing tables and per-call bookkeeping (torch and Triton versions), the planner's
save/replay decisions and slot cursors, ExpertPipeline with both GEMM engines (our Triton GEMMs
with fp32 products in the interpreter) and both pipelines (staged: claimed gathers, whole
m-tiles and slices), the fused SwiGLU-backward epilogue, every row kernel, and
CudaBackend.forward / backward including the replay path. What does not: concurrency between
programs and streams (the interpreter runs programs one after another; the side-stream WGRAD
needs CUDA), peer memory and device barriers (EP=1), TMA hardware. Those are the GPU tests'.

Three layers share one slot sized so that the first keeps its state and the later ones
replay; all run forward, then backward in reverse order, for each variant below (each with its
own inputs, so memory freed by a previous variant cannot hold the right values). Every output
and gradient must be within the bf16 bound of the fp64 oracle (2e-2, as the reference
backend's tests), the decisions must be keep / replay / replay, and the cursors must come back.
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
LAYERS = 3
shape = dict(num_local_input_tokens=24, hidden_dim=128, intermediate_dim=128, top_k=2,
             num_experts=4, backend="reference", max_moe_layers_per_activation_slot=LAYERS)


def run(variant, seed):
    kw = variant.get("cfg", {})
    p_kw = dm.plan_memory(dm.Config(**shape, **kw), ep_size=1)
    slot = 2 * p_kw.input_bytes + p_kw.layer.full_state(48)   # keep / replay / replay again
    cfg = dm.Config(**shape, **kw, activation_slot_bytes=slot, pipeline=variant["pipeline"],
                    activation=variant.get("activation", "swiglu"))
    # new inputs per variant: memory a previous backend freed cannot hold this one's values
    problems = [tt.make_problem(cfg, 1, seed=seed + i, dtype=torch.bfloat16,
                                routing="random" if i != 1 else "hot_expert")
                for i in range(LAYERS)]
    oracles = [tt.oracle_results(p, cfg) for p in problems]
    with H.variant_env(variant["env"]):
        be = H.make_backend(cfg, H.ThreadGroup(0, H.new_shared(1)))
        out = H.run_layers(be, problems, 0, wgrad_into=variant.get("wgrad_into", False),
                           offset_views=variant.get("offset_views", False))
        y_inf, none = be.forward(*H.rank_inputs(problems[0], 0), training=False)
        be.close()
    errs = [tt.rank_errors(o, orc, p, 0) for o, orc, p in zip(out["results"], oracles, problems)]
    return dict(errors=errs, inference_error=tt.relative_error(y_inf, oracles[0]["y"]),
                saved_none=none is None, needs=out["needs"], cursors_back=out["cursors_back"])


TORCH = {"DIST_MOE_GEMM": "torch"}
TRITON = {"DIST_MOE_GEMM": "triton"}
# The defaults are Triton routing tables and bookkeeping, the fused SwiGLU backward and 512-wide
# claim slices; the torch twins and the unfused / whole-tile forms stay covered here.
TORCH_TABLES = {"DIST_MOE_ROUTING": "torch", "DIST_MOE_BOOKKEEPING": "torch"}
VARIANTS = {
    "torch_gemm": dict(env=dict(TORCH), pipeline="standard"),
    "torch_gemm,torch_routing,torch_bookkeeping,saved_routes": dict(
        env={**TORCH, **TORCH_TABLES}, pipeline="standard", cfg=dict(save_route_outputs=True)),
    "triton_gemm,standard": dict(env=dict(TRITON), pipeline="standard"),
    "triton_gemm,standard,unfused_swiglu_bwd,clamped,saved_routes": dict(
        env={**TRITON, "DIST_MOE_FUSE_SWIGLU_BWD": "0"}, pipeline="standard",
        activation="swiglu_clamped", cfg=dict(save_route_outputs=True)),
    "triton_gemm,staged,whole_tile_claims,torch_tables,saved_routes": dict(
        env={**TRITON, **TORCH_TABLES, "DIST_MOE_CLAIM_SLICE_K": "0"}, pipeline="staged",
        cfg=dict(save_route_outputs=True)),
    "triton_gemm,staged,claim_slice_32": dict(
        env={**TRITON, "DIST_MOE_CLAIM_SLICE_K": "32"}, pipeline="staged"),
    # Config.save_route_outputs=False (the default; "saved_routes" above is True): score
    # gradients on the expert side (fused epilogue, the row kernel of the unfused path, and the
    # torch GEMM engine)
    "expert_score_grads,triton_gemm,staged": dict(
        env=dict(TRITON), pipeline="staged", cfg=dict(save_route_outputs=False)),
    "expert_score_grads,triton_gemm,standard,unfused_swiglu_bwd,clamped": dict(
        env={**TRITON, "DIST_MOE_FUSE_SWIGLU_BWD": "0"}, pipeline="standard",
        activation="swiglu_clamped", cfg=dict(save_route_outputs=False)),
    "expert_score_grads,torch_gemm": dict(env=dict(TORCH), pipeline="standard",
                                          cfg=dict(save_route_outputs=False)),
    # one peer read per route (DIST_MOE_GATHER_FANOUT=0; the default reads each token row once)
    "row_gather,triton_gemm,standard": dict(
        env={**TRITON, "DIST_MOE_GATHER_FANOUT": "0"}, pipeline="standard"),
    "row_gather,torch_gemm,torch_tables,saved_routes": dict(
        env={**TORCH, **TORCH_TABLES, "DIST_MOE_GATHER_FANOUT": "0"}, pipeline="standard",
        cfg=dict(save_route_outputs=True)),
    # weight gradients added into fp32 per-expert accumulators (routed_experts(wgrad_into=...))
    "wgrad_into,triton_gemm,standard": dict(env=dict(TRITON), pipeline="standard",
                                            wgrad_into=True),
    "wgrad_into,torch_gemm": dict(env=dict(TORCH), pipeline="standard", wgrad_into=True),
    # weights as views at a storage offset (the Megatron plugin's packed weights)
    "offset_weight_views,triton_gemm,staged": dict(env=dict(TRITON), pipeline="staged",
                                                   offset_views=True),
}
for v, (name, variant) in enumerate(VARIANTS.items()):
    try:
        out = dict(name=name, ok=True, **run(variant, 50 + 10 * v))
    except Exception as ex:
        import traceback
        out = dict(name=name, ok=False, error=f"{type(ex).__name__}: {ex}",
                   trace=traceback.format_exc()[-3000:])
    print("RESULT " + json.dumps(out), flush=True)
'''

NAMES = ["torch_gemm", "torch_gemm,torch_routing,torch_bookkeeping,saved_routes",
         "triton_gemm,standard", "triton_gemm,standard,unfused_swiglu_bwd,clamped,saved_routes",
         "triton_gemm,staged,whole_tile_claims,torch_tables,saved_routes",
         "triton_gemm,staged,claim_slice_32",
         "expert_score_grads,triton_gemm,staged",
         "expert_score_grads,triton_gemm,standard,unfused_swiglu_bwd,clamped",
         "expert_score_grads,torch_gemm", "row_gather,triton_gemm,standard",
         "row_gather,torch_gemm,torch_tables,saved_routes", "wgrad_into,triton_gemm,standard",
         "wgrad_into,torch_gemm", "offset_weight_views,triton_gemm,staged"]


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    return tt.run_child_checks(["-c", CHILD], timeout_s=900, paths=(HERE,))[0]


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_match_oracle(results, name):
    r = results.get(name)
    assert r is not None, f"{name}: no result"
    assert r["ok"], f"{name}: {r['error']}\n{r['trace']}"
    for layer, errs in enumerate(r["errors"]):
        for k, e in errs.items():
            assert e < BF16_TOL, f"{name}: layer {layer} {k} relative error {e:.3e}"
    assert r["inference_error"] < BF16_TOL
    assert r["saved_none"], "an inference forward must keep no saved state"
    assert r["cursors_back"], "slot cursors did not return to their start"


def test_every_variant_keeps_the_first_layer_and_replays_the_rest(results):
    needs = {n: results[n].get("needs") for n in NAMES if results.get(n, {}).get("ok")}
    assert len(needs) == len(NAMES), "a variant failed (see its own test)"
    # each variant has its own inputs; the slot is sized so that the decisions do not depend
    # on them: the first layer keeps its state, the later ones replay
    for n, v in needs.items():
        assert v == [False, True, True], f"{n}: {v}"

"""The CUDA backend end to end on CPU: one rank, Triton interpreter.

What runs for real: SymmetricBuffers' layout (behind a single-rank stand-in for symmetric
memory), the routing tables and per-call bookkeeping (torch and Triton versions), the planner's
save/replay decisions and slot cursors, ExpertPipeline with both GEMM engines (our Triton GEMMs
with fp32 products in the interpreter) and both pipelines (staged: claimed gathers, whole
m-tiles and slices), the fused SwiGLU-backward epilogue, every row kernel, and
CudaBackend.forward / backward including the replay path. What does not: concurrency between
programs and streams (the interpreter runs programs one after another; the side-stream WGRAD
needs CUDA), peer memory and device barriers (EP=1), TMA hardware. Those are the GPU tests'.

Three layers share one slot sized so that the first keeps its state and the later ones
replay; all run forward,
then backward in reverse order, for each variant below (each with its own inputs, so memory
freed by a previous variant cannot hold the right values). Every
output and gradient must be within the bf16 bound of the fp64 oracle (2e-2, as the reference
backend's tests), the decisions must be keep / replay / replay, and the cursors must come back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BF16_TOL = 2e-2

CHILD = r'''
import functools, json, math, os, tempfile, types
import torch
import torch.distributed as dist

os.environ["DIST_MOE_GEMM"] = "torch"
import megatron_dist_moe as dm
from megatron_dist_moe import testing as tt
from megatron_dist_moe.planner import PlannerState
import megatron_dist_moe.backends.cuda as cb
from megatron_dist_moe.backends.cuda import symmetric as sy


class LocalHandle:
    """Single-rank stand-in for a torch symmetric-memory handle."""
    def __init__(self, buf):
        self.buf, self.buffer_ptrs = buf, [buf.data_ptr()]

    def get_buffer(self, rank, shape, dtype, offset):
        assert rank == 0
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.buf[offset:offset + n].view(dtype).view(shape)

    def barrier(self, channel=0):
        pass


def local_rendezvous(nbytes, group, device):
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return buf, LocalHandle(buf)


cb.SymmetricBuffers = functools.partial(sy.SymmetricBuffers, rendezvous=local_rendezvous)
d = tempfile.mkdtemp()
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "s"), 1), rank=0,
                        world_size=1)

LAYERS = 3
shape = dict(num_local_input_tokens=24, hidden_dim=128, intermediate_dim=128, top_k=2,
             num_experts=4, backend="reference", max_moe_layers_per_activation_slot=LAYERS)
# a slot where the first layer keeps its full state and the later ones must replay:
# 2 inputs + the largest full state (all 48 routes to this rank's experts)
p0 = dm.plan_memory(dm.Config(**shape), ep_size=1)
SLOT = 2 * p0.input_bytes + p0.layer.full_state(48)


def run(variant, seed):
    os.environ.update(variant["env"])
    from megatron_dist_moe.kernels import grouped_gemm as G
    G.CLAIM_SLICE_K = int(variant["env"].get("DIST_MOE_CLAIM_SLICE_K", "0"))
    cfg = dm.Config(**shape, activation_slot_bytes=SLOT, pipeline=variant["pipeline"],
                    activation=variant.get("activation", "swiglu"))
    plan = dm.plan_memory(cfg, ep_size=1)
    # new inputs per variant: memory a previous backend freed cannot hold this one's values
    problems = [tt.make_problem(cfg, 1, seed=seed + i, dtype=torch.bfloat16,
                                routing="random" if i != 1 else "hot_expert")
                for i in range(LAYERS)]
    oracles = [tt.oracle_results(p, cfg) for p in problems]
    ctx = types.SimpleNamespace(config=cfg, plan=plan, device=torch.device("cpu"),
                                group=dist.group.WORLD, rank=0, num_local_experts=4,
                                planner=PlannerState.create(plan, "cpu"))
    be = cb.CudaBackend(ctx)
    be.decision_trace = []
    start = ctx.planner.buffer_offsets.clone()
    ctx.planner.select(0, LAYERS)
    saved, outs = [], []
    for p in problems:
        w13 = p.w13.reshape(p.w13.shape[0], -1, p.w13.shape[-1]).contiguous()
        y, s = be.forward(p.x, p.ids, p.scores, w13, p.w2, training=True)
        saved.append(s)
        outs.append({"y": y})
    for i in reversed(range(LAYERS)):
        gx, gs, gw13, gw2 = be.backward(problems[i].grad_y, saved[i])
        outs[i].update(grad_x=gx, grad_scores=gs, grad_w13=gw13.reshape(problems[i].w13.shape),
                       grad_w2=gw2)
    errs = [tt.rank_errors(o, orc, p, 0) for o, orc, p in zip(outs, oracles, problems)]
    y_inf, none = be.forward(problems[0].x, problems[0].ids, problems[0].scores,
                             problems[0].w13.reshape(4, -1, 128).contiguous(), problems[0].w2,
                             training=False)
    inf_err = tt.relative_error(y_inf, oracles[0]["y"])
    res = dict(errors=errs, inference_error=inf_err, saved_none=none is None,
               needs=[bool(t) for t in be.decision_trace],
               cursors_back=bool(torch.equal(ctx.planner.buffer_offsets, start)))
    be.close()
    for k in variant["env"]:
        os.environ.pop(k)
    return res


TORCH = {"DIST_MOE_GEMM": "torch"}
TRITON = {"DIST_MOE_GEMM": "triton"}
FUSED = {"DIST_MOE_ROUTING": "triton", "DIST_MOE_BOOKKEEPING": "triton"}
VARIANTS = {
    "torch_gemm": dict(env=dict(TORCH), pipeline="standard"),
    "torch_gemm,triton_routing,triton_bookkeeping": dict(env={**TORCH, **FUSED},
                                                         pipeline="standard"),
    "triton_gemm,standard": dict(env=dict(TRITON), pipeline="standard"),
    "triton_gemm,standard,fused_swiglu_bwd,clamped": dict(
        env={**TRITON, "DIST_MOE_FUSE_SWIGLU_BWD": "1"}, pipeline="standard",
        activation="swiglu_clamped"),
    "triton_gemm,staged": dict(env=dict(TRITON), pipeline="staged"),
    "triton_gemm,staged,all_candidates": dict(
        env={**TRITON, **FUSED, "DIST_MOE_CLAIM_SLICE_K": "32", "DIST_MOE_FUSE_SWIGLU_BWD": "1"},
        pipeline="staged"),
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

NAMES = ["torch_gemm", "torch_gemm,triton_routing,triton_bookkeeping", "triton_gemm,standard",
         "triton_gemm,standard,fused_swiglu_bwd,clamped", "triton_gemm,staged",
         "triton_gemm,staged,all_candidates"]


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=900, cwd=REPO)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            out[r["name"]] = r
    if not out:
        pytest.fail(f"no results (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return out


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

"""The CUDA backend at EP=2 on CPU: two ranks as two threads of one process, Triton interpreter.

Both ranks live in one address space, so a "peer pointer" is just the other rank's buffer: the
stand-in for symmetric memory hands every rank all buffer addresses and implements the device
barrier with a threading.Barrier; interpreted kernels run one at a time (a lock; the interpreter
is not thread-safe). What this adds to test_cuda_backend_cpu_interp.py (one rank): routing tables
over two sources, peer gathers, W2 stores into the other rank's combine buffer, route input
gradients returned into the other rank's dispatch buffer, weight gradients landing on the owner,
and the worst-rank save/replay rule with different row counts per rank (one rank receives most
routes). Still not covered here: real concurrency, NVLink, TMA hardware, CUDA graphs (GPU tests).

Each variant runs three layers forward (keep / replay / replay on the worst rank) and backward
in reverse order on both ranks; every result must be within the bf16 bound of the fp64 oracle.
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
import functools, json, math, os, threading, types, traceback
import torch
import torch.distributed as dist
from triton.runtime import interpreter as TI

import megatron_dist_moe as dm
from megatron_dist_moe import testing as tt
from megatron_dist_moe.planner import PlannerState
import megatron_dist_moe.backends.cuda as cb
from megatron_dist_moe.backends.cuda import symmetric as sy

EP = 2
LOCK = threading.RLock()
_run = TI.InterpretedFunction.run


def _locked_run(self, *a, **k):
    with LOCK:   # released also when a kernel raises (an interpreted device trap)
        return _run(self, *a, **k)


TI.InterpretedFunction.run = _locked_run


class Group:
    """One rank's view of the EP group: its rank, the size, a shared thread barrier."""
    def __init__(self, rank, shared):
        self.rank, self.size, self.shared = rank, EP, shared
        self.group_name = "threads"

    def wait(self):
        self.shared["barrier"].wait()


# torch.distributed calls the backend makes, answered by the thread group
dist.get_rank = lambda group=None: group.rank
dist.get_world_size = lambda group=None: group.size
dist.barrier = lambda group=None: group.wait()


class Handle:
    def __init__(self, group, bufs):
        self.group, self.bufs = group, bufs
        self.buffer_ptrs = [b.data_ptr() for b in bufs]

    def get_buffer(self, rank, shape, dtype, offset):
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.bufs[rank][offset:offset + n].view(dtype).view(shape)

    def barrier(self, channel=0):
        self.group.wait()


def rendezvous(nbytes, group, device):
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    group.shared["bufs"][group.rank] = buf
    group.wait()
    return buf, Handle(group, list(group.shared["bufs"]))


cb.SymmetricBuffers = functools.partial(sy.SymmetricBuffers, rendezvous=rendezvous)

LAYERS = 3
shape = dict(num_local_input_tokens=16, hidden_dim=64, intermediate_dim=64, top_k=2,
             num_experts=4, backend="reference", max_moe_layers_per_activation_slot=LAYERS)
p0 = dm.plan_memory(dm.Config(**shape), ep_size=EP)
# worst rank: the first layer keeps, the later ones replay (hot rank gets up to all 2*16*2 routes)
SLOT = 2 * p0.input_bytes + p0.layer.full_state(2 * 16 * 2)


def rank_main(rank, shared, variant, problems, out):
    try:
        group = Group(rank, shared)
        cfg = shared["cfg"]
        plan = dm.plan_memory(cfg, ep_size=EP)
        ctx = types.SimpleNamespace(config=cfg, plan=plan, device=torch.device("cpu"),
                                    group=group, rank=rank, num_local_experts=2,
                                    planner=PlannerState.create(plan, "cpu"))
        be = cb.CudaBackend(ctx)
        be.decision_trace = []
        start = ctx.planner.buffer_offsets.clone()
        ctx.planner.select(0, LAYERS)
        saved, res = [], []
        for p in problems:
            tok, exp = p.tokens(rank), p.experts(rank)
            w13 = p.w13[exp].reshape(2, -1, p.w13.shape[-1]).contiguous()
            y, s = be.forward(p.x[tok].contiguous(), p.ids[tok].contiguous(),
                              p.scores[tok].contiguous(), w13, p.w2[exp].contiguous(),
                              training=True)
            saved.append(s)
            res.append({"y": y})
        for i in reversed(range(LAYERS)):
            p = problems[i]
            tok, exp = p.tokens(rank), p.experts(rank)
            gx, gs, gw13, gw2 = be.backward(p.grad_y[tok].contiguous(), saved[i])
            res[i].update(grad_x=gx, grad_scores=gs, grad_w13=gw13.reshape(p.w13[exp].shape),
                          grad_w2=gw2)
        out[rank] = dict(results=res, needs=[bool(t) for t in be.decision_trace],
                         cursors_back=bool(torch.equal(ctx.planner.buffer_offsets, start)))
        group.wait()          # no rank frees its buffers while the other may still read them
        be.close()
    except BaseException:
        out[rank] = dict(error=traceback.format_exc()[-3000:])
        shared["barrier"].abort()


def run(variant, seed):
    os.environ.update(variant["env"])
    from megatron_dist_moe.kernels import grouped_gemm as G
    G.CLAIM_SLICE_K = int(variant["env"].get("DIST_MOE_CLAIM_SLICE_K", "0"))
    cfg = dm.Config(**shape, activation_slot_bytes=SLOT, pipeline=variant["pipeline"],
                    activation=variant.get("activation", "swiglu"))
    problems = [tt.make_problem(cfg, EP, seed=seed + i, dtype=torch.bfloat16,
                                routing=("one_rank" if i == 0 else "hot_expert"))
                for i in range(LAYERS)]
    oracles = [tt.oracle_results(p, cfg) for p in problems]
    shared = dict(cfg=cfg, bufs=[None] * EP, barrier=threading.Barrier(EP, timeout=300))
    out = [None] * EP
    threads = [threading.Thread(target=rank_main, args=(r, shared, variant, problems, out))
               for r in range(EP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in variant["env"]:
        os.environ.pop(k)
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise RuntimeError("\n".join(errors))
    errs = [[tt.rank_errors(out[r]["results"][i], oracles[i], problems[i], r)
             for i in range(LAYERS)] for r in range(EP)]
    return dict(errors=errs, needs=[o["needs"] for o in out],
                cursors_back=[o["cursors_back"] for o in out])


VARIANTS = {
    "torch_gemm": dict(env={"DIST_MOE_GEMM": "torch"}, pipeline="standard"),
    "triton_gemm,standard,clamped": dict(env={"DIST_MOE_GEMM": "triton"}, pipeline="standard",
                                         activation="swiglu_clamped"),
    "triton_gemm,staged,all_candidates": dict(
        env={"DIST_MOE_GEMM": "triton", "DIST_MOE_ROUTING": "triton",
             "DIST_MOE_BOOKKEEPING": "triton", "DIST_MOE_CLAIM_SLICE_K": "16",
             "DIST_MOE_FUSE_SWIGLU_BWD": "1"}, pipeline="staged"),
}
def rejected_main(rank, shared, problem, out):
    """Rank 1's own validation fails (check_collective with its error); rank 0 runs forward."""
    try:
        group = Group(rank, shared)
        cfg = shared["cfg"]
        plan = dm.plan_memory(cfg, ep_size=EP)
        ctx = types.SimpleNamespace(config=cfg, plan=plan, device=torch.device("cpu"),
                                    group=group, rank=rank, num_local_experts=2,
                                    planner=PlannerState.create(plan, "cpu"))
        be = cb.CudaBackend(ctx)
        tok, exp = problem.tokens(rank), problem.experts(rank)
        if rank == 1:
            be.check_collective(problem.x[tok], ValueError("expert_ids: bad on rank 1"))
            out[rank] = dict(returned=True)
        else:
            be.check_collective(problem.x[tok], None)
            w13 = problem.w13[exp].reshape(2, -1, problem.w13.shape[-1]).contiguous()
            be.forward(problem.x[tok].contiguous(), problem.ids[tok].contiguous(),
                       problem.scores[tok].contiguous(), w13, problem.w2[exp].contiguous(),
                       training=False)
            out[rank] = dict(returned=True)
    except BaseException as ex:
        out[rank] = dict(raised=f"{type(ex).__name__}: {ex}"[:500])


def run_rejected(routing):
    os.environ.update({"DIST_MOE_GEMM": "torch", "DIST_MOE_ROUTING": routing})
    cfg = dm.Config(**shape, activation_slot_bytes=SLOT)
    problem = tt.make_problem(cfg, EP, seed=5, dtype=torch.bfloat16)
    shared = dict(cfg=cfg, bufs=[None] * EP, barrier=threading.Barrier(EP, timeout=120))
    out = [None] * EP
    threads = [threading.Thread(target=rejected_main, args=(r, shared, problem, out))
               for r in range(EP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.environ.pop("DIST_MOE_ROUTING")
    return dict(rank0=out[0], rank1=out[1])


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

NAMES = ["torch_gemm", "triton_gemm,standard,clamped", "triton_gemm,staged,all_candidates"]


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    out = {"stdout": proc.stdout}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            out[r["name"]] = r
    if not out:
        pytest.fail(f"no results (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return out


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

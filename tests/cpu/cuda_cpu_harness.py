"""Run the CUDA backend on CPU for the CPU tests: Triton interpreter, ranks as threads.

Every rank lives in this one process, so a "peer pointer" is just another rank's buffer: the
stand-in for torch symmetric memory (`rendezvous`) hands every rank all buffer addresses and
implements the device barrier with a threading.Barrier; `install()` also answers the few
torch.distributed calls the backend makes from the same thread group and runs interpreted
kernels one at a time (the interpreter is not thread-safe). One rank is the EP=1 case.

Import only in a process started with TRITON_INTERPRET=1 (see testing.run_child_checks).
"""

from __future__ import annotations

import functools
import math
import threading
import types

import torch
import torch.distributed as dist

import megatron_dist_moe as dm
import megatron_dist_moe.backends.cuda as cb
from megatron_dist_moe.backends.cuda import symmetric as sy
from megatron_dist_moe.execution import Execution, check_overrides
from megatron_dist_moe.planner import PlannerState
from megatron_dist_moe.weight_cache import WeightCache


class ThreadGroup:
    """One rank's view of the EP group: its rank, the size and what the ranks share."""

    group_name = "threads"

    def __init__(self, rank: int, shared: dict):
        self.rank, self.size, self.shared = rank, len(shared["bufs"]), shared

    def wait(self) -> None:
        self.shared["barrier"].wait()


def new_shared(size: int, timeout_s: float = 300) -> dict:
    return dict(bufs=[None] * size, barrier=threading.Barrier(size, timeout=timeout_s))


class Handle:
    """Stand-in for a torch symmetric-memory handle over the ranks' buffers."""

    def __init__(self, group: ThreadGroup, bufs: list[torch.Tensor]):
        self.group, self.bufs = group, bufs
        self.buffer_ptrs = [b.data_ptr() for b in bufs]

    def get_buffer(self, rank, shape, dtype, offset):
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.bufs[rank][offset:offset + n].view(dtype).view(shape)

    def barrier(self, channel=0, timeout_ms=0):
        self.group.wait()


def rendezvous(nbytes: int, group: ThreadGroup, device):
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    group.shared["bufs"][group.rank] = buf
    group.wait()
    return buf, Handle(group, list(group.shared["bufs"]))


def install() -> None:
    from triton.runtime import interpreter as TI

    lock = threading.RLock()
    run = TI.InterpretedFunction.run

    def locked_run(self, *a, **k):
        with lock:   # released also when a kernel raises (an interpreted device trap)
            return run(self, *a, **k)

    TI.InterpretedFunction.run = locked_run
    dist.get_rank = lambda group=None: group.rank
    dist.get_world_size = lambda group=None: group.size
    dist.barrier = lambda group=None: group.wait()
    cb.SymmetricBuffers = functools.partial(sy.SymmetricBuffers, rendezvous=rendezvous)


def make_backend(cfg: dm.Config, group: ThreadGroup,
                 overrides: dict | None = None) -> cb.CudaBackend:
    """A CudaBackend on CPU for `cfg` (whose backend field says "reference": CPU tensors), with
    execution overrides selecting the torch twins (execution.OVERRIDES)."""
    plan = dm.plan_memory(cfg, ep_size=group.size)
    ctx = types.SimpleNamespace(config=cfg, plan=plan, device=torch.device("cpu"), group=group,
                                rank=group.rank, ep_size=group.size,
                                num_local_experts=cfg.num_local_experts(group.size),
                                planner=PlannerState.create(plan, "cpu"),
                                weight_cache=WeightCache(cfg.precision))
    chosen = check_overrides(overrides or {}, "variant")
    if cfg.precision in ("fp8_block", "mxfp8"):   # Execution.resolve's defaults
        chosen.setdefault("fp8_gather", "quantizer" if group.size == 1 else "fanout")
    if cfg.precision == "fp8_block":
        chosen.setdefault("fp8_combine", "pull" if group.size == 1
                          and not cfg.save_route_outputs else "scatter")
    execution = Execution(backend="cuda", precision=cfg.precision,
                          pipeline=cfg.pipeline,
                          inference=cfg.inference, save_route_outputs=cfg.save_route_outputs,
                          wait_timeout_s=cfg.wait_timeout_s, **chosen)
    return cb.CudaBackend(ctx, execution)


def rank_inputs(p, rank: int, offset_views: bool = False):
    """(x, ids, scores, w13 [E_local, 2F, D], w2) of one rank from a testing.Problem.
    offset_views: w13 and w2 are views at a non-zero storage offset (an extra expert of 7s in
    front), as the Megatron plugin passes its packed weights."""
    tok, exp = p.tokens(rank), p.experts(rank)
    w13 = p.w13[exp].reshape(p.w13[exp].shape[0], -1, p.w13.shape[-1]).contiguous()
    w2 = p.w2[exp].contiguous()
    if offset_views:
        w13, w2 = (torch.cat([torch.full_like(w[:1], 7), w])[1:] for w in (w13, w2))
    return (p.x[tok].contiguous(), p.ids[tok].contiguous(), p.scores[tok].contiguous(), w13, w2)


def run_layers(be: cb.CudaBackend, problems: list, rank: int, wgrad_into: bool = False,
               offset_views: bool = False) -> dict:
    """All layers' training forwards in one slot, then their backwards in reverse order.
    Returns this rank's results per layer, the planner's decisions and whether the slot
    cursors came back to their start. wgrad_into: each layer's weight gradients are added into
    fp32 per-expert accumulators holding small integers (routed_experts(wgrad_into=...)); the
    gradients reported are (after - before), and the backend must return None for them.
    offset_views: the weights are passed as views at a storage offset (rank_inputs)."""
    planner = be.ctx.planner
    be.decision_trace = []
    start = planner.buffer_offsets.clone()
    planner.select(0, len(problems))
    saved, results = [], []
    starts = []
    for p in problems:
        y, s = be.forward(*rank_inputs(p, rank, offset_views), training=True)
        if wgrad_into:
            w13, w2 = rank_inputs(p, rank)[3:]
            g = torch.Generator().manual_seed(7 + len(starts))
            init = [[torch.randint(-3, 4, w.shape[1:], generator=g).float()
                     for _ in range(w.shape[0])] for w in (w13, w2)]
            s.wgrad_into = tuple([t.clone() for t in ts] for ts in init)
            starts.append(init)
        saved.append(s)
        results.append({"y": y})
    for i in reversed(range(len(problems))):
        p = problems[i]
        gx, gs, gw13, gw2 = be.backward(p.grad_y[p.tokens(rank)].contiguous(), saved[i])
        if wgrad_into:
            assert gw13 is None and gw2 is None, "wgrad_into: the backend returned weight grads"
            gw13, gw2 = (torch.stack([a.double() - b.double() for a, b in zip(accs, st)])
                         for accs, st in zip(saved[i].wgrad_into, starts[i]))
        results[i].update(grad_x=gx, grad_scores=gs,
                          grad_w13=gw13.reshape(p.w13[p.experts(rank)].shape), grad_w2=gw2)
    return dict(results=results, needs=[bool(t) for t in be.decision_trace],
                cursors_back=bool(torch.equal(planner.buffer_offsets, start)))


def run_ranks(size: int, fn, *args, timeout_s: float = 300) -> list:
    """fn(group, *args) on `size` rank threads; each rank's return value, or
    {"error": traceback} for a rank that raised (the barrier is broken so none waits)."""
    import traceback

    shared = new_shared(size, timeout_s)
    out = [None] * size

    def main(rank):
        try:
            out[rank] = fn(ThreadGroup(rank, shared), *args)
        except BaseException:
            out[rank] = {"error": traceback.format_exc()[-3000:]}
            shared["barrier"].abort()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out

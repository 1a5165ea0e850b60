"""Inference at the design guide's expert shapes, eager and in a CUDA graph, inside its arena.

    torchrun --nproc-per-node=N tests/gpu/inference_check.py [--tokens 1,8,64,...] [--json OUT]

Per rank: D=7168, F=3072, K=6, 6 local experts, Config(inference=True) with the device scratch
factors 1 and 2, for T in {1, 8, 64, 96, 128, 512, 2048, 4096}: one eager forward under
torch.no_grad, then the same forward captured in a CUDA graph and replayed with new inputs and
routing at the same addresses, for every (precision, pipeline) the CUDA backend runs
(--precisions, --pipelines). Each y
is compared with an fp64 oracle of the whole EP problem (tolerance: 2x the error of the same
math at the precision's rounding points: bf16 stores, floored at 6e-3, or the block-scaled
quantization emulated in torch, testing.block_quant_emulation). A context that trained first
(forward + backward) then serves an inference call at T=512.

Canary: every arena is allocated with 1 MiB guard regions on both sides filled with a byte
pattern (a test-only DeviceArena); after every call the guards must be intact, and the arena
starts poisoned (0xFF: NaN in bf16) so a read of a byte nobody wrote shows up as NaN.
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
import megatron_dist_moe.backends.cuda.arena as arena_mod

D, F, K, E_LOCAL = 7168, 3072, 6, 6
GUARD = 1 << 20
PATTERN = 0xA5
TOL_FLOOR = 6e-3


class GuardedArena(arena_mod.DeviceArena):
    """[guard | arena | guard] in one allocation; the arena starts poisoned."""

    live: list["GuardedArena"] = []

    def __init__(self, nbytes: int, device: torch.device):
        self._buf = torch.full((nbytes + 2 * GUARD,), 0xFF, dtype=torch.uint8, device=device)
        self._buf[:GUARD].fill_(PATTERN)
        self._buf[GUARD + nbytes:].fill_(PATTERN)
        self.base = self._buf.data_ptr() + GUARD
        self.nbytes = nbytes
        self.host_bytes = 0
        GuardedArena.live.append(self)

    def guards_intact(self) -> bool:
        if self._buf is None:
            return True
        lo, hi = self._buf[:GUARD], self._buf[GUARD + self.nbytes:]
        return bool((lo == PATTERN).all()) and bool((hi == PATTERN).all())


arena_mod.DeviceArena = GuardedArena   # make_arena builds the arena through the module global


_WEIGHTS: dict = {}


def make_problem(EP, T, seed, device):
    """Every rank's x, IDs (K distinct experts of all EP * E_LOCAL, some routes inactive) and
    scores from `seed`, and every expert's weights (one set per EP size and weight seed), from
    seeded CUDA generators: the same values on every rank."""
    E = EP * E_LOCAL
    wseed = seed % 3
    if (EP, wseed) not in _WEIGHTS:
        gw = torch.Generator(device=device).manual_seed(1000 + wseed)
        _WEIGHTS.clear()
        _WEIGHTS[(EP, wseed)] = (
            (torch.randn(E, 2 * F, D, generator=gw, device=device) / D ** 0.5).to(torch.bfloat16),
            (torch.randn(E, D, F, generator=gw, device=device) / F ** 0.5).to(torch.bfloat16))
    w13, w2 = _WEIGHTS[(EP, wseed)]
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(EP, T, D, generator=g, device=device).to(torch.bfloat16)
    ids = torch.rand(EP * T, E, generator=g, device=device).argsort(-1)[:, :K].view(EP, T, K)
    s = torch.softmax(torch.randn(EP, T, K, generator=g, device=device), -1)
    drop = torch.rand(EP, T, K, generator=g, device=device) < 0.1
    drop[:, :1] = True       # an all-inactive row
    ids, s = torch.where(drop, -1, ids), torch.where(drop, 0.0, s)
    return dict(x=x, ids=ids.to(torch.int32), s=s.float(), w13=w13, w2=w2)


def oracle_y(p, rank, bf16_points: bool):
    """fp64 y of rank's tokens (bf16_points: round h1, h2, h3 where the kernels store them)."""
    x, ids, s = p["x"][rank].double(), p["ids"][rank], p["s"][rank].double()
    y = torch.zeros_like(x)
    rnd = (lambda t: t.to(torch.bfloat16).double()) if bf16_points else (lambda t: t)
    for e in range(p["w13"].shape[0]):
        tok, kk = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h1 = rnd(x[tok] @ p["w13"][e].double().t())
        h2 = rnd(torch.nn.functional.silu(h1[:, :F]) * h1[:, F:])
        h3 = rnd(h2 @ p["w2"][e].double().t())
        y.index_add_(0, tok, h3 * s[tok, kk][:, None])
    return y


def relerr(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def _problem_cfg(p, precision):
    from megatron_dist_moe import testing as tt
    EP, T, _ = p["x"].shape
    cfg = dm.Config(num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K,
                    num_experts=p["w13"].shape[0], precision=precision, backend="reference",
                    inference=True, num_activation_slots=0)
    return tt.Problem.from_ep(p["x"], p["ids"], p["s"], p["w13"], p["w2"]), cfg, EP, T


def emulated_y(p, rank, precision):
    """y of rank's tokens at the precision's rounding points."""
    if precision == "bf16":
        return oracle_y(p, rank, True)
    from megatron_dist_moe import testing as tt
    P, cfg, EP, T = _problem_cfg(p, precision)
    if precision == "nvfp4":
        y = tt.nvfp4_emulation(P, cfg)
    else:
        y = tt.block_quant_emulation(P, cfg, backward=False)["y"]
    return y.view(EP, T, D)[rank].double()


def exact_y(p, rank, precision):
    """The fp64 oracle's y of rank's tokens (nvfp4: on the dequantized prepared weights, which
    are the model)."""
    if precision != "nvfp4":
        return oracle_y(p, rank, False)
    from megatron_dist_moe import testing as tt
    P, cfg, EP, T = _problem_cfg(p, precision)
    return tt.nvfp4_oracle_y(P, cfg).view(EP, T, D)[rank].double()


def judge(name, y, p, rank, results, precision="bf16"):
    exact, emul = exact_y(p, rank, precision), emulated_y(p, rank, precision)
    err, tol = relerr(y, exact), max(TOL_FLOOR, 2 * relerr(emul, exact))
    zero = (p["ids"][rank] < 0).all(1)
    guards = all(a.guards_intact() for a in GuardedArena.live)
    ok = err <= tol and bool(torch.isfinite(y).all()) and bool((y[zero] == 0).all()) and guards
    results.append(dict(case=name, rank=rank, ok=ok, y=err, tol=tol, guards_intact=guards))


def run_inference(T, factor, EP, rank, dev, results, precision="bf16", pipeline="standard"):
    cfg = dm.Config(num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K,
                    num_experts=E_LOCAL * EP, inference=True, num_activation_slots=0,
                    device_scratch_capacity_factor=factor, backend="cuda", precision=precision,
                    pipeline=pipeline)
    sl = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    tag = f"{precision}_{pipeline}_T{T}_factor{factor:g}"
    with dm.create_context(config=cfg, device=dev) as ctx:
        p = make_problem(EP, T, seed=T + int(10 * factor), device=dev)
        x, ids, s = (p[k][rank].clone() for k in ("x", "ids", "s"))
        w13, w2 = p["w13"][sl].clone(), p["w2"][sl].clone()
        if precision == "nvfp4":       # prepared weights (graph replays read their tensors)
            prep = dm.prepare_expert_weights(w13, w2, precision="nvfp4")
            w13, w2 = prep.w13, prep.w2
        with torch.no_grad():
            y = dm.routed_experts(x, ids, s, w13, w2, ctx)
        torch.cuda.synchronize()
        judge(f"{tag}_eager", y, p, rank, results, precision)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            dm.routed_experts(x, ids, s, w13, w2, ctx)
        torch.cuda.current_stream().wait_stream(side)
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            yg = dm.routed_experts(x, ids, s, w13, w2, ctx)
        p2 = make_problem(EP, T, seed=T + 7, device=dev)
        x.copy_(p2["x"][rank]); ids.copy_(p2["ids"][rank]); s.copy_(p2["s"][rank])
        if precision == "nvfp4":
            new = dm.prepare_expert_weights(p2["w13"][sl].contiguous(), p2["w2"][sl].contiguous())
            for old_w, new_w in ((w13, new.w13), (w2, new.w2)):
                for a, b in ((old_w.packed, new_w.packed), (old_w.scales, new_w.scales),
                             (old_w.global_scale, new_w.global_scale)):
                    a.copy_(b)
        else:
            w13.copy_(p2["w13"][sl]); w2.copy_(p2["w2"][sl])
        yg.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        judge(f"{tag}_graph_replay", yg, p2, rank, results, precision)
        del graph


def run_after_training(T, EP, rank, dev, results, precision="bf16", pipeline="standard"):
    cfg = dm.Config(num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K,
                    num_experts=E_LOCAL * EP, activation_slot_capacity_factor=1.0,
                    backend="cuda", precision=precision, pipeline=pipeline)
    sl = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    with dm.create_context(config=cfg, device=dev) as ctx:
        p = make_problem(EP, T, seed=99, device=dev)
        x = p["x"][rank].clone().requires_grad_()
        w13 = p["w13"][sl].clone().requires_grad_()
        w2 = p["w2"][sl].clone().requires_grad_()
        y = dm.routed_experts(x, p["ids"][rank], p["s"][rank], w13, w2, ctx)
        y.float().square().sum().backward()
        p2 = make_problem(EP, T, seed=98, device=dev)
        with torch.no_grad():
            y2 = dm.routed_experts(p2["x"][rank], p2["ids"][rank], p2["s"][rank],
                                   p2["w13"][sl].contiguous(), p2["w2"][sl].contiguous(), ctx)
        torch.cuda.synchronize()
        judge(f"{precision}_{pipeline}_T{T}_inference_after_training", y2, p2, rank, results, precision)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,96,128,512,2048,4096")
    ap.add_argument("--factors", default="1,2")
    ap.add_argument("--json", default=None)
    ap.add_argument("--precisions", default="bf16,fp8_block,mxfp8,nvfp4")
    ap.add_argument("--pipelines", default="standard,mega",
                    help="each (precision, pipeline) the CUDA backend runs (execution.RUNS)")
    args = ap.parse_args()
    rank, EP = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    results = []
    from megatron_dist_moe.execution import runs
    asked = [(pr, pi) for pr in args.precisions.split(",") for pi in args.pipelines.split(",")]
    combos = [(pr, pi) for pr, pi in asked if runs("cuda", pr, pi)]
    if rank == 0 and len(combos) < len(asked):
        print(f"SKIP the (precision, pipeline) pairs the CUDA backend does not run: "
              f"{sorted(set(asked) - set(combos))}", flush=True)
    cases = [(pr, pi, int(t), float(f)) for pr, pi in combos
             for t in args.tokens.split(",") for f in args.factors.split(",")]
    for precision, pipeline, T, factor in cases:
        try:
            run_inference(T, factor, EP, rank, dev, results, precision, pipeline)
        except Exception as e:
            results.append(dict(case=f"{precision}_{pipeline}_T{T}_factor{factor:g}", rank=rank,
                                ok=False, error=repr(e), tb=traceback.format_exc()[-2000:]))
        GuardedArena.live.clear()
    for precision, pipeline in ((pr, pi) for pr, pi in combos if pr != "nvfp4"):  # nvfp4: inference
        try:
            run_after_training(512, EP, rank, dev, results, precision, pipeline)
        except Exception as e:
            results.append(dict(case=f"{precision}_{pipeline}_T512_inference_after_training",
                                rank=rank, ok=False, error=repr(e),
                                tb=traceback.format_exc()[-2000:]))
    gathered = [None] * EP
    dist.all_gather_object(gathered, results)
    flat = [r for rs in gathered for r in rs]
    if rank == 0:
        for r in flat:
            err = f"y={r['y']:.2e} tol={r['tol']:.1e} guards={'ok' if r['guards_intact'] else 'CHANGED'}" \
                if "y" in r else r.get("error", "")
            print(f"{'PASS' if r['ok'] else 'FAIL'} rank{r['rank']} {r['case']:<34} {err}")
            if "tb" in r:
                print(r["tb"])
        n_fail = sum(not r["ok"] for r in flat)
        print(f"{len(flat) - n_fail} passed, {n_fail} failed")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(flat, f, indent=1)
    ok = all(r["ok"] for r in flat)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Shared helpers for tests, benchmarks and the demo: fp64 oracle, routing generators, spawning.

Nothing here runs at import time; torch.distributed is only touched inside spawned workers.

    oracle      routed_experts_oracle(x_TD, ids_TK, scores_TK, w13_all, w2_all, ...)
    routing     random_routing(...), imbalanced_routing(...)
    problems    make_problem(cfg, ep_size, seed, ...) -> Problem (every rank's inputs and weights)
                run_rank(ctx, problem, ...) -> this rank's output and gradients
                oracle_results(problem, cfg) / rank_errors(...)
                block_quant_emulation(problem, cfg): the same quantization (fp8_block, mxfp8)
                in plain torch, per expert over all ranks' tokens (what a quantized run's
                errors are judged by); nvfp4_emulation(problem, cfg) and
                nvfp4_oracle_y(problem, cfg) for nvfp4 inference on prepared weights
    processes   spawn(fn, world_size, args) runs fn(rank, world_size, *args) on gloo/NCCL ranks
                rendezvousing through a FileStore in a fresh temporary directory (no ports).
                run_child_checks(argv) runs checks in a fresh Python (e.g. Triton's
                interpreter, which is chosen at import) and collects their RESULT lines.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = [
    "routed_experts_oracle", "random_routing", "imbalanced_routing", "make_weights",
    "relative_error", "Problem", "make_problem", "run_rank", "oracle_results", "rank_errors",
    "block_quant_emulation",
    "nvfp4_emulation",
    "nvfp4_oracle_y",
    "spawn", "SpawnedRankDied", "run_child_checks", "assert_child_check", "RESULT_NAMES",
    "moving_average", "moving_average_gap", "noise_band",
]

RESULT_NAMES = ("y", "grad_x", "grad_scores", "grad_w13", "grad_w2")


# -- oracle ------------------------------------------------------------------------------------
def routed_experts_oracle(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor,
                          scores_TK: torch.Tensor, w13: torch.Tensor, w2_EDF: torch.Tensor, *,
                          activation: str = "swiglu", swiglu_alpha: float = 1.702,
                          swiglu_limit: float = 7.0,
                          compute_dtype: torch.dtype | None = torch.float64) -> torch.Tensor:
    """Dense-math reference of routed_experts over *all* experts (differentiable, any device).

    Args:
        x_TD:           [T, D] tokens (every rank's tokens concatenated, for an EP comparison).
        expert_ids_TK:  [T, K] global expert IDs in [0, E), -1 = inactive route.
        scores_TK:      [T, K] route scores.
        w13:            [E, 2, F, D] or [E, 2F, D] global gate/up weights.
        w2_EDF:         [E, D, F] global down projections.
        compute_dtype:  dtype every operand is cast to (default fp64: the oracle); None computes
                        in the inputs' own dtype (a "plain torch at the same precision" baseline).

    Returns y_TD [T, D] in compute_dtype: sum over active routes of score * W2 act(W13 x).
    """
    from .activation import Activation

    act = Activation(activation, swiglu_alpha, swiglu_limit)
    E = w13.shape[0]
    D = x_TD.shape[1]
    w13 = w13.reshape(E, -1, D)
    dt = x_TD.dtype if compute_dtype is None else compute_dtype
    x_TD, scores_TK, w13, w2_EDF = x_TD.to(dt), scores_TK.to(dt), w13.to(dt), w2_EDF.to(dt)
    ids = expert_ids_TK.to(torch.int64)
    y = torch.zeros_like(x_TD)
    for e in range(E):
        t_idx, k_idx = (ids == e).nonzero(as_tuple=True)
        if t_idx.numel() == 0:
            continue
        h1 = x_TD[t_idx] @ w13[e].T
        h2 = act.forward(h1)
        h3 = h2 @ w2_EDF[e].T
        y = y.index_add(0, t_idx, scores_TK[t_idx, k_idx].unsqueeze(-1) * h3)
    return y


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-wise relative error ||got - want|| / ||want|| in fp64 (0 when both are zero)."""
    got, want = got.detach().to("cpu", torch.float64), want.detach().to("cpu", torch.float64)
    den = want.norm().item()
    num = (got - want).norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


# -- routing generators ------------------------------------------------------------------------
def _scores(T: int, K: int, generator: torch.Generator | None) -> torch.Tensor:
    """Positive softmax-like scores [T, K] fp32 (each row sums to 1)."""
    logits = torch.randn(T, K, generator=generator, dtype=torch.float64)
    return torch.softmax(logits, dim=-1).to(torch.float32)


def _deactivate(ids: torch.Tensor, scores: torch.Tensor, generator, inactive_fraction: float,
                num_inactive_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = ids.shape
    if inactive_fraction > 0:
        off = torch.rand(T, K, generator=generator) < inactive_fraction
        ids = ids.masked_fill(off, -1)
    if num_inactive_rows > 0:
        rows = torch.randperm(T, generator=generator)[:num_inactive_rows]
        ids[rows] = -1
    scores = scores.masked_fill(ids < 0, 0.0)
    return ids, scores


def random_routing(num_tokens: int, top_k: int, num_experts: int, *,
                   generator: torch.Generator | None = None, inactive_fraction: float = 0.0,
                   num_inactive_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform routing: each token picks top_k distinct experts.

    Returns (expert_ids [T, K] int64, scores [T, K] fp32); a fraction of routes (and
    `num_inactive_rows` whole rows) are inactive: ID -1 and score exactly 0.
    """
    keys = torch.rand(num_tokens, num_experts, generator=generator)
    ids = keys.topk(top_k, dim=1).indices.to(torch.int64)
    return _deactivate(ids, _scores(num_tokens, top_k, generator), generator, inactive_fraction,
                       num_inactive_rows)


def imbalanced_routing(num_tokens: int, top_k: int, num_experts: int, *, ep_size: int,
                       mode: str = "one_rank", target_rank: int = 0, hot_expert: int = 0,
                       zipf_s: float = 1.5, generator: torch.Generator | None = None,
                       inactive_fraction: float = 0.0, num_inactive_rows: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Skewed routing for overflow / planner / correctness tests.

    mode:
        "one_rank"    every route goes to an expert owned by `target_rank` (needs
                      top_k <= E_local); that rank receives T*K rows from every source.
        "hot_expert"  route 0 of every token goes to `hot_expert`, the rest are uniform.
        "zipf"        experts drawn with probability ~ 1 / (rank+1)^zipf_s (distinct per token).
    """
    E_local = num_experts // ep_size
    T, K = num_tokens, top_k
    if mode == "one_rank":
        if K > E_local:
            raise ValueError(f"one_rank routing needs top_k={K} <= E_local={E_local}")
        keys = torch.rand(T, E_local, generator=generator)
        ids = keys.topk(K, dim=1).indices.to(torch.int64) + target_rank * E_local
    elif mode == "hot_expert":
        keys = torch.rand(T, num_experts, generator=generator)
        keys[:, hot_expert] = 2.0          # always the top pick, in route slot 0
        ids = keys.topk(K, dim=1).indices.to(torch.int64)
    elif mode == "zipf":
        w = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** zipf_s
        ids = torch.multinomial(w.expand(T, -1), K, replacement=False, generator=generator)
    else:
        raise ValueError(f"unknown imbalance mode {mode!r}")
    return _deactivate(ids, _scores(T, K, generator), generator, inactive_fraction,
                       num_inactive_rows)


def make_weights(num_experts: int, hidden_dim: int, intermediate_dim: int, *,
                 generator: torch.Generator | None = None, dtype: torch.dtype = torch.bfloat16
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (w13 [E, 2, F, D], w2 [E, D, F]) scaled so h1 and h3 stay O(1)."""
    E, D, F = num_experts, hidden_dim, intermediate_dim
    w13 = torch.randn(E, 2, F, D, generator=generator, dtype=torch.float64) / D ** 0.5
    w2 = torch.randn(E, D, F, generator=generator, dtype=torch.float64) / F ** 0.5
    return w13.to(dtype), w2.to(dtype)


# -- whole problems ----------------------------------------------------------------------------
@dataclass
class Problem:
    """Every rank's inputs of one routed_experts call (global tensors on CPU, rank-major tokens).

    x [EP*T, D], ids [EP*T, K] int64, scores [EP*T, K] fp32, w13 [E, 2, F, D], w2 [E, D, F],
    grad_y [EP*T, D]; values already rounded to `dtype`.
    """

    ep_size: int
    T: int
    x: torch.Tensor
    ids: torch.Tensor
    scores: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    grad_y: torch.Tensor

    @classmethod
    def from_ep(cls, x_EPTD, ids_EPTK, scores_EPTK, w13_E2FD, w2_EDF, grad_y_EPTD=None
                ) -> "Problem":
        """A Problem from per-rank stacked tensors ([EP, T, ...], W13 as [E, 2F, D]), as the
        GPU checks draw them (any device; grad_y may be absent for a forward-only use)."""
        EP, T, D = x_EPTD.shape
        K = ids_EPTK.shape[-1]
        E, F2, _ = w13_E2FD.shape
        gy = None if grad_y_EPTD is None else grad_y_EPTD.reshape(EP * T, D)
        return cls(EP, T, x_EPTD.reshape(EP * T, D), ids_EPTK.reshape(EP * T, K).long(),
                   scores_EPTK.reshape(EP * T, K), w13_E2FD.view(E, 2, F2 // 2, D), w2_EDF, gy)

    def tokens(self, rank: int) -> slice:
        return slice(rank * self.T, (rank + 1) * self.T)

    def experts(self, rank: int) -> slice:
        E_local = self.w13.shape[0] // self.ep_size
        return slice(rank * E_local, (rank + 1) * E_local)


def make_problem(cfg, ep_size: int, seed: int, *, dtype: torch.dtype = torch.bfloat16,
                 routing: str = "random", num_tokens: int | None = None,
                 inactive_fraction: float = 0.0, num_inactive_rows: int = 0,
                 **routing_kwargs: Any) -> Problem:
    """A deterministic problem for `cfg` on `ep_size` ranks (same on every rank for a seed).

    routing: "random" or an imbalanced_routing mode ("one_rank", "hot_expert", "zipf").
    """
    gen = torch.Generator().manual_seed(seed)
    T = cfg.num_local_input_tokens if num_tokens is None else num_tokens
    N, K, E, D, F = ep_size * T, cfg.top_k, cfg.num_experts, cfg.hidden_dim, cfg.intermediate_dim
    x = torch.randn(N, D, generator=gen, dtype=torch.float64).to(dtype)
    if routing == "random":
        ids, scores = random_routing(N, K, E, generator=gen, inactive_fraction=inactive_fraction,
                                     num_inactive_rows=num_inactive_rows)
    else:
        ids, scores = imbalanced_routing(N, K, E, ep_size=ep_size, mode=routing, generator=gen,
                                         inactive_fraction=inactive_fraction,
                                         num_inactive_rows=num_inactive_rows, **routing_kwargs)
    if dtype == torch.float64:
        scores = scores.to(torch.float64)
    w13, w2 = make_weights(E, D, F, generator=gen, dtype=dtype)
    grad_y = torch.randn(N, D, generator=gen, dtype=torch.float64).to(dtype)
    return Problem(ep_size, T, x, ids, scores, w13, w2, grad_y)


def run_rank(ctx, problem: Problem, *, w13_layout: str = "E2FD", backward: bool = True,
             wgrad_into: bool = False) -> dict[str, torch.Tensor]:
    """Run routed_experts on this rank's slice of `problem` (forward, and backward when asked).

    w13_layout: "E2FD" passes w13 as [E_local, 2, F, D], "E2F_D" as [E_local, 2F, D].
    wgrad_into: pass fp32 per-expert accumulators holding small integers (exact in fp32); the
        weight gradients returned are then (accumulator after - before), and the weights' own
        gradients must be exactly zero (AssertionError otherwise).
    Returns CPU tensors: y, and grad_x, grad_scores, grad_w13 ([E_local, 2, F, D]), grad_w2.
    """
    from .ops import routed_experts

    dev, r = ctx.device, ctx.rank
    tok, exp = problem.tokens(r), problem.experts(r)
    x = problem.x[tok].to(dev).requires_grad_(backward)
    ids = problem.ids[tok].to(dev)
    scores = problem.scores[tok].to(dev).requires_grad_(backward)
    w13 = problem.w13[exp].contiguous().to(dev)
    if w13_layout == "E2F_D":
        w13 = w13.reshape(w13.shape[0], -1, w13.shape[-1])
    elif w13_layout != "E2FD":
        raise ValueError(f"unknown w13 layout {w13_layout!r}")
    w13 = w13.requires_grad_(backward)
    w2 = problem.w2[exp].contiguous().to(dev).requires_grad_(backward)
    if backward and wgrad_into:
        g = torch.Generator().manual_seed(1000 + r)
        start = [[torch.randint(-3, 4, w.shape[1:], generator=g).to(torch.float32)
                  for _ in range(w.shape[0])] for w in (w13, w2)]
        accs = [[t.to(dev, copy=True) for t in ts] for ts in start]
        y = routed_experts(x, ids, scores, w13, w2, ctx, wgrad_into=accs)
        y.backward(problem.grad_y[tok].to(dev))
        for name, w in (("w13", w13), ("w2", w2)):
            assert w.grad is not None and not bool(w.grad.any()), (
                f"wgrad_into: {name}.grad must be all zeros")
        got = [torch.stack([a.cpu().double() - s.double() for a, s in zip(acc, st)])
               for acc, st in zip(accs, start)]
        return dict(y=y.detach().cpu(), grad_x=x.grad.cpu(), grad_scores=scores.grad.cpu(),
                    grad_w13=got[0].reshape(problem.w13[exp].shape), grad_w2=got[1])
    if backward:
        y = routed_experts(x, ids, scores, w13, w2, ctx)
        y.backward(problem.grad_y[tok].to(dev))
        return dict(y=y.detach().cpu(), grad_x=x.grad.cpu(), grad_scores=scores.grad.cpu(),
                    grad_w13=w13.grad.reshape(problem.w13[exp].shape).cpu(), grad_w2=w2.grad.cpu())
    with torch.no_grad():
        y = routed_experts(x, ids, scores, w13, w2, ctx)
    return dict(y=y.cpu())


def oracle_results(problem: Problem, cfg, *, compute_dtype: torch.dtype | None = torch.float64
                   ) -> dict[str, torch.Tensor]:
    """The oracle's y and gradients for every rank (global tensors, in compute_dtype)."""
    def leaf(t):
        t = t.detach().clone()
        if compute_dtype is not None:
            t = t.to(compute_dtype)
        return t.requires_grad_(True)

    x, scores, w13, w2 = leaf(problem.x), leaf(problem.scores), leaf(problem.w13), leaf(problem.w2)
    y = routed_experts_oracle(x, problem.ids, scores, w13, w2, activation=cfg.activation,
                              swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
                              compute_dtype=None)
    y.backward(problem.grad_y.to(y.dtype))
    return dict(y=y.detach(), grad_x=x.grad, grad_scores=scores.grad, grad_w13=w13.grad,
                grad_w2=w2.grad)


def block_quant_emulation(problem: Problem, cfg, backward: bool = True
                          ) -> dict[str, torch.Tensor]:
    """y and every gradient of `problem` with cfg.precision's block quantization (fp8_block,
    mxfp8) at the points the kernels quantize (reference_math.BlockQuantMath and Mxfp8Math
    document them),
    computed per expert over every rank's tokens in plain torch: an implementation independent
    of the backends' row movement, arenas and planner. Global tensors (fp32), shaped like
    `oracle_results` (backward=False: y only; problem.grad_y is not read)."""
    from .activation import Activation
    from .quant import format_of

    fmt = format_of(cfg)
    act = Activation.of(cfg)
    bf = torch.bfloat16
    E, D, F = problem.w13.shape[0], cfg.hidden_dim, cfg.intermediate_dim
    w13 = problem.w13.reshape(E, 2 * F, D).to(bf)
    w2 = problem.w2.to(bf)
    w13d, w2d = fmt.deq_weight(*fmt.weight(w13)), fmt.deq_weight(*fmt.weight(w2))

    def rows(x):
        return fmt.deq_rows(*fmt.rows(x))

    def cols(x):
        n = x.shape[0]
        Rp = -(-max(n, 1) // 128) * 128
        return fmt.deq_cols(*fmt.cols(x, torch.tensor([0, n]), Rp))[:n]

    x, ids = problem.x.to(bf), problem.ids
    gy = problem.grad_y.to(bf) if backward else None
    scores = problem.scores.to(torch.float32)
    N, K = ids.shape
    dev = dict(device=x.device)
    routes = torch.zeros(N, K, D, **dev)
    grad_routes = torch.zeros(N, K, D, **dev)
    grad_s = torch.zeros(N, K, **dev)
    grad_w13, grad_w2 = torch.zeros(E, 2 * F, D, **dev), torch.zeros(E, D, F, **dev)
    for e in range(E):
        t, k = (ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        X, s = x[t], scores[t, k].unsqueeze(-1)
        h1 = (rows(X) @ w13d[e].T).to(bf)
        h2 = act.forward(h1.float()).to(bf)
        h3 = (rows(h2) @ w2d[e].T).to(bf)
        routes[t, k] = h3.float()
        if not backward:
            continue
        h1r = rows(h1)
        h2f = act.forward(h1r)
        h2b = h2f.to(bf)
        if cfg.save_route_outputs:
            g3 = (s * gy[t].float()).to(bf)
            u = rows(g3) @ w2d[e]
            h2w = h2b
            grad_s[t, k] = (gy[t].float() * h3.float()).sum(-1)
        else:
            g3 = gy[t]
            u = rows(g3) @ w2d[e]
            grad_s[t, k] = (u * h2b.float()).sum(-1)
            u = s * u
            h2w = (s * h2f).to(bf)
        gh1 = act.backward(h1r, u.to(bf).float()).to(bf)
        grad_w2[e] = cols(g3).T @ cols(h2w)
        grad_routes[t, k] = (rows(gh1) @ w13d[e]).to(bf).float()
        grad_w13[e] = cols(gh1).T @ cols(X)
    y = (scores.unsqueeze(-1) * routes).sum(1).to(bf).float()
    if not backward:
        return dict(y=y)
    # weight gradients are returned in the weights' dtype (bf16)
    return dict(y=y, grad_x=grad_routes.sum(1).to(bf).float(), grad_scores=grad_s,
                grad_w13=grad_w13.view(E, 2, F, D).to(bf).float(), grad_w2=grad_w2.to(bf).float())


def nvfp4_oracle_y(problem: Problem, cfg) -> torch.Tensor:
    """The fp64 oracle's y on the prepared (dequantized) NVFP4 weights and unquantized x: the
    quantization of the weights is the model; what a run is judged on is the rest."""
    from .prepared import prepare_expert_weights
    p = prepare_expert_weights(problem.w13.to(torch.bfloat16), problem.w2.to(torch.bfloat16))
    return routed_experts_oracle(problem.x, problem.ids, problem.scores, p.w13.dequantize(),
                                 p.w2.dequantize(), activation=cfg.activation,
                                 swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)


def nvfp4_emulation(problem: Problem, cfg) -> torch.Tensor:
    """y (fp32, global) of nvfp4 inference at its quantization points in plain torch, per expert
    over every rank's tokens (reference_math.Nvfp4Math documents them)."""
    from .activation import Activation
    from .prepared import prepare_expert_weights
    from .quant import nvfp4

    bf = torch.bfloat16
    act = Activation.of(cfg)
    D, F = cfg.hidden_dim, cfg.intermediate_dim
    p = prepare_expert_weights(problem.w13.to(bf), problem.w2.to(bf))
    w13d, w2d = p.w13.dequantize(), p.w2.dequantize()
    xd = nvfp4.dequantize_row_bytes(nvfp4.quantize_row_bytes(problem.x.to(bf)), D)
    N, K = problem.ids.shape
    routes = torch.zeros(N, K, D, device=problem.x.device)
    for e in range(w13d.shape[0]):
        t, k = (problem.ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        h1 = (xd[t] @ w13d[e].T).to(bf)
        h2 = act.forward(h1.float()).to(bf)
        h2d = nvfp4.dequantize_row_bytes(nvfp4.quantize_row_bytes(h2), F)
        routes[t, k] = (h2d @ w2d[e].T).to(bf).float()
    return (problem.scores.float().unsqueeze(-1) * routes).sum(1).to(bf).float()


def rank_errors(results: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor],
                problem: Problem, rank: int) -> dict[str, float]:
    """Relative error of each of this rank's results against the matching oracle slice."""
    tok, exp = problem.tokens(rank), problem.experts(rank)
    pick = dict(y=tok, grad_x=tok, grad_scores=tok, grad_w13=exp, grad_w2=exp)
    return {k: relative_error(v, oracle[k][pick[k]]) for k, v in results.items()}


# -- processes ---------------------------------------------------------------------------------
class SpawnedRankDied(RuntimeError):
    """A spawned rank was killed by a signal; the message carries what each rank printed last."""


def _spawn_entry(rank: int, fn: Callable, world_size: int, args: tuple, backend: str,
                 workdir: str, timeout_s: float, num_threads: int) -> None:
    import faulthandler

    import torch.distributed as dist

    # C-level stderr goes to a file so that an abort's own words (a C++ `terminate called ...`
    # from gloo or torch, a fatal signal's Python stack) reach the parent's error message.
    log = open(os.path.join(workdir, f"stderr_{rank}.log"), "ab", buffering=0)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log, all_threads=True)

    torch.set_num_threads(num_threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(workdir, f"result_{rank}.pt"))
    # No rank tears its connections down while a peer may still be reading from them.
    dist.barrier()
    dist.destroy_process_group()


def _stderr_tails(workdir: str, world_size: int, max_chars: int = 4000) -> str:
    parts = []
    for r in range(world_size):
        path = os.path.join(workdir, f"stderr_{r}.log")
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            text = "(no stderr file)"
        parts.append(f"--- rank {r} stderr (last {max_chars} chars) ---\n{text[-max_chars:]}")
    return "\n".join(parts)


def spawn(fn: Callable, world_size: int = 2, args: tuple = (), *, backend: str = "gloo",
          timeout_s: float = 120.0, num_threads: int = 1, signal_retries: int = 1) -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` fresh processes with a process group.

    fn must be importable (a module-level function). Ranks rendezvous through a FileStore in a
    new temporary directory, so parallel runs never collide on a port. Returns each rank's return
    value (round-tripped through torch.save). A rank that raises makes this raise with its
    traceback; the other ranks are terminated. `timeout_s` bounds every collective.

    A rank killed by a signal (an abort inside gloo's transport threads, not a Python error) is
    reported with every rank's stderr, and the whole group is started again up to
    `signal_retries` times, with a warning that carries the first failure's stderr. A Python
    exception is never retried: it is a result.
    """
    import warnings

    import torch.multiprocessing as mp

    for attempt in range(signal_retries + 1):
        workdir = tempfile.mkdtemp(prefix="dm_spawn_")
        try:
            try:
                mp.spawn(_spawn_entry, nprocs=world_size, join=True,
                         args=(fn, world_size, tuple(args), backend, workdir, timeout_s,
                               num_threads))
            except mp.ProcessExitedException as e:
                msg = f"{e}\n{_stderr_tails(workdir, world_size)}"
                if e.signal_name is not None and attempt < signal_retries:
                    warnings.warn(f"spawned rank died by a signal; starting the group again. "
                                  f"{msg}", RuntimeWarning, stacklevel=2)
                    continue
                raise SpawnedRankDied(msg) from e
            except mp.ProcessRaisedException as e:
                raise mp.ProcessRaisedException(
                    f"{e}\n{_stderr_tails(workdir, world_size, 1500)}", e.error_index,
                    e.error_pid) from None
            return [torch.load(os.path.join(workdir, f"result_{r}.pt"), weights_only=False)
                    for r in range(world_size)]
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    raise AssertionError("unreachable")


def run_child_checks(argv: list[str], *, interpret: bool = True, timeout_s: float = 600,
                     paths: tuple[str, ...] = (), env: dict[str, str] | None = None
                     ) -> tuple[dict[str, dict], str]:
    """Run `python *argv` in a fresh process and collect its checks' results.

    The child prints one line `RESULT <json object with a "name">` per check. `interpret` sets
    TRITON_INTERPRET=1 (Triton decides at import whether it interprets, so it cannot be switched
    inside one process); `paths` go in front of PYTHONPATH, after the repository root; `env`
    adds variables.
    Returns ({name: result}, the child's stdout); raises RuntimeError with the child's stderr
    when it printed no result at all (a crash before the first check).
    """
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child_env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(
        p for p in (repo, *paths, os.environ.get("PYTHONPATH", "")) if p))
    if interpret:
        child_env["TRITON_INTERPRET"] = "1"
    else:
        child_env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, *argv], env=child_env, capture_output=True, text=True,
                          timeout=timeout_s, cwd=repo)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r["name"]] = r
    if not results:
        raise RuntimeError(f"the child printed no result (rc={proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    return results, proc.stdout


def assert_child_check(results: dict[str, dict], name: str) -> None:
    """One check of `run_child_checks`' results reported and passed (else its error and
    traceback)."""
    res = results.get(name)
    assert res is not None, f"check {name} did not report (child crashed?)"
    assert res["ok"], f"{res['error']}\n{res.get('trace', '')}"


def moving_average(v: list[float], width: int = 10) -> list[float]:
    """The `width`-step trailing mean of a loss curve (shorter at its start): what the loss
    comparisons (benchmarks/megatron_loss_noise.py, examples/tiny_lm_nvfp4_eval.py) judge."""
    out, acc = [], 0.0
    for i, x in enumerate(v):
        acc += x - (v[i - width] if i >= width else 0.0)
        out.append(acc / min(i + 1, width))
    return out


def moving_average_gap(a: list[float], b: list[float], width: int = 10) -> float:
    """The largest gap between two loss curves' `width`-step moving averages."""
    return max(abs(x - y) for x, y in zip(moving_average(a, width), moving_average(b, width)))


def noise_band(curves: list[list[float]]) -> float:
    """The run-to-run noise band of repeated curves: their largest pairwise
    `moving_average_gap` (examples/tiny_lm_nvfp4_eval.py, benchmarks/lm_noise_band.py)."""
    return max(moving_average_gap(a, b) for i, a in enumerate(curves) for b in curves[i + 1:])

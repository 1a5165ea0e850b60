"""`python -m megatron_dist_moe ...`: plan (memory plan + planner simulation) and demo.

    python -m megatron_dist_moe plan --config configs/guide_bench.yaml --ep 64 \\
        [--imbalance 1,4,8] [--layers N] [--set key=value ...] [--plot out.png]
    python -m megatron_dist_moe demo [--ranks 2] [--tokens 64] [--config configs/tiny.yaml]

`plan` is pure: no process group, no GPU. With --imbalance it runs the real planner functions on
CPU tensors for synthetic per-rank row counts: the tracked rank receives the given multiple of
the balanced rows T·K in successive layers and the other ranks share the rest evenly.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .config import PIPELINES

__all__ = ["main", "LayerDecision", "SlotSimulation", "imbalanced_rows", "simulate_slot"]


# -- planner simulation ------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerDecision:
    """One layer's forward decision in the simulated slot (bytes are per slot, from its base)."""

    layer: int
    multiple: float              # tracked rank's rows / balanced rows
    rows: tuple[int, ...]        # [EP] rows received by each rank
    overflow: bool               # some rank exceeds the executable scratch rows (would raise)
    candidate_bytes: int         # max_r(saved_r + full_state_r): worst rank if it saved fully
    reserve_bytes: int           # remaining layers x saved input bytes
    need_recompute: bool
    start: int                   # tracked rank's byte offset of this layer in the slot
    added: int                   # tracked rank's bytes kept for this layer
    saved_after: tuple[int, ...]  # [EP] saved bytes per rank after this layer


@dataclass
class SlotSimulation:
    plan: object
    tracked_rank: int
    layers: list[LayerDecision] = field(default_factory=list)
    rewound: bool = False        # every cursor back at its start after reverse-order backward

    @property
    def capacity(self) -> int:
        return self.plan.slot_bytes


def imbalanced_rows(plan, multiple: float, tracked_rank: int = 0) -> list[int]:
    """[EP] received rows: `tracked_rank` gets multiple x T·K (capped by every route and by the
    topology bound), the other ranks share the remaining routes as evenly as possible."""
    EP = plan.ep_size
    total = EP * plan.balanced_rows
    tracked = min(int(round(multiple * plan.balanced_rows)), total, plan.topology_max_rows)
    if EP == 1:
        return [total]
    rest = total - tracked
    base, extra = divmod(rest, EP - 1)
    rows, i = [], 0
    for r in range(EP):
        if r == tracked_rank:
            rows.append(tracked)
        else:
            rows.append(base + (1 if i < extra else 0))
            i += 1
    return rows


def simulate_slot(plan, profile: Sequence[float], num_layers: int | None = None,
                  tracked_rank: int = 0) -> SlotSimulation:
    """Run planner.plan_forward for `num_layers` layers in slot 0 (then plan_backward in reverse)
    with per-rank rows from `profile` (the last entry repeats when the profile is shorter)."""
    import torch

    from .planner import PlannerState, full_state_bytes, plan_backward, plan_forward

    if plan.config.inference:
        raise ValueError("inference plans keep no saved state: nothing to simulate")
    L = plan.config.max_moe_layers_per_activation_slot
    n = num_layers if num_layers is not None else max(len(profile), 1)
    if not 1 <= n <= L:
        raise ValueError(f"--layers {n} must be in [1, max_moe_layers_per_activation_slot={L}]")
    if not 0 <= tracked_rank < plan.ep_size:
        raise ValueError(f"tracked rank {tracked_rank} is not in [0, {plan.ep_size})")
    state = PlannerState.create(plan, "cpu")
    state.select(0, n)
    start_offsets = state.buffer_offsets.clone()
    sim, records = SlotSimulation(plan=plan, tracked_rank=tracked_rank), []
    for i in range(n):
        m = profile[min(i, len(profile) - 1)] if profile else 1.0
        rows = imbalanced_rows(plan, m, tracked_rank)
        rows_t = torch.tensor(rows, dtype=torch.int64)
        saved_before = state.saved_bytes[0].clone()
        candidate = int((saved_before + full_state_bytes(rows_t, plan)).max())
        rec = plan_forward(state, rows_t, tracked_rank, plan)
        records.append(rec)
        sim.layers.append(LayerDecision(
            layer=i, multiple=float(m), rows=tuple(rows),
            overflow=max(rows) > plan.total_scratch_rows, candidate_bytes=candidate,
            reserve_bytes=(n - i - 1) * plan.input_bytes,
            need_recompute=bool(rec.need_recompute),
            start=int(rec.start) - plan.slot_base(0),
            added=int(state.buffer_offsets[0]) - int(rec.start),
            saved_after=tuple(int(v) for v in state.saved_bytes[0])))
    for rec in reversed(records):
        plan_backward(state, rec)
    sim.rewound = (torch.equal(state.buffer_offsets, start_offsets)
                   and int(state.saved_bytes.abs().sum()) == 0
                   and int(state.layer_position.abs().sum()) == 0)
    return sim


def format_simulation(sim: SlotSimulation) -> str:
    plan = sim.plan
    out = [f"planner simulation: slot capacity {plan.slot_bytes:,} B, {len(sim.layers)} layer(s), "
           f"tracked rank {sim.tracked_rank} of {plan.ep_size}, balanced rows {plan.balanced_rows:,}",
           f"  {'layer':>5} {'x bal':>6} {'rows(tracked)':>14} {'rows(max)':>10} "
           f"{'worst+reserve':>16} {'decision':>9} {'offset':>14} {'kept':>14}"]
    for d in sim.layers:
        need = d.candidate_bytes + d.reserve_bytes
        decision = "replay" if d.need_recompute else "save"
        flag = "  OVERFLOW: more rows than the scratch holds" if d.overflow else ""
        out.append(f"  {'L' + str(d.layer):>5} {d.multiple:>6g} {d.rows[sim.tracked_rank]:>14,} "
                   f"{max(d.rows):>10,} {need:>16,} {decision:>9} {d.start:>14,} "
                   f"{d.added:>14,}{flag}")
    out.append(f"  backward in reverse order rewinds every cursor: {'yes' if sim.rewound else 'NO'}")
    return "\n".join(out)


# -- plan --------------------------------------------------------------------------------------
def _parse_overrides(items: Sequence[str]) -> dict:
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _parse_profile(text: str | None) -> list[float]:
    if not text:
        return []
    try:
        prof = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--imbalance expects comma-separated multiples like 1,4,8, got {text!r}")
    if not prof or any(v < 0 for v in prof):
        raise SystemExit(f"--imbalance multiples must be >= 0, got {text!r}")
    return prof


def cmd_plan(args) -> int:
    from .config import load_config
    from .memory_plan import plan_memory

    overrides = _parse_overrides(args.set)
    profile = _parse_profile(args.imbalance)
    if overrides.get("inference") is True and (profile or args.layers is not None):
        args.parser.error("--imbalance / --layers simulate the save/replay planner of a training "
                          "context; an inference plan (--set inference=true) keeps no saved "
                          "state: drop them, or plan a training context")
    layers = args.layers
    if layers is None and profile:
        layers = len(profile)
    if layers is not None:
        overrides["max_moe_layers_per_activation_slot"] = max(
            layers, overrides.get("max_moe_layers_per_activation_slot", 1))
    cfg = load_config(args.config, **overrides)
    if args.tracked_rank >= args.ep:
        args.parser.error(f"--tracked-rank {args.tracked_rank} is not a rank of --ep {args.ep} "
                          f"(0 .. {args.ep - 1})")
    plan = plan_memory(cfg, ep_size=args.ep)
    print(plan.explain())
    sim = None
    if not cfg.inference and (profile or layers is not None or args.plot):
        sim = simulate_slot(plan, profile or [1.0], layers, tracked_rank=args.tracked_rank)
        print()
        print(format_simulation(sim))
    if args.plot:
        from .plot import plot_plan

        path = plot_plan(plan, sim, args.plot, title=f"{Path(args.config).stem}, EP={args.ep}")
        print(f"\nwrote {path}")
    return 0


# -- demo --------------------------------------------------------------------------------------
DEMO_TOLERANCE = 2e-2     # bf16 rounding at h1/h2/h3/y and the gradients: errors are a few 1e-3


def demo_bytes(cfg, ranks: int) -> int:
    """Host memory the demo takes on a machine without GPUs (all ranks on it): each rank holds
    its context (the plan's allocations) and the whole problem it draws (testing.make_problem:
    x, grad_y, scores, IDs of every rank, every expert's weights) in fp64 for the oracle."""
    from .memory_plan import plan_memory

    plan = plan_memory(cfg, ep_size=ranks)
    T, D, F, K, E = (cfg.num_local_input_tokens, cfg.hidden_dim, cfg.intermediate_dim,
                     cfg.top_k, cfg.num_experts)
    problem = (2 * ranks * T * D + ranks * T * K * 2 + E * 3 * F * D) * 8
    return ranks * (plan.total_device_bytes + 2 * problem)


def available_bytes() -> int | None:
    """MemAvailable (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _capable_gpus() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    n = torch.cuda.device_count()
    if n and all(torch.cuda.get_device_capability(i) >= (9, 0) for i in range(n)):
        return n
    return 0


def _demo_worker(rank: int, world_size: int, spec: dict) -> dict:
    import torch

    from . import testing as tt
    from .config import Config
    from .context import create_context

    cfg = Config(**spec["config"])
    device = torch.device("cuda", rank) if spec["gpu"] else torch.device("cpu")
    problem = tt.make_problem(cfg, world_size, seed=spec["seed"], routing=spec["routing"],
                              inactive_fraction=0.05, num_inactive_rows=1)
    say = (lambda msg: print(f"[demo rank {rank}] {msg}", flush=True)) if rank == 0 else (
        lambda msg: None)
    if cfg.precision == "nvfp4":
        return _demo_nvfp4(rank, cfg, problem, device, say)
    with create_context(config=cfg, device=device) as ctx:
        say(f"context ready: {ctx!r}")
        t0 = time.perf_counter()
        res = tt.run_rank(ctx, problem, w13_layout="E2FD")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        backend = ctx.backend.name
    say(f"forward + backward done in {elapsed:.2f} s; computing the fp64 oracle")
    oracle = tt.oracle_results(problem, cfg)
    errors = tt.rank_errors(res, oracle, problem, rank)
    # the same math at the precision's rounding points: plain bf16 torch, or fp8_block's
    # quantization emulated in torch
    plain = (tt.oracle_results(problem, cfg, compute_dtype=None) if cfg.precision == "bf16"
             else tt.block_quant_emulation(problem, cfg))
    tok, exp = problem.tokens(rank), problem.experts(rank)
    pick = dict(y=tok, grad_x=tok, grad_scores=tok, grad_w13=exp, grad_w2=exp)
    baseline = {k: tt.relative_error(plain[k][pick[k]], oracle[k][pick[k]]) for k in pick}
    E_local = cfg.num_experts // world_size
    rows = int(((problem.ids // E_local == rank) & (problem.ids >= 0)).sum())
    return dict(errors=errors, baseline=baseline, backend=backend, rows=rows, seconds=elapsed)


def _demo_nvfp4(rank, cfg, problem, device, say) -> dict:
    """nvfp4: inference on prepared weights; y against the fp64 oracle on the dequantized
    weights, next to the same quantization emulated in plain torch."""
    import torch

    from . import testing as tt
    from .context import create_context
    from .ops import routed_experts
    from .prepared import prepare_expert_weights

    tok, exp = problem.tokens(rank), problem.experts(rank)
    w13 = problem.w13[exp].reshape(-1, 2 * cfg.intermediate_dim, cfg.hidden_dim).contiguous()
    prepared = prepare_expert_weights(w13.to(device), problem.w2[exp].contiguous().to(device),
                                      precision="nvfp4")
    with create_context(config=cfg, device=device) as ctx:
        say(f"context ready: {ctx!r}")
        t0 = time.perf_counter()
        with torch.no_grad():
            y = routed_experts(problem.x[tok].to(device), problem.ids[tok].to(device),
                               problem.scores[tok].to(device), prepared.w13, prepared.w2, ctx)
        elapsed = time.perf_counter() - t0
        backend = ctx.backend.name
    say(f"forward (inference) done in {elapsed:.2f} s; computing the fp64 oracle")
    oracle = tt.nvfp4_oracle_y(problem, cfg)[tok]
    emul = tt.nvfp4_emulation(problem, cfg)[tok]
    E_local = cfg.num_experts // problem.ep_size
    rows = int(((problem.ids // E_local == rank) & (problem.ids >= 0)).sum())
    return dict(errors=dict(y=tt.relative_error(y.cpu(), oracle)),
                baseline=dict(y=tt.relative_error(emul, oracle)), backend=backend, rows=rows,
                seconds=elapsed)


def cmd_demo(args) -> int:
    from . import testing as tt
    from .config import Config, load_config
    from .memory_plan import plan_memory

    gpus = _capable_gpus()
    if gpus:
        ranks = args.ranks or gpus
        if ranks > gpus:
            args.parser.error(f"--ranks {ranks} exceeds the {gpus} capable GPU(s)")
        backend, dist_backend = "auto", "nccl"
        where = f"{ranks} GPU rank(s), NCCL, backend 'auto' (cuda on sm_90+)"
    else:
        ranks = args.ranks or 2
        backend, dist_backend = "reference", "gloo"
        where = f"{ranks} local CPU rank(s), gloo, reference backend (no sm_90+ GPU found)"
    if args.config:
        base = load_config(args.config).to_dict()
    else:
        base = dict(num_local_input_tokens=64, hidden_dim=128, intermediate_dim=128,
                    num_experts=8, top_k=2, activation_slot_capacity_factor=1.0)
    for key, val in (("num_local_input_tokens", args.tokens), ("hidden_dim", args.hidden),
                     ("intermediate_dim", args.intermediate), ("num_experts", args.experts),
                     ("top_k", args.topk), ("activation", args.activation),
                     ("precision", args.precision), ("pipeline", args.pipeline)):
        if val is not None:
            base[key] = val
    if args.experts is None and base["num_experts"] % ranks:
        base["num_experts"] = 4 * ranks
    if base.get("precision") == "nvfp4":    # inference only, on prepared weights
        base.update(inference=True, num_activation_slots=0)
        base.pop("activation_slot_capacity_factor", None)
    from .execution import runs
    precision, pipeline = base.get("precision", "bf16"), base.get("pipeline", "standard")
    if backend == "auto" and not runs("cuda", precision, pipeline):
        backend = "reference"
        where += (f"; precision={precision!r} with pipeline={pipeline!r} on the reference "
                  f"backend (the CUDA backend does not run that pair)")
    base["backend"] = backend
    cfg = Config(**base)
    E_local = cfg.num_local_experts(ranks)
    if args.routing == "one_rank" and cfg.top_k > E_local:
        args.parser.error(f"--routing one_rank sends all of a token's {cfg.top_k} routes to one "
                          f"rank's experts, which has E_local={E_local} (E={cfg.num_experts} over "
                          f"{ranks} ranks): use --topk <= {E_local} or more --experts")
    if not gpus:
        need, have = demo_bytes(cfg, ranks), available_bytes()
        if have is not None and need > 0.8 * have:
            fit = max(1, int(cfg.num_local_input_tokens * 0.8 * have / need))
            args.parser.error(
                f"this shape needs about {need / 2**30:.1f} GiB on this CPU machine ({ranks} "
                f"ranks, each with its context and the fp64 oracle's copy of the problem) and "
                f"{have / 2**30:.1f} GiB are available; the demo runs the reference backend "
                f"here: pick a smaller shape (--tokens {min(fit, 64)} --hidden 128 "
                f"--intermediate 128, or configs/tiny.yaml)")
    plan = plan_memory(cfg, ep_size=ranks)
    print(f"[demo] {where}")
    print(plan.explain(), flush=True)
    passes = "forward (inference)" if cfg.inference else "forward + backward"
    print(f"[demo] spawning {ranks} rank(s): {passes} of one routed-experts layer "
          f"({args.routing} routing, seed {args.seed})", flush=True)
    t0 = time.perf_counter()
    spec = dict(config=cfg.to_dict(), gpu=bool(gpus), seed=args.seed, routing=args.routing)
    results = tt.spawn(_demo_worker, ranks, (spec,), backend=dist_backend, timeout_s=300)
    print(f"[demo] done in {time.perf_counter() - t0:.1f} s (including process start-up)\n")

    names = list(results[0]["errors"])
    what = ("the same math in plain bf16 torch" if cfg.precision == "bf16" else
            f"the same {cfg.precision} quantization emulated in plain torch")
    print(f"relative error vs the fp64 oracle (||got - fp64|| / ||fp64||); in brackets: {what}")
    print(f"  {'rank':>4} {'backend':>9} {'rows':>6}  " + "  ".join(f"{n:>20}" for n in names))
    worst, ok = 0.0, True
    for r, res in enumerate(results):
        cells = []
        for n in names:
            e, b = res["errors"][n], res["baseline"][n]
            worst = max(worst, e)
            if cfg.precision != "bf16":   # quantized: within 2x of the emulated quantization
                ok &= e <= 2 * b + 1e-6
            cells.append(f"{e:>9.2e} [{b:>8.2e}]")
        print(f"  {r:>4} {res['backend']:>9} {res['rows']:>6}  " + "  ".join(f"{c:>20}" for c in cells))
    if cfg.precision == "bf16":
        ok = worst < DEMO_TOLERANCE
        bound = f"tolerance {DEMO_TOLERANCE:g}"
    else:
        bound = "tolerance: 2x the bracketed error, entry by entry"
    print(f"\nmax relative error {worst:.3e} ({bound}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


# -- entry point -------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _nonnegative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    # the console script `megatron-dist-moe` and `python -m megatron_dist_moe` run the same main
    script = Path(sys.argv[0]).name == "megatron-dist-moe"
    p = argparse.ArgumentParser(prog="megatron-dist-moe" if script else "python -m megatron_dist_moe",
                                description="Dist-MoE: memory plans and a runnable demo.")
    sub = p.add_subparsers(dest="command", required=True)

    pp = sub.add_parser("plan", help="print the memory plan of a config; optionally simulate "
                        "the planner under routing imbalance and plot it")
    pp.add_argument("--config", required=True, help="YAML preset, e.g. configs/guide_bench.yaml")
    pp.add_argument("--ep", type=_positive_int, required=True, help="expert-parallel ranks")
    pp.add_argument("--imbalance", metavar="M1,M2,...",
                    help="tracked rank's rows as multiples of T*K in successive layers, e.g. 1,4,8")
    pp.add_argument("--layers", type=_positive_int,
                    help="MoE layers in the slot (default: profile length; the last multiple "
                    "repeats past it; raises max_moe_layers_per_activation_slot when needed)")
    pp.add_argument("--tracked-rank", type=_nonnegative_int, default=0,
                    help="rank receiving the multiple")
    pp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a Config field, e.g. --set activation_slot_capacity_factor=0.5")
    pp.add_argument("--plot", metavar="OUT.png", help="draw the buffer layout and the decisions")
    pp.set_defaults(func=cmd_plan, parser=pp)

    pd = sub.add_parser("demo", help="run forward + backward on local ranks and compare with an "
                        "fp64 oracle (reference backend on CPU; cuda backend on sm_90+ GPUs)")
    pd.add_argument("--ranks", type=_positive_int, help="EP ranks (default 2 on CPU, one per GPU)")
    pd.add_argument("--config", help="YAML preset for the shape (default: a small built-in shape)")
    pd.add_argument("--tokens", type=_positive_int, help="T: tokens per rank")
    pd.add_argument("--hidden", type=_positive_int, help="D")
    pd.add_argument("--intermediate", type=_positive_int, help="F")
    pd.add_argument("--experts", type=_positive_int, help="E (global)")
    pd.add_argument("--topk", type=_positive_int, help="K")
    pd.add_argument("--activation", choices=("swiglu", "swiglu_clamped"))
    pd.add_argument("--precision", choices=("bf16", "fp8_block", "mxfp8", "nvfp4"),
                    help="fp8_block: E4M3 with 1x128 / 128x128 scales; mxfp8: E4M3 with E8M0 "
                    "scales per 32; nvfp4: inference on prepared E2M1 weights (D, F multiples "
                    "of 128 for all three)")
    pd.add_argument("--pipeline", choices=PIPELINES,
                    help="the CUDA kernel sequence (the reference backend runs one algorithm "
                    "for all; dm.RUNS lists which precision runs with which)")
    pd.add_argument("--routing", default="random",
                    choices=("random", "hot_expert", "zipf", "one_rank"))
    pd.add_argument("--seed", type=int, default=0)
    pd.set_defaults(func=cmd_demo, parser=pd)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .config import ConfigError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

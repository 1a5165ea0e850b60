"""Registered ops (megatron_dist_moe/library.py): schemas, fake kernels, opcheck, make_fx, and
activation checkpointing, with the planner checked after every step.

Multi-rank cases run on 2 spawned gloo ranks in ONE process group (the reference backend), each
returning plain summaries that the tests below judge one by one. Comparisons between a
checkpointed / traced run and the eager run are exact (torch.equal): the same backend code runs
on the same values, so any difference is a bug, not rounding.
"""

from __future__ import annotations

import functools
import gc
import traceback

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import megatron_dist_moe as dm
from megatron_dist_moe import library
from megatron_dist_moe import testing as tt

EP = 2
FWD = torch.ops.dist_moe.routed_experts_fwd.default
BWD = torch.ops.dist_moe.routed_experts_bwd.default
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


def tiny_config(**kw) -> dm.Config:
    base = dict(num_local_input_tokens=16, hidden_dim=64, intermediate_dim=128, top_k=2,
                num_experts=4, backend="reference", max_moe_layers_per_activation_slot=4)
    base.update(kw)
    return dm.Config(**base)


# -- helpers run on every rank -----------------------------------------------------------------
def _inputs(problem, rank, *, grad=True, layout="E2FD"):
    tok, exp = problem.tokens(rank), problem.experts(rank)
    w13 = problem.w13[exp].contiguous()
    if layout == "E2F_D":
        w13 = w13.reshape(w13.shape[0], -1, w13.shape[-1])
    leaves = [problem.x[tok].clone(), problem.scores[tok].clone(), w13,
              problem.w2[exp].contiguous()]
    x, s, a, b = (t.requires_grad_(grad) for t in leaves)
    return x, problem.ids[tok], s, a, b


def _planner_state(ctx):
    return dict(offsets=ctx.planner.buffer_offsets.tolist(), saved=ctx.planner.saved_bytes.tolist(),
                pos=ctx.planner.layer_position.tolist(), pending=ctx.num_pending_backwards)


def _at_start(ctx):
    st = _planner_state(ctx)
    return (st["offsets"] == ctx.plan.slot_ends() and not any(map(any, st["saved"]))
            and not any(st["pos"]) and st["pending"] == 0)


def _record_training_flags(ctx):
    """Wrap the backend forward to log the `training` flag of every call."""
    flags, orig = [], ctx.backend.forward

    def forward(*args, **kwargs):
        flags.append(kwargs["training"])
        return orig(*args, **kwargs)

    ctx.backend.forward = forward
    return flags


# -- activation checkpointing ------------------------------------------------------------------
def case_checkpoint(rank, ws):
    """A region pre-linear -> routed_experts -> tanh (tanh saves its output, so a recomputation
    must re-run routed_experts). Each variant must give gradients bit-identical to the plain run
    and leave the planner at its start; the first pass must advance it exactly as plain does."""
    cfg = tiny_config()
    p = tt.make_problem(cfg, ws, seed=61, dtype=torch.float64, inactive_fraction=0.1)
    p2 = tt.make_problem(cfg, ws, seed=62, dtype=torch.float64)
    D = cfg.hidden_dim
    gen = torch.Generator().manual_seed(7)
    A = (torch.randn(D, D, generator=gen, dtype=torch.float64) / D ** 0.5)
    gy = torch.randn(cfg.num_local_input_tokens, D, generator=gen, dtype=torch.float64)
    out = {}
    with dm.create_context(config=cfg, device="cpu") as ctx:
        flags = _record_training_flags(ctx)

        def layer(h, prob, s, w13, w2):
            return dm.routed_experts(h, prob.ids[prob.tokens(rank)], s, w13, w2, ctx)

        def one(x, a, s, w13, w2):
            return torch.tanh(layer(x @ a, p, s, w13, w2))

        def two(x, a, s, w13, w2, s2, w13b, w2b):
            h = torch.tanh(layer(x @ a, p, s, w13, w2))
            return torch.tanh(layer(h, p2, s2, w13b, w2b))

        def run(variant, region, n_layers):
            x, _, s, w13, w2 = _inputs(p, rank)
            leaves = [x, A.clone().requires_grad_(True), s, w13, w2]
            if n_layers == 2:
                leaves += list(_inputs(p2, rank)[2:])
            ctx.select_activation_slot(0, n_layers)
            flags.clear()
            # every variant computes sin(region(...)); only where the checkpoints sit differs
            if variant == "plain":
                y = torch.sin(region(*leaves))
            elif variant == "nonreentrant":
                y = torch.sin(checkpoint(region, *leaves, use_reentrant=False))
            elif variant == "reentrant":
                y = torch.sin(checkpoint(region, *leaves, use_reentrant=True))
            elif variant == "nested":
                # the outer region saves for itself (sin), so its recomputation re-runs the inner
                # checkpoint's *first pass*, with that checkpoint's hooks on top
                def outer(*a):
                    return torch.sin(checkpoint(region, *a, use_reentrant=False))
                y = checkpoint(outer, *leaves, use_reentrant=False)
            elif variant == "sac_must_save":
                from torch.utils.checkpoint import create_selective_checkpoint_contexts
                y = torch.sin(checkpoint(region, *leaves, use_reentrant=False,
                                         context_fn=functools.partial(
                                             create_selective_checkpoint_contexts, [FWD])))
            mid = _planner_state(ctx)
            fwd_flags = list(flags)
            y.backward(gy)
            return dict(y=y.detach(), grads=[t.grad for t in leaves], mid=mid,
                        fwd_flags=fwd_flags, flags=list(flags), end_at_start=_at_start(ctx))

        for n, region in ((1, one), (2, two)):
            plain = run("plain", region, n)
            out[f"plain{n}"] = dict(flags=plain["flags"], end_at_start=plain["end_at_start"],
                                    mid=plain["mid"])
            for variant in ("nonreentrant", "reentrant", "nested", "sac_must_save"):
                try:
                    r = run(variant, region, n)
                except Exception:     # reported by the matching test
                    out[f"{variant}{n}"] = {"__error__": traceback.format_exc()}
                    ctx.reset()
                    continue
                out[f"{variant}{n}"] = dict(
                    y_equal=torch.equal(r["y"], plain["y"]),
                    grads_equal=[torch.equal(a, b) for a, b in zip(r["grads"], plain["grads"])],
                    grads_nonzero=[bool(g.abs().sum() > 0) for g in r["grads"]],
                    mid_equal=r["mid"] == plain["mid"], mid=r["mid"], fwd_flags=r["fwd_flags"],
                    flags=r["flags"], end_at_start=r["end_at_start"])
    return out


# -- make_fx -----------------------------------------------------------------------------------
def _node_targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def case_make_fx(rank, ws):
    from torch.fx.experimental.proxy_tensor import make_fx

    cfg = tiny_config()
    p = tt.make_problem(cfg, ws, seed=71, dtype=torch.float64, inactive_fraction=0.2)
    q = tt.make_problem(cfg, ws, seed=72, dtype=torch.float64)      # other values, same shapes
    out = {}
    with dm.create_context(config=cfg, device="cpu") as ctx:

        def train_step(x, ids, s, w13, w2, gy):
            y = dm.routed_experts(x, ids, s, w13, w2, ctx)
            return (y,) + torch.autograd.grad(y, (x, s, w13, w2), gy)

        def infer(x, ids, s, w13, w2):
            with torch.no_grad():
                return dm.routed_experts(x, ids, s, w13, w2, ctx)

        def args(prob, grad):
            return _inputs(prob, rank, grad=grad) + (prob.grad_y[prob.tokens(rank)],)

        gm = make_fx(train_step, tracing_mode="real")(*args(p, True))
        out["train_targets"] = _node_targets(gm)
        fwd_nodes = [n for n in gm.graph.nodes if n.target is FWD]
        out["fwd_training_arg"] = [n.args[6] for n in fwd_nodes]
        out["fwd_ctx_arg"] = [n.args[5] == ctx.id for n in fwd_nodes]
        out["after_trace_at_start"] = _at_start(ctx)
        for tag, prob in (("same", p), ("other", q)):
            eager = train_step(*args(prob, True))
            eager_at_start = _at_start(ctx)
            reps = []
            for _ in range(2):       # the graph is reusable: state is released on every run
                got = gm(*(t.detach() for t in args(prob, False)))
                reps.append(dict(equal=[torch.equal(a, b) for a, b in zip(got, eager)],
                                 at_start=_at_start(ctx)))
            out[tag] = dict(reps=reps, eager_at_start=eager_at_start)

        # fake tracing: only the fake kernels and metadata checks run (no collective, no planner)
        gm_fake = make_fx(train_step, tracing_mode="fake")(*args(p, True))
        out["fake_targets"] = _node_targets(gm_fake)
        out["fake_trace_at_start"] = _at_start(ctx)
        eager = train_step(*args(q, True))
        got = gm_fake(*(t.detach() for t in args(q, False)))
        out["fake_equal"] = [torch.equal(a, b) for a, b in zip(got, eager)]
        out["fake_run_at_start"] = _at_start(ctx)

        # wgrad_into travels beside the op, so tracing it is refused (real and fake modes)
        def train_step_into(x, ids, s, w13, w2, gy):
            into = ([torch.zeros(w13.shape[1:]).view(-1, w13.shape[-1]) for _ in range(len(w13))],
                    [torch.zeros(w2.shape[1:]) for _ in range(len(w2))])
            y = dm.routed_experts(x, ids, s, w13, w2, ctx, wgrad_into=into)
            return (y,) + torch.autograd.grad(y, (x, s, w13, w2), gy)

        for mode in ("real", "fake"):
            try:
                make_fx(train_step_into, tracing_mode=mode)(*args(p, True))
                out[f"into_{mode}"] = "traced"
            except dm.RoutedExpertsInputError as e:
                out[f"into_{mode}"] = e.arg
        out["into_at_start"] = _at_start(ctx)

        gm_inf = make_fx(infer, tracing_mode="real")(*_inputs(p, rank, grad=False))
        out["infer_targets"] = _node_targets(gm_inf)
        out["infer_training_arg"] = [n.args[6] for n in gm_inf.graph.nodes if n.target is FWD]
        q_in = _inputs(q, rank, grad=False)
        out["infer_equal"] = torch.equal(gm_inf(*q_in), infer(*q_in))
        out["infer_at_start"] = _at_start(ctx)
    return out


# -- opcheck -----------------------------------------------------------------------------------
BWD_SKIPPED = {
    # NOTE: aot_dispatch runs the op eagerly and then compiled, i.e. twice on the same saved_id;
    # routed_experts_bwd consumes its saved state (one backward per training forward is what
    # keeps the planner consistent), so the second call must raise. The bwd op still goes
    # through AOTAutograd, FakeTensor and functionalization: the fwd op's
    # test_aot_dispatch_dynamic traces and runs it as the backward of routed_experts_fwd.
    "test_aot_dispatch_dynamic": "consumes its saved state: a second call must raise",
}


def case_opcheck(rank, ws):
    """Every opcheck util on both ops (fp32), and schema + fake kernels again in bf16 (where
    grad_scores is fp32 while every other output is bf16)."""
    cfg = tiny_config()
    out = {}
    with dm.create_context(config=cfg, device="cpu") as ctx:

        def opcheck(op, a, util):
            try:
                torch.library.opcheck(op, a, test_utils=util)
                return "ok"
            except Exception:
                return traceback.format_exc()

        for dtype, utils in ((torch.float32, OPCHECK_UTILS),
                             (torch.bfloat16, ("test_schema", "test_faketensor"))):
            p = tt.make_problem(cfg, ws, seed=81, dtype=dtype, inactive_fraction=0.1)
            res = out[str(dtype)] = {"fwd_train": {}, "fwd_infer": {}, "bwd": {}}

            def fwd_args(training, grad):
                x, ids, s, w13, w2 = _inputs(p, rank, grad=grad, layout="E2F_D")
                return (x, ids, s, w13, w2, ctx.id, training, [], [], -1)

            for util in utils:
                res["fwd_train"][util] = opcheck(FWD, fwd_args(True, True), util)
                ctx.reset()     # forwards opcheck never differentiates leave cursors advanced
                res["fwd_infer"][util] = opcheck(FWD, fwd_args(False, False), util)
                res["fwd_infer_untouched_" + util] = _at_start(ctx)

            gy = p.grad_y[p.tokens(rank)]
            for util in utils:
                if util in BWD_SKIPPED:
                    res["bwd"][util] = "skipped"
                    continue
                # a fresh training forward (the op called directly, no autograd) for each check
                args = fwd_args(True, False)
                _, saved_id = FWD(*args)
                g = gy.clone().requires_grad_(util == "test_autograd_registration")
                res["bwd"][util] = opcheck(
                    BWD, (g, saved_id, ctx.id, cfg.top_k, list(args[3].shape),
                          list(args[4].shape)), util)
                if util != "test_autograd_registration":
                    # the check ran the op once and consumed the entry, rewinding the planner
                    res["bwd_consumed_" + util] = _at_start(ctx)
                ctx.reset()
            res["end_at_start"] = _at_start(ctx)
    return out


# -- errors, registry, lifetime ----------------------------------------------------------------
def case_errors(rank, ws):
    cfg = tiny_config()
    p = tt.make_problem(cfg, ws, seed=91, dtype=torch.float64)
    out = {}
    ctx = dm.create_context(config=cfg, device="cpu")
    other = dm.create_context(config=cfg, device="cpu")
    from megatron_dist_moe.context import context_from_id

    out["ids_distinct"] = ctx.id != other.id
    out["lookup"] = context_from_id(ctx.id) is ctx and context_from_id(other.id) is other
    gy = p.grad_y[p.tokens(rank)]

    # backward twice through the same graph
    y = dm.routed_experts(*_inputs(p, rank), ctx)
    y.backward(gy, retain_graph=True)
    try:
        y.backward(gy)
        out["twice"] = None
    except RuntimeError as e:
        out["twice"] = str(e)
    out["twice_at_start"] = _at_start(ctx)

    # the bwd op called again on a consumed saved id
    y, sid = FWD(*_inputs(p, rank, grad=False, layout="E2F_D"), ctx.id, True, [], [], -1)
    args = (gy, sid, ctx.id, cfg.top_k, [2, 2 * 128, 64], [2, 64, 128])
    BWD(*args)
    try:
        BWD(*args)
        out["bwd_op_twice"] = None
    except RuntimeError as e:
        out["bwd_op_twice"] = str(e)
    out["bwd_op_at_start"] = _at_start(ctx)

    # a stateless forward (training=False) under autograd has no backward
    x, ids, s, w13, w2 = _inputs(p, rank, layout="E2F_D")
    y, _ = FWD(x, ids, s, w13, w2, ctx.id, False, [], [], -1)
    try:
        y.backward(gy)
        out["stateless_backward"] = None
    except RuntimeError as e:
        out["stateless_backward"] = str(e)

    # a training graph dropped before backward: the saved state dies with it (the cursor stays
    # advanced until reset, as before)
    y = dm.routed_experts(*_inputs(p, rank), ctx)
    out["pending_live"] = ctx.num_pending_backwards
    del y
    gc.collect()
    out["pending_dropped"] = ctx.num_pending_backwards
    ctx.reset()
    out["reset_at_start"] = _at_start(ctx)

    # closed contexts leave the registry; the op names the ctx argument
    cid = ctx.id
    ctx.close()
    try:
        FWD(*_inputs(p, rank, grad=False, layout="E2F_D"), cid, False, [], [], -1)
        out["closed"] = None
    except ValueError as e:
        out["closed"] = dict(arg=getattr(e, "arg", None), msg=str(e))
    other.close()
    # the registry holds contexts weakly: an unclosed context that is dropped leaves it too
    dropped = dm.create_context(config=cfg, device="cpu")
    did = dropped.id
    del dropped
    gc.collect()
    try:
        context_from_id(did)
        out["registry_weak"] = False
    except ValueError:
        out["registry_weak"] = True
    return out


CASES = {"checkpoint": case_checkpoint, "make_fx": case_make_fx, "opcheck": case_opcheck,
         "errors": case_errors}


def _worker(rank, ws, names):
    out = {}
    for name in names:
        try:
            out[name] = CASES[name](rank, ws)
        except Exception:
            out[name] = {"__error__": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def results():
    return tt.spawn(_worker, EP, (list(CASES),), timeout_s=300)


def _get(results, name, sub=None):
    per_rank = [r[name] for r in results]
    for r, res in enumerate(per_rank):
        if "__error__" in res:
            pytest.fail(f"rank {r} raised in case {name}:\n{res['__error__']}")
        if sub is not None and "__error__" in res[sub]:
            pytest.fail(f"rank {r} raised in {name}/{sub}:\n{res[sub]['__error__']}")
    return per_rank if sub is None else [res[sub] for res in per_rank]


# -- tests: checkpoint -------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2])
def test_plain_reference_run(results, n):
    for res in _get(results, "checkpoint", f"plain{n}"):
        assert res["flags"] == [True] * n
        assert res["end_at_start"]
        assert res["mid"]["pos"] == [n] and res["mid"]["pending"] == n


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("variant", ["nonreentrant", "nested", "reentrant", "sac_must_save"])
def test_checkpoint_matches_plain_and_rewinds(results, variant, n):
    for res in _get(results, "checkpoint", f"{variant}{n}"):
        assert res["y_equal"], "checkpointed output differs"
        assert all(res["grads_equal"]), f"gradients differ: {res['grads_equal']}"
        assert all(res["grads_nonzero"])
        assert res["end_at_start"], "planner not back at its start after backward"
        if variant == "reentrant":
            # first pass under no_grad: stateless; recomputation = training forward + backward
            assert res["fwd_flags"] == [False] * n and res["mid"]["pending"] == 0
            assert res["flags"] == [False] * n + [True] * n
        else:
            # first pass is the training forward (state in the slot, as un-checkpointed) ...
            assert res["fwd_flags"] == [True] * n and res["mid_equal"]
            # ... and any re-run of routed_experts during backward is stateless
            assert res["flags"][:n] == [True] * n and not any(res["flags"][n:])
            if variant == "sac_must_save":
                assert res["flags"] == [True] * n, "SAC MUST_SAVE re-ran the op"
            else:
                assert len(res["flags"]) > n, "the recomputation never re-ran routed_experts"


# -- tests: make_fx ----------------------------------------------------------------------------
# Everything but the two ops: getitem of their outputs and the w13 layout views
# ([E_local, 2, F, D] <-> [E_local, 2F, D]). Validation, collectives and the backend's GEMMs
# must not appear; neither may a zero gradient for the integer saved_id output.
ALLOWED = {str(FWD), str(BWD), "<built-in function getitem>", "aten.view.default"}


def _assert_opaque(targets):
    leaked = sorted(set(targets) - ALLOWED)
    assert not leaked, f"ops other than dist_moe's leaked into the graph: {leaked}"


def test_make_fx_training_graph_has_single_op_nodes(results):
    for res in _get(results, "make_fx"):
        targets = res["train_targets"]
        assert targets.count(str(FWD)) == 1 and targets.count(str(BWD)) == 1, targets
        _assert_opaque(targets)
        assert res["fwd_training_arg"] == [True] and res["fwd_ctx_arg"] == [True]
        assert res["after_trace_at_start"]


@pytest.mark.parametrize("tag", ["same", "other"])
def test_make_fx_graph_recomputes_eager_values(results, tag):
    for res in _get(results, "make_fx"):
        r = res[tag]
        assert r["eager_at_start"]
        for rep in r["reps"]:
            assert all(rep["equal"]) and len(rep["equal"]) == 5, rep
            assert rep["at_start"], "a graph run left planner state or saved entries behind"


def test_make_fx_refuses_wgrad_into(results):
    for res in _get(results, "make_fx"):
        assert res["into_real"] == res["into_fake"] == "wgrad_into", res
        assert res["into_at_start"]


def test_make_fx_fake_tracing(results):
    for res in _get(results, "make_fx"):
        targets = res["fake_targets"]
        assert targets.count(str(FWD)) == 1 and targets.count(str(BWD)) == 1, targets
        _assert_opaque(targets)
        assert res["fake_trace_at_start"]
        assert all(res["fake_equal"]) and len(res["fake_equal"]) == 5
        assert res["fake_run_at_start"]


def test_make_fx_inference_graph(results):
    for res in _get(results, "make_fx"):
        targets = res["infer_targets"]
        assert targets.count(str(FWD)) == 1 and str(BWD) not in targets, targets
        _assert_opaque(targets)
        assert res["infer_training_arg"] == [False]
        assert res["infer_equal"] and res["infer_at_start"]


# -- tests: opcheck ----------------------------------------------------------------------------
OPCHECK_PARAMS = ([("torch.float32", u) for u in OPCHECK_UTILS]
                  + [("torch.bfloat16", u) for u in ("test_schema", "test_faketensor")])


@pytest.mark.parametrize("dtype,util", OPCHECK_PARAMS)
def test_opcheck_fwd(results, dtype, util):
    for res in _get(results, "opcheck"):
        r = res[dtype]
        assert r["fwd_train"][util] == "ok", r["fwd_train"][util]
        assert r["fwd_infer"][util] == "ok", r["fwd_infer"][util]
        assert r["fwd_infer_untouched_" + util], "a training=False call touched the planner"


@pytest.mark.parametrize("dtype,util", OPCHECK_PARAMS)
def test_opcheck_bwd(results, dtype, util):
    if util in BWD_SKIPPED:
        pytest.skip(f"routed_experts_bwd {BWD_SKIPPED[util]}")
    for res in _get(results, "opcheck"):
        r = res[dtype]
        assert r["bwd"][util] == "ok", r["bwd"][util]
        if util != "test_autograd_registration":
            assert r["bwd_consumed_" + util]
        assert r["end_at_start"]


# -- tests: errors and lifetime ----------------------------------------------------------------
def test_backward_twice_and_stateless_backward_raise(results):
    for res in _get(results, "errors"):
        assert res["twice"] and "backward ran twice" in res["twice"], res["twice"]
        assert res["twice_at_start"]
        assert res["bwd_op_twice"] and "backward ran twice" in res["bwd_op_twice"]
        assert res["bwd_op_at_start"]
        assert res["stateless_backward"] and "kept no state" in res["stateless_backward"]


def test_context_registry_and_saved_lifetime(results):
    for res in _get(results, "errors"):
        assert res["ids_distinct"] and res["lookup"]
        assert res["pending_live"] == 1 and res["pending_dropped"] == 0
        assert res["reset_at_start"]
        assert res["closed"] and res["closed"]["arg"] == "ctx", res["closed"]
        assert res["registry_weak"]


# -- in-process tests (no process group) -------------------------------------------------------
def test_schemas():
    # no argument has a default: torch 2.11 drops a trailing argument that equals its default
    # from the inputs the autograd kernel's return structure is checked against
    assert str(FWD._schema) == (
        "dist_moe::routed_experts_fwd(Tensor x, Tensor expert_ids, Tensor scores, Tensor w13, "
        "Tensor w2, SymInt ctx_id, bool training, Tensor[] wgrad_into_w13, "
        "Tensor[] wgrad_into_w2, SymInt weight_cache) -> (Tensor, Tensor)")
    assert str(BWD._schema) == (
        "dist_moe::routed_experts_bwd(Tensor grad_y, Tensor saved_id, SymInt ctx_id, "
        "SymInt top_k, SymInt[] w13_shape, SymInt[] w2_shape) -> (Tensor, Tensor, Tensor, Tensor)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_fake_kernels_describe_outputs(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    T, K, D, F, E = 24, 2, 64, 128, 3
    with FakeTensorMode():
        x = torch.empty(T, D, dtype=dtype)
        y, sid = FWD(x, torch.empty(T, K, dtype=torch.int32), torch.empty(T, K), torch.empty(
            E, 2 * F, D, dtype=dtype), torch.empty(E, D, F, dtype=dtype), 12345, True, [], [], -1)
        gx, gs, g13, g2 = BWD(torch.empty(T, D, dtype=dtype), sid, 12345, K, [E, 2 * F, D],
                              [E, D, F])
    assert (y.shape, y.dtype, y.device.type) == ((T, D), dtype, "cpu")
    assert (sid.shape, sid.dtype, sid.device.type) == ((), torch.int64, "cpu")
    assert (gx.shape, gx.dtype) == ((T, D), dtype)
    assert (gs.shape, gs.dtype) == ((T, K), torch.float64 if dtype == torch.float64
                                    else torch.float32)
    assert (g13.shape, g13.dtype) == ((E, 2 * F, D), dtype)
    assert (g2.shape, g2.dtype) == ((E, D, F), dtype)


def test_symbolic_make_fx_of_the_ops():
    """Symbolic tracing needs only the fake kernels (no context, no process group)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, ids, s, w13, w2, gy):
        y, sid = FWD(x, ids, s, w13, w2, 7, True, [], [], -1)
        return (y,) + BWD(gy, sid, 7, ids.shape[1], w13.shape, w2.shape)

    T, K, D, F, E = 8, 2, 64, 128, 2
    gm = make_fx(f, tracing_mode="symbolic")(
        torch.randn(T, D), torch.zeros(T, K, dtype=torch.int64), torch.rand(T, K),
        torch.randn(E, 2 * F, D), torch.randn(E, D, F), torch.randn(T, D))
    targets = _node_targets(gm)
    assert targets.count(str(FWD)) == 1 and targets.count(str(BWD)) == 1, targets


def test_checkpoint_recompute_detection():
    """Guards the torch internals library.in_checkpoint_recompute() relies on."""
    seen = []

    def probe(x):
        seen.append(library.in_checkpoint_recompute())
        return torch.tanh(x * 2)

    x = torch.randn(4, requires_grad=True)
    probe(x)
    assert seen == [False]
    seen.clear()
    checkpoint(probe, x, use_reentrant=False).sum().backward()
    assert seen == [False, True]
    seen.clear()
    # nested: the outer recomputation runs the inner checkpoint's first pass (its hooks on top)
    outer = lambda v: torch.sin(checkpoint(probe, v, use_reentrant=False))   # noqa: E731
    checkpoint(outer, x, use_reentrant=False).sum().backward()
    assert seen == [False, True, True], seen
    seen.clear()
    checkpoint(probe, x, use_reentrant=True).sum().backward()
    assert seen == [False, False]        # reentrant: the recomputation is a real forward
    seen.clear()
    with torch.autograd.graph.save_on_cpu():
        probe(x).sum().backward()
    assert seen == [False]

"""Bad inputs raise ValueError naming the argument, write nothing, and leave the context usable.

Runs on 2 spawned gloo ranks (one process group for every case). Each bad call is made on both
ranks alike, except unequal T and one bad argument on one rank only: those are exactly the cases
the collective check exists for (every rank must raise, none may hang). After every rejected call
the next valid call must still match the fp64 oracle and the planner must be back at its start.
"""

from __future__ import annotations

import traceback

import pytest
import torch

import megatron_dist_moe as dm
from megatron_dist_moe import testing as tt

EP = 2
T, D, F, K, E = 16, 64, 64, 2, 4


def _cfg(**kw):
    base = dict(num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F, top_k=K,
                num_experts=E, backend="reference", device_scratch_capacity_factor=1.5)
    base.update(kw)
    return dm.Config(**base)


def _bad_calls(rank):
    """name -> (expected argument name, function of the valid args returning a call)."""
    def swap(i, v):
        return lambda a: a[:i] + (v(a[i]),) + a[i + 1:]

    return {
        "x_shape": ("x", swap(0, lambda x: torch.cat([x, x], dim=1))),
        "x_dtype": ("x", swap(0, lambda x: x.to(torch.float16))),
        "x_device": ("x", swap(0, lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"))),
        "x_too_many_rows": ("x", lambda a: (torch.cat([a[0], a[0][:1]]),
                                            torch.cat([a[1], a[1][:1]]),
                                            torch.cat([a[2], a[2][:1]])) + a[3:]),
        "ids_shape": ("expert_ids", swap(1, lambda i: i[:, :1].contiguous())),
        "ids_dtype": ("expert_ids", swap(1, lambda i: i.to(torch.float32))),
        "ids_out_of_range": ("expert_ids", swap(1, lambda i: i.clone().index_fill_(0, torch.tensor([3]), E))),
        "ids_below_minus_one": ("expert_ids", swap(1, lambda i: i.clone().index_fill_(0, torch.tensor([0]), -2))),
        "ids_device": ("expert_ids", swap(1, lambda i: torch.empty(i.shape, dtype=i.dtype, device="meta"))),
        "scores_shape": ("scores", swap(2, lambda s: s.T.contiguous())),
        "scores_dtype": ("scores", swap(2, lambda s: s.to(torch.int32))),
        "score_on_inactive_route": ("scores", lambda a: _inactive_with_score(a)),
        "scores_nan": ("scores", swap(2, lambda s: s.clone().index_fill_(0, torch.tensor([1]), float("nan")))),
        "w13_shape": ("w13", swap(3, lambda w: w[:, :, : F // 2].contiguous())),
        "w13_dtype": ("w13", swap(3, lambda w: w.to(torch.float32))),
        "w13_local_experts": ("w13", swap(3, lambda w: torch.cat([w, w]))),
        # a 4-d view that is not contiguous: reshaping it would copy (a fresh tensor per call)
        "w13_4d_not_contiguous": ("w13", swap(3, lambda w: w.view(w.shape[0], 2, F, D)
                                              .transpose(2, 3).contiguous().transpose(2, 3))),
        "w2_shape": ("w2", swap(4, lambda w: w[:, : D // 2].contiguous())),
        "w2_not_contiguous": ("w2", swap(4, lambda w: w.transpose(1, 2).contiguous().transpose(1, 2))),
        "w2_dtype": ("w2", swap(4, lambda w: w.to(torch.bfloat16))),
    }


def _inactive_with_score(a):
    ids, scores = a[1].clone(), a[2].clone()
    ids[2, 1] = -1
    scores[2, 1] = 0.25
    return (a[0], ids, scores) + a[3:]


def _worker(rank, ws):
    cfg = _cfg()
    problem = tt.make_problem(cfg, ws, seed=3, dtype=torch.float64, inactive_fraction=0.2)
    oracle = tt.oracle_results(problem, cfg)
    tok, exp = problem.tokens(rank), problem.experts(rank)
    valid = (problem.x[tok], problem.ids[tok], problem.scores[tok],
             problem.w13[exp].contiguous(), problem.w2[exp].contiguous())
    out = {}
    ctx = dm.create_context(config=cfg, device="cpu")
    arena = ctx.backend._arena(torch.bfloat16)
    arena64 = ctx.backend._arena(torch.float64)

    def check_valid():
        """A valid call right after: matches the oracle, planner back at start, y[0] sane."""
        res = tt.run_rank(ctx, problem)
        err = tt.rank_errors(res, oracle, problem, rank)
        at_start = ctx.planner.buffer_offsets.tolist() == ctx.plan.slot_ends()
        return max(err.values()), at_start

    def attempt(name, arg, call):
        before = (arena.clone(), arena64.clone(), ctx.planner.buffer_offsets.clone())
        try:
            call()
            out[name] = dict(raised=None)
            return
        except Exception as e:   # noqa: BLE001 - the test inspects the type
            raised = dict(type=type(e).__name__, is_value_error=isinstance(e, ValueError),
                          arg=getattr(e, "arg", None), msg=str(e))
        raised["untouched"] = (torch.equal(before[0], arena) and torch.equal(before[1], arena64)
                               and torch.equal(before[2], ctx.planner.buffer_offsets))
        raised["expected_arg"] = arg
        raised["next_err"], raised["next_at_start"] = check_valid()
        out[name] = raised

    for name, (arg, make) in _bad_calls(rank).items():
        args = make(valid)
        attempt(name, arg, lambda: dm.routed_experts(*args, ctx))

    # routed_experts(wgrad_into=...): fp32 per-expert accumulators, E_local of each
    E_local = E // ws
    good = ([torch.zeros(2 * F, D) for _ in range(E_local)],
            [torch.zeros(D, F) for _ in range(E_local)])
    bad_into = {
        "wgrad_into_not_a_pair": good[0],
        "wgrad_into_count": (good[0][:-1], good[1]),
        "wgrad_into_dtype": ([t.to(torch.bfloat16) for t in good[0]], good[1]),
        "wgrad_into_shape": (good[0], [t.T for t in good[1]]),
        "wgrad_into_not_tensor": (good[0], [0.0] * E_local),
        "wgrad_into_aliased": (good[0], [good[1][0]] * E_local),   # one tensor for every expert
    }
    for name, into in bad_into.items():
        attempt(name, "wgrad_into", lambda into=into: dm.routed_experts(*valid, ctx, wgrad_into=into))

    # unequal T across ranks: only rank 1 drops a row (and stays within num_local_input_tokens)
    def unequal():
        a = valid if rank == 0 else tuple(t[:-1] for t in valid[:3]) + valid[3:]
        dm.routed_experts(*a, ctx)
    attempt("unequal_T", "x", unequal)

    # a bad input on one rank only: every rank raises (no rank is left waiting in a collective)
    bad_ids = _bad_calls(rank)["ids_out_of_range"][1](valid)
    attempt("one_rank_bad_ids", "expert_ids",
            lambda: dm.routed_experts(*(bad_ids if rank == 1 else valid), ctx))

    # x's dtype differs across ranks (each valid alone): every rank raises instead of the
    # exchange aborting on rows of different widths
    as32 = tuple(t.float() if t.is_floating_point() else t for t in valid)
    attempt("one_rank_dtype", "x", lambda: dm.routed_experts(*(as32 if rank == 1 else valid), ctx))

    # bad slot selections name their parameter
    attempt("slot_index", "slot", lambda: ctx.select_activation_slot(1, 1))
    attempt("slot_negative", "slot", lambda: ctx.select_activation_slot(-1, 1))
    attempt("slot_float", "slot", lambda: ctx.select_activation_slot(0.0, 1))
    attempt("slot_bool", "slot", lambda: ctx.select_activation_slot(False, 1))
    # any integer type is an index (numpy's, a 0-d integer tensor), checked as one
    import numpy as np
    attempt("slot_numpy_out_of_range", "slot", lambda: ctx.select_activation_slot(np.int64(1), 1))
    ctx.select_activation_slot(np.int64(0), torch.tensor(1))
    out["slot_numpy_accepted"] = True
    attempt("slot_layers_zero", "num_moe_layers_in_slot", lambda: ctx.select_activation_slot(0, 0))
    attempt("slot_layers_too_many", "num_moe_layers_in_slot",
            lambda: ctx.select_activation_slot(0, 2))
    ctx.select_activation_slot(0, 1)

    # overflow: every route to rank 0's experts, 2*T*K rows > 1.5*T*K scratch rows
    hot = tt.make_problem(cfg, ws, seed=4, dtype=torch.float64, routing="one_rank", target_rank=0)
    h_tok = hot.tokens(rank)
    attempt("overflow", "expert_ids",
            lambda: dm.routed_experts(hot.x[h_tok], hot.ids[h_tok], hot.scores[h_tok], *valid[3:], ctx))
    out["plan_rows"] = (ctx.plan.total_scratch_rows, 2 * T * K)

    # closed context: the argument is ctx; a fresh context then works
    ctx.close()
    out["closed_methods"] = {}
    for method, call in (("select_activation_slot", lambda: ctx.select_activation_slot(0, 1)),
                         ("reset", ctx.reset)):
        try:
            call()
            out["closed_methods"][method] = None
        except ValueError as e:
            out["closed_methods"][method] = str(e)
    try:
        dm.routed_experts(*valid, ctx)
        out["closed"] = dict(raised=None)
    except Exception as e:   # noqa: BLE001
        out["closed"] = dict(type=type(e).__name__, is_value_error=isinstance(e, ValueError),
                             arg=getattr(e, "arg", None), msg=str(e))
    ctx = dm.create_context(config=cfg, device="cpu")
    out["closed"]["next_err"], out["closed"]["next_at_start"] = check_valid()
    ctx.close()
    return out


NAMES = list(_bad_calls(0)) + ["unequal_T", "one_rank_bad_ids", "one_rank_dtype", "slot_index",
                               "slot_negative", "slot_float", "slot_bool",
                               "slot_numpy_out_of_range", "slot_layers_zero",
                               "slot_layers_too_many", "overflow", "wgrad_into_not_a_pair",
                               "wgrad_into_count", "wgrad_into_dtype", "wgrad_into_shape",
                               "wgrad_into_not_tensor", "wgrad_into_aliased"]


@pytest.fixture(scope="module")
def results():
    try:
        return tt.spawn(_worker, EP, timeout_s=120)
    except Exception:
        pytest.fail(traceback.format_exc())


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_raises_value_error_naming_argument(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        assert r.get("raised", True) is not None, f"rank {rank}: {name} was accepted"
        assert r["is_value_error"], f"rank {rank}: {name} raised {r['type']}: {r['msg']}"
        arg = r["expected_arg"]
        if r["arg"] is not None:
            assert r["arg"] == arg, r["msg"]
        assert f"({arg})" in r["msg"], f"message does not name {arg!r}: {r['msg']}"
        assert r["untouched"], f"rank {rank}: {name} wrote to the arena or planner before failing"
        assert r["next_err"] < 1e-10, f"rank {rank}: call after {name} is wrong ({r['next_err']:.3g})"
        assert r["next_at_start"]


def test_unequal_T_names_both_values(results):
    for res in results:
        msg = res["unequal_T"]["msg"]
        assert f"T = [{T}, {T - 1}]" in msg, msg


def test_overflow_names_required_and_available_rows(results):
    available, required = results[0]["plan_rows"]
    assert available < required
    for res in results:
        msg = res["overflow"]["msg"]
        assert f"receive {required} routed rows" in msg and f"holds {available}" in msg, msg


def test_closed_context(results):
    for res in results:
        r = res["closed"]
        assert r["is_value_error"] and r["arg"] == "ctx", r
        assert r["next_err"] < 1e-10 and r["next_at_start"]
        # the context's own methods on a closed context: ValueErrors naming ctx
        for method in ("select_activation_slot", "reset"):
            assert res["closed_methods"][method] == f"{method}(ctx): this Dist-MoE context is "\
                                                    "closed; create a new one", res["closed_methods"]


def test_aliased_wgrad_into_names_both_accumulators(results):
    for res in results:
        assert "w2[0] and w2[1] share memory" in res["wgrad_into_aliased"]["msg"], res


def test_slot_index_takes_any_integer_type(results):
    for res in results:
        assert res["slot_numpy_accepted"]
        assert "expected an integer, got float 0.0" in res["slot_float"]["msg"]
        assert "expected an integer, got bool False" in res["slot_bool"]["msg"]
        assert "1 is not in [0, num_activation_slots=1)" in res["slot_numpy_out_of_range"]["msg"]


def _group_still_works() -> float:
    """An all_reduce of ones after the refusals: the group's size where no rank was left
    waiting in a collective."""
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _differing_config_worker(rank: int, world_size: int):
    """Rank 1 asks for hidden_dim 256 and top_k 3 where rank 0 asks for 128 and 2."""
    import megatron_dist_moe as dm
    shape = dict(num_local_input_tokens=8, hidden_dim=128, intermediate_dim=128, top_k=2,
                 num_experts=4, backend="reference")
    if rank == 1:
        shape.update(hidden_dim=256, top_k=3)
    try:
        dm.create_context(config=dm.Config(**shape))
    except dm.ConfigError as e:
        out = dict(field=e.field, msg=str(e))
    else:
        out = dict(field=None, msg="no error")
    # the process group still works after the refusal (no rank was left waiting)
    out["after"] = _group_still_works()
    return out


def test_config_that_differs_across_ranks_is_refused_on_every_rank():
    """Instead of a gloo abort at the first call: every rank raises ConfigError naming the
    differing fields and each rank's value, and the group stays usable."""
    from megatron_dist_moe.testing import spawn
    out = spawn(_differing_config_worker, 2)
    for r, o in enumerate(out):
        assert o["field"] == "hidden_dim", o
        assert "hidden_dim (rank 0: 128, rank 1: 256)" in o["msg"], o["msg"]
        assert "top_k (rank 0: 2, rank 1: 3)" in o["msg"], o["msg"]
        assert o["after"] == 2.0


def _inference_grad_worker(rank: int, world_size: int):
    """On an inference context rank 0 passes an x that requires grad, rank 1 does not."""
    cfg = _cfg(inference=True, num_activation_slots=0)
    problem = tt.make_problem(cfg, world_size, seed=5, dtype=torch.float64)
    oracle = tt.oracle_results(problem, cfg)
    tok, exp = problem.tokens(rank), problem.experts(rank)
    x = problem.x[tok].clone().requires_grad_(rank == 0)
    out = {}
    with dm.create_context(config=cfg, device="cpu") as ctx:
        try:
            dm.routed_experts(x, problem.ids[tok], problem.scores[tok],
                              problem.w13[exp].contiguous(), problem.w2[exp].contiguous(), ctx)
            out.update(arg=None, msg="no error")
        except dm.RoutedExpertsInputError as e:
            out.update(arg=e.arg, msg=str(e))
        res = tt.run_rank(ctx, problem, backward=False)
        out["next_err"] = max(tt.rank_errors(res, oracle, problem, rank).values())
    out["after"] = _group_still_works()
    return out


def test_grad_mode_refused_on_one_rank_is_refused_on_every_rank():
    """The refusal comes before the cross-rank agreement: rank 1 is told rank 0 refused instead
    of waiting for it in the exchange; both contexts stay usable."""
    out = tt.spawn(_inference_grad_worker, 2, timeout_s=120)
    assert out[0]["arg"] == "ctx" and "Config.inference=True" in out[0]["msg"], out[0]
    assert out[1]["arg"] == "ctx" and "rank 0" in out[1]["msg"], out[1]
    for o in out:
        assert o["next_err"] < 1e-10 and o["after"] == 2.0, o


def _group_type_worker(rank: int, world_size: int):
    try:
        dm.create_context(group="world", config=_cfg(), device="cpu")
    except TypeError as e:
        return str(e)
    return "no error"


def test_create_context_names_a_group_that_is_not_a_process_group():
    out = tt.spawn(_group_type_worker, 1, timeout_s=60)
    assert out[0].startswith("create_context(group): expected a torch.distributed ProcessGroup"), out


def _schedule_worker(rank: int, world_size: int):
    """Training forwards after different slot selections, then in different grad modes: every
    rank raises naming ctx (none is left waiting, no planner moved); then a matching call works."""
    cfg = _cfg(max_moe_layers_per_activation_slot=2)
    problem = tt.make_problem(cfg, world_size, seed=6, dtype=torch.float64)
    oracle = tt.oracle_results(problem, cfg)
    tok, exp = problem.tokens(rank), problem.experts(rank)
    out = {}
    with dm.create_context(config=cfg, device="cpu") as ctx:
        w = (problem.w13[exp].contiguous().requires_grad_(),
             problem.w2[exp].contiguous().requires_grad_())

        def call(name, grad=True):
            before = ctx.planner.buffer_offsets.clone()
            try:
                with torch.set_grad_enabled(grad):
                    dm.routed_experts(problem.x[tok], problem.ids[tok], problem.scores[tok], *w,
                                      ctx)
                out[name] = dict(arg=None, msg="no error")
            except dm.RoutedExpertsInputError as e:
                out[name] = dict(arg=e.arg, msg=str(e))
            out[name]["untouched"] = torch.equal(before, ctx.planner.buffer_offsets)

        ctx.select_activation_slot(0, 2 if rank == 0 else 1)
        call("layers")
        ctx.select_activation_slot(0, 1)
        call("grad_mode", grad=rank == 0)
        res = tt.run_rank(ctx, problem)
        out["next_err"] = max(tt.rank_errors(res, oracle, problem, rank).values())
    out["after"] = _group_still_works()
    return out


def test_ranks_with_different_schedules_raise_on_every_rank():
    out = tt.spawn(_schedule_worker, 2, timeout_s=120)
    for r, o in enumerate(out):
        a = o["layers"]
        assert a["arg"] == "ctx" and a["untouched"], a
        assert (f"this is rank {r}, per rank: ['training, slot 0 for 2 layer(s)', "
                "'training, slot 0 for 1 layer(s)']") in a["msg"], a["msg"]
        g = o["grad_mode"]
        assert g["arg"] == "ctx" and g["untouched"], g
        assert "['training, slot 0 for 1 layer(s)', 'no training forward']" in g["msg"], g["msg"]
        assert o["next_err"] < 1e-10 and o["after"] == 2.0, o


def _device_memory_worker(rank: int, world_size: int):
    """Rank 1's device (a stand-in) holds 1 GiB in all, rank 0's 2 TiB; the plan needs 2 GiB:
    every rank raises the same ConfigError (the other rank's check would pass on its own)."""
    import megatron_dist_moe.context as C
    C._device_total_bytes = lambda device: 2 ** 41 if rank == 0 else 2 ** 30
    try:
        dm.create_context(config=_cfg(activation_slot_bytes=2 ** 31), device="cpu")
    except dm.ConfigError as e:
        return dict(field=e.field, msg=str(e))
    return dict(field=None, msg="no error")


def test_a_plan_past_one_rank_device_memory_is_refused_on_every_rank():
    out = tt.spawn(_device_memory_worker, 2, timeout_s=120)
    for o in out:
        assert o["field"] == "activation_slot_bytes", o
        assert "rank 1's device has 1.00 GiB in all" in o["msg"], o["msg"]

"""Reference backend on 2 spawned gloo ranks: forward and every gradient against the fp64 oracle.

All cases run inside ONE spawned process group (spawning costs seconds on a 2-core CI machine);
each case returns plain numbers and the tests below judge them one by one.

Tolerances:
  fp64 inputs   the reference computes in fp64 end to end: relative error < 1e-10.
  bf16 inputs   rounding to bf16 (unit roundoff 2^-8 = 3.9e-3) at h1, h2, h3, y, grad_h3, grad_h2,
                grad_h1 and the route input gradients gives norm-wise errors of a few 1e-3. We
                require err < 2e-2 AND err <= 2 x the error of the same math in plain bf16 torch
                (the oracle run in bf16), and we check that 2e-2 rejects a 10 % score
                perturbation, so the bound is neither hopeful nor vacuous.
"""

from __future__ import annotations

import traceback

import pytest
import torch

import megatron_dist_moe as dm
from megatron_dist_moe import testing as tt

EP = 2
BF16_TOL = 2e-2
FP64_TOL = 1e-10


def tiny_config(**kw) -> dm.Config:
    base = dict(num_local_input_tokens=32, hidden_dim=64, intermediate_dim=128, top_k=2,
                num_experts=8, backend="reference", activation_slot_capacity_factor=1.0)
    base.update(kw)
    return dm.Config(**base)


def _pick(problem, rank):
    tok, exp = problem.tokens(rank), problem.experts(rank)
    return dict(y=tok, grad_x=tok, grad_scores=tok, grad_w13=exp, grad_w2=exp)


# -- cases (run on every rank; return picklable summaries) -------------------------------------
def case_oracle(rank, ws, *, dtype, routing, layout="E2FD", cfg_kw=None, problem_kw=None,
                wgrad_into=False):
    cfg = tiny_config(**(cfg_kw or {}))
    problem = tt.make_problem(cfg, ws, seed=11, dtype=dtype, routing=routing, **(problem_kw or {}))
    with dm.create_context(config=cfg, device="cpu") as ctx:
        res = tt.run_rank(ctx, problem, w13_layout=layout, wgrad_into=wgrad_into)
        cursors = ctx.planner.buffer_offsets.tolist()
        start = ctx.plan.slot_ends()
        saved = ctx.planner.saved_bytes.abs().sum().item()
    oracle = tt.oracle_results(problem, cfg)
    out = dict(err=tt.rank_errors(res, oracle, problem, rank), cursors=cursors, start=start,
               saved=saved)
    tok = problem.tokens(rank)
    dead = (problem.ids[tok] < 0).all(dim=1)
    out["num_dead_rows"] = int(dead.sum())
    out["dead_rows_exact_zero"] = bool((res["y"][dead] == 0).all()) and not bool(
        torch.signbit(res["y"][dead]).any())
    out["dead_rows_grad_x_zero"] = bool((res["grad_x"][dead] == 0).all())
    inactive = problem.ids[tok] < 0
    out["num_inactive_routes"] = int(inactive.sum())
    out["inactive_grad_scores_zero"] = bool((res["grad_scores"][inactive] == 0).all())
    out["rows_received"] = int((problem.ids // cfg.num_local_experts(ws) == rank)
                               .logical_and(problem.ids >= 0).sum())
    out["y_dtype"] = str(res["y"].dtype)
    if cfg.precision != "bf16":
        # the same quantization emulated per expert in plain torch (testing.block_quant_emulation)
        em = tt.block_quant_emulation(problem, cfg)
        pick = _pick(problem, rank)
        out["vs_emulation"] = {k: tt.relative_error(res[k], em[k][pick[k]]) for k in pick}
        out["baseline"] = {k: tt.relative_error(em[k][pick[k]], oracle[k][pick[k]])
                           for k in pick}
    elif dtype == torch.bfloat16:
        base = tt.oracle_results(problem, cfg, compute_dtype=None)   # plain torch in bf16
        pick = _pick(problem, rank)
        out["baseline"] = {k: tt.relative_error(base[k][pick[k]], oracle[k][pick[k]])
                           for k in pick}
        # a 10 % perturbation of one route's scores must fail the tolerance
        wrong = problem.scores.clone()
        wrong[:, 0] *= 0.9
        y_wrong = tt.routed_experts_oracle(problem.x, problem.ids, wrong, problem.w13, problem.w2,
                                           activation=cfg.activation,
                                           swiglu_alpha=cfg.swiglu_alpha,
                                           swiglu_limit=cfg.swiglu_limit)
        out["perturbed_err"] = tt.relative_error(y_wrong[tok], oracle["y"][tok])
    return out


def _chain(ctx, layers, x0, grad_y, slots):
    """Run the layers in sequence (layer i into slot slots[i]) and backward; returns grads."""
    x = x0.clone().requires_grad_(True)
    params, h, records = [], x, []
    for (ids, scores, w13, w2), (slot, n) in zip(layers, slots):
        if slot is not None:
            ctx.select_activation_slot(slot, n)
        s = scores.clone().requires_grad_(True)
        a, b = w13.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        h = dm.routed_experts(h, ids, s, a, b, ctx)
        records.append(h.grad_fn.saved.record)
        params.append((s, a, b))
    need = [bool(r.need_recompute) for r in records]
    mid_cursor = ctx.planner.buffer_offsets.tolist()
    h.backward(grad_y)
    grads = [x.grad] + [t.grad for p in params for t in p]
    return grads, need, mid_cursor, h.detach()


def case_multilayer(rank, ws):
    """Three layers in one slot; the slot is sized so the middle (hot) layer replays."""
    cfg_small = tiny_config(max_moe_layers_per_activation_slot=3, activation_slot_capacity_factor=None,
                            activation_slot_bytes=120_000)
    cfg_big = cfg_small.replace(activation_slot_bytes=None, activation_slot_capacity_factor=None)
    cfg_big = cfg_big.replace(activation_slot_bytes=tt_plan_max(cfg_big, ws))
    T = cfg_small.num_local_input_tokens
    layers, gen = [], torch.Generator().manual_seed(5)
    probs = [tt.make_problem(cfg_small, ws, seed=21 + i, routing=r)
             for i, r in enumerate(("random", "one_rank", "random"))]
    for p in probs:
        tok, exp = p.tokens(rank), p.experts(rank)
        layers.append((p.ids[tok], p.scores[tok], p.w13[exp].contiguous(), p.w2[exp].contiguous()))
    x0 = probs[0].x[probs[0].tokens(rank)]
    grad_y = torch.randn(T, cfg_small.hidden_dim, generator=gen).to(torch.bfloat16)
    out = {}
    for tag, cfg in (("replay", cfg_small), ("save", cfg_big)):
        with dm.create_context(config=cfg, device="cpu") as ctx:
            grads, need, mid, y = _chain(ctx, layers, x0, grad_y, [(0, 3), (None, 0), (None, 0)])
            out[tag] = dict(grads=grads, need=need, y=y, mid=mid,
                            end=ctx.planner.buffer_offsets.tolist(), start=ctx.plan.slot_ends(),
                            saved_end=ctx.planner.saved_bytes.tolist(),
                            pos_end=ctx.planner.layer_position.tolist())
    same = all(torch.equal(a, b) for a, b in zip(out["replay"]["grads"], out["save"]["grads"]))
    return dict(need_replay=out["replay"]["need"], need_save=out["save"]["need"],
                grads_identical=same, y_identical=torch.equal(out["replay"]["y"], out["save"]["y"]),
                # weight grads of the hot layer are zero on the rank owning no routed expert
                grads_nonzero=all(bool(g.abs().sum() > 0) for g in out["replay"]["grads"][:2]),
                end=out["replay"]["end"], start=out["replay"]["start"],
                mid=out["replay"]["mid"], saved_end=out["replay"]["saved_end"],
                pos_end=out["replay"]["pos_end"])


def tt_plan_max(cfg, ws):
    return dm.plan_memory(cfg, ep_size=ws).slot_max_useful_bytes


def case_two_slots(rank, ws):
    """Two independent layers in two slots; backwards run in forward order (not LIFO)."""
    cfg = tiny_config(num_activation_slots=2)
    pa = tt.make_problem(cfg, ws, seed=31, dtype=torch.float64, routing="hot_expert")
    pb = tt.make_problem(cfg, ws, seed=32, dtype=torch.float64, routing="random",
                         inactive_fraction=0.3)
    with dm.create_context(config=cfg, device="cpu") as ctx:
        ctx.select_activation_slot(0, 1)
        fa = _start(ctx, pa, rank)
        cursor_a = ctx.planner.buffer_offsets.tolist()
        ctx.select_activation_slot(1, 1)
        fb = _start(ctx, pb, rank)
        cursor_ab = ctx.planner.buffer_offsets.tolist()
        slots = [int(f["y"].grad_fn.saved.record.slot) for f in (fa, fb)]
        errs = [_finish(f, p, cfg, rank) for f, p in ((fa, pa), (fb, pb))]
        end = ctx.planner.buffer_offsets.tolist()
        start = ctx.plan.slot_ends()
    return dict(slots=slots, errs=errs, cursor_a=cursor_a, cursor_ab=cursor_ab, end=end,
                start=start, slot_bytes=ctx.plan.slot_bytes)


def _start(ctx, p, rank):
    tok, exp = p.tokens(rank), p.experts(rank)
    leaves = dict(x=p.x[tok].clone().requires_grad_(True),
                  scores=p.scores[tok].clone().requires_grad_(True),
                  w13=p.w13[exp].contiguous().requires_grad_(True),
                  w2=p.w2[exp].contiguous().requires_grad_(True))
    y = dm.routed_experts(leaves["x"], p.ids[tok], leaves["scores"], leaves["w13"], leaves["w2"],
                          ctx)
    return dict(leaves, y=y)


def _finish(f, p, cfg, rank):
    f["y"].backward(p.grad_y[p.tokens(rank)])
    res = dict(y=f["y"].detach(), grad_x=f["x"].grad, grad_scores=f["scores"].grad,
               grad_w13=f["w13"].grad, grad_w2=f["w2"].grad)
    return tt.rank_errors(res, tt.oracle_results(p, cfg), p, rank)


def case_no_grad(rank, ws):
    """A no_grad forward on a training context uses scratch only: planner state untouched."""
    cfg = tiny_config()
    p = tt.make_problem(cfg, ws, seed=41)
    with dm.create_context(config=cfg, device="cpu") as ctx:
        ctx.select_activation_slot(0, 1)
        before = [t.clone() for t in (ctx.planner.buffer_offsets, ctx.planner.saved_bytes,
                                      ctx.planner.layer_position, ctx.planner.selected)]
        y_ng = tt.run_rank(ctx, p, backward=False)["y"]
        after = [ctx.planner.buffer_offsets, ctx.planner.saved_bytes,
                 ctx.planner.layer_position, ctx.planner.selected]
        untouched = all(torch.equal(a, b) for a, b in zip(before, after))
        slot = ctx.backend._arena(torch.bfloat16)[:ctx.plan.scratch_offset]
        slot_untouched = bool((slot == 0xFF).all())
        y_tr = tt.run_rank(ctx, p)["y"]
    inf_cfg = cfg.replace(inference=True, num_activation_slots=0)
    with dm.create_context(config=inf_cfg, device="cpu") as ctx:
        y_inf = tt.run_rank(ctx, p, backward=False)["y"]
        try:
            tt.run_rank(ctx, p)
            inf_backward_error = None
        except ValueError as e:
            inf_backward_error = str(e)
    return dict(untouched=untouched, slot_untouched=slot_untouched,
                same_as_training=torch.equal(y_ng, y_tr), same_as_inference=torch.equal(y_ng, y_inf),
                inf_backward_error=inf_backward_error)


def case_zero_tokens(rank, ws):
    cfg = tiny_config()
    p = tt.make_problem(cfg, ws, seed=51, num_tokens=0)
    with dm.create_context(config=cfg, device="cpu") as ctx:
        res = tt.run_rank(ctx, p)
        end = ctx.planner.buffer_offsets.tolist()
        start = ctx.plan.slot_ends()
    return dict(shapes={k: list(v.shape) for k, v in res.items()}, end=end, start=start)


CASES = {
    "fp64_random_inactive": dict(fn=case_oracle, dtype=torch.float64, routing="random",
                                 problem_kw=dict(inactive_fraction=0.25, num_inactive_rows=4)),
    "fp64_random_E2F_D_clamped": dict(fn=case_oracle, dtype=torch.float64, routing="random",
                                      layout="E2F_D",
                                      cfg_kw=dict(activation="swiglu_clamped", swiglu_limit=0.75),
                                      problem_kw=dict(inactive_fraction=0.1, num_inactive_rows=2)),
    "fp64_one_rank": dict(fn=case_oracle, dtype=torch.float64, routing="one_rank",
                          problem_kw=dict(target_rank=1)),
    "fp64_hot_expert_clamped": dict(fn=case_oracle, dtype=torch.float64, routing="hot_expert",
                                    layout="E2F_D",
                                    cfg_kw=dict(activation="swiglu_clamped", swiglu_limit=0.75),
                                    problem_kw=dict(hot_expert=5, num_inactive_rows=3)),
    "fp32_zipf_clamped_wgrad_bf16": dict(fn=case_oracle, dtype=torch.float32, routing="zipf",
                                         cfg_kw=dict(wgrad_dtype="bf16",
                                                     activation="swiglu_clamped",
                                                     swiglu_limit=0.75)),
    "bf16_random_inactive": dict(fn=case_oracle, dtype=torch.bfloat16, routing="random",
                                 problem_kw=dict(inactive_fraction=0.25, num_inactive_rows=4)),
    # NOTE: the clamp's derivative jumps at +-limit and bf16 rounding of h1 moves a few values
    # across it; each flip costs O(1) of that gradient entry, so with a limit inside the h1
    # distribution the gradient error is dominated by a handful of flips (plain bf16 torch misses
    # grad_x by 2-7 %). Clamping itself is checked in fp64/fp32 above; in bf16 we use the
    # GPT-OSS limit 7, which h1 ~ N(0, 1) never reaches, to check the rest of the formula.
    "bf16_one_rank_E2F_D_clamped": dict(fn=case_oracle, dtype=torch.bfloat16, routing="one_rank",
                                        layout="E2F_D",
                                        cfg_kw=dict(activation="swiglu_clamped", swiglu_limit=7.0),
                                        problem_kw=dict(target_rank=0, num_inactive_rows=2)),
    "bf16_hot_expert": dict(fn=case_oracle, dtype=torch.bfloat16, routing="hot_expert",
                            problem_kw=dict(hot_expert=1)),
    # Config.save_route_outputs=False: score gradients computed on the expert side
    "fp64_random_inactive_expert_score_grads": dict(
        fn=case_oracle, dtype=torch.float64, routing="random",
        cfg_kw=dict(save_route_outputs=False),
        problem_kw=dict(inactive_fraction=0.25, num_inactive_rows=4)),
    "fp64_one_rank_clamped_expert_score_grads_replay": dict(
        fn=case_oracle, dtype=torch.float64, routing="one_rank",
        cfg_kw=dict(save_route_outputs=False, activation="swiglu_clamped", swiglu_limit=0.75,
                    activation_slot_capacity_factor=0.0),
        problem_kw=dict(target_rank=1)),
    "fp64_hot_expert_replay": dict(fn=case_oracle, dtype=torch.float64, routing="hot_expert",
                                   cfg_kw=dict(activation_slot_capacity_factor=0.0),
                                   problem_kw=dict(hot_expert=3, num_inactive_rows=2)),
    "bf16_random_inactive_expert_score_grads": dict(
        fn=case_oracle, dtype=torch.bfloat16, routing="random",
        cfg_kw=dict(save_route_outputs=False),
        problem_kw=dict(inactive_fraction=0.25, num_inactive_rows=4)),
    # weight gradients added into fp32 accumulators (Megatron's main_grad), weights get zeros
    "bf16_random_inactive_wgrad_into": dict(
        fn=case_oracle, dtype=torch.bfloat16, routing="random", wgrad_into=True,
        problem_kw=dict(inactive_fraction=0.25, num_inactive_rows=4)),
    # fp8_block: E4M3 operands, 1x128 / 128x128 scales (D, F multiples of 128)
    "fp8_block_random_inactive": dict(
        fn=case_oracle, dtype=torch.bfloat16, routing="random",
        cfg_kw=dict(precision="fp8_block", hidden_dim=128, intermediate_dim=256),
        problem_kw=dict(inactive_fraction=0.25, num_inactive_rows=4)),
    "fp8_block_one_rank_replay_saved_routes": dict(
        fn=case_oracle, dtype=torch.bfloat16, routing="one_rank",
        cfg_kw=dict(precision="fp8_block", hidden_dim=256, intermediate_dim=128,
                    save_route_outputs=True, activation_slot_capacity_factor=0.0),
        problem_kw=dict(target_rank=1)),
    "fp8_block_hot_expert_clamped_fp32_scales": dict(
        fn=case_oracle, dtype=torch.bfloat16, routing="hot_expert", layout="E2F_D",
        cfg_kw=dict(precision="fp8_block", hidden_dim=128, intermediate_dim=384,
                    activation="swiglu_clamped", fp8_power_2_scales=False),
        problem_kw=dict(hot_expert=1, num_inactive_rows=2)),
    # mxfp8: E4M3 with E8M0 scales per 32 values (weights per 32 x 32 tile)
    "mxfp8_random_inactive": dict(
        fn=case_oracle, dtype=torch.bfloat16, routing="random",
        cfg_kw=dict(precision="mxfp8", hidden_dim=128, intermediate_dim=256),
        problem_kw=dict(inactive_fraction=0.25, num_inactive_rows=4)),
    "mxfp8_hot_expert_replay_saved_routes": dict(
        fn=case_oracle, dtype=torch.bfloat16, routing="hot_expert",
        cfg_kw=dict(precision="mxfp8", hidden_dim=256, intermediate_dim=128,
                    save_route_outputs=True, activation_slot_capacity_factor=0.0),
        problem_kw=dict(hot_expert=2, num_inactive_rows=2)),
    "multilayer": dict(fn=case_multilayer),
    "two_slots": dict(fn=case_two_slots),
    "no_grad": dict(fn=case_no_grad),
    "zero_tokens": dict(fn=case_zero_tokens),
}


def _worker(rank, ws, names):
    out = {}
    for name in names:
        spec = dict(CASES[name])
        fn = spec.pop("fn")
        try:
            out[name] = fn(rank, ws, **spec)
        except Exception:   # reported by the matching test; other cases still run
            out[name] = {"__error__": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def results():
    return tt.spawn(_worker, EP, (list(CASES),), timeout_s=120)


def _get(results, name):
    per_rank = [r[name] for r in results]
    for r, res in enumerate(per_rank):
        if "__error__" in res:
            pytest.fail(f"rank {r} raised in case {name}:\n{res['__error__']}")
    return per_rank


ORACLE_CASES = [n for n, c in CASES.items() if c["fn"] is case_oracle]


@pytest.mark.parametrize("name", ORACLE_CASES)
def test_forward_and_gradients_match_oracle(results, name):
    spec = CASES[name]
    for rank, res in enumerate(_get(results, name)):
        err = res["err"]
        assert set(err) == set(tt.RESULT_NAMES)
        if spec["dtype"] == torch.float64:
            for k, v in err.items():
                assert v < FP64_TOL, f"rank {rank} {k}: rel err {v:.3g}"
        elif spec["dtype"] == torch.float32:
            for k, v in err.items():
                # wgrad_dtype="bf16": weight gradients are rounded to bf16, the rest stays fp32
                tol = 8e-3 if k.startswith("grad_w") else 1e-5
                assert v < tol, f"rank {rank} {k}: rel err {v:.3g}"
            assert max(err["grad_w13"], err["grad_w2"]) > 1e-5, "wgrad_dtype='bf16' not honoured"
        elif "vs_emulation" in res:
            # block-scaled: the reference is that emulation (up to fp32 summation order), and
            # its error against the fp64 oracle is the quantization's (E4M3: 3 mantissa bits)
            for k, v in res["vs_emulation"].items():
                assert v < 1e-3, f"rank {rank} {k}: {v:.3g} from the torch emulation"
            for k, v in err.items():
                assert v <= 2 * res["baseline"][k] + 1e-6, (rank, k, v, res["baseline"][k])
                assert v < 0.2, f"rank {rank} {k}: rel err {v:.3g}"
                if res["baseline"][k] > 0:     # (zero on a rank that receives no rows)
                    assert v > 1e-2, f"rank {rank} {k}: rel err {v:.3g}: not quantized?"
        else:
            base = res["baseline"]
            for k, v in err.items():
                assert v < BF16_TOL, f"rank {rank} {k}: rel err {v:.3g}"
                assert v <= 2 * base[k] + 1e-6, (f"rank {rank} {k}: rel err {v:.3g} vs plain bf16 "
                                                 f"torch {base[k]:.3g}")
            assert err["y"] > 1e-4, "bf16 output suspiciously exact: was it computed in bf16?"
            assert res["perturbed_err"] > BF16_TOL, "tolerance too loose to see a 10% error"
            assert res["y_dtype"] == "torch.bfloat16"
        # exact zeros: all-inactive rows and inactive routes
        assert res["dead_rows_exact_zero"] and res["dead_rows_grad_x_zero"]
        assert res["inactive_grad_scores_zero"]
        # the slot cursor is back where it started after backward
        assert res["cursors"] == res["start"] and res["saved"] == 0


def test_cases_cover_what_they_claim(results):
    r0, r1 = _get(results, "fp64_random_inactive")
    assert r0["num_dead_rows"] + r1["num_dead_rows"] == 8
    assert r0["num_inactive_routes"] > 0
    one = _get(results, "fp64_one_rank")
    # every route of both ranks lands on rank 1: 2 * T * K rows, rank 0 receives nothing
    assert [r["rows_received"] for r in one] == [0, 2 * 32 * 2]
    one_bf = _get(results, "bf16_one_rank_E2F_D_clamped")
    assert one_bf[1]["rows_received"] == 0 and one_bf[0]["rows_received"] > 100


def test_multilayer_replay_gives_identical_gradients(results):
    for res in _get(results, "multilayer"):
        assert res["need_save"] == [False, False, False]
        assert res["need_replay"] == [False, True, False]
        assert res["grads_identical"] and res["y_identical"]
        assert res["grads_nonzero"]
        assert res["mid"] != res["start"]
        assert res["end"] == res["start"]
        assert res["saved_end"] == [[0, 0]] and res["pos_end"] == [0]


def test_two_slots_independent_backward_order(results):
    for res in _get(results, "two_slots"):
        assert res["slots"] == [0, 1]
        for err in res["errs"]:
            for k, v in err.items():
                assert v < FP64_TOL, f"{k}: {v:.3g}"
        assert res["cursor_a"][0] > res["start"][0] and res["cursor_a"][1] == res["start"][1]
        assert res["cursor_ab"][1] > res["start"][1]
        assert res["end"] == res["start"]


def test_no_grad_forward_leaves_planner_untouched(results):
    for res in _get(results, "no_grad"):
        assert res["untouched"] and res["slot_untouched"]
        assert res["same_as_training"] and res["same_as_inference"]
        assert res["inf_backward_error"] and "inference=True" in res["inf_backward_error"]


def test_zero_tokens(results):
    for res in _get(results, "zero_tokens"):
        assert res["shapes"]["y"] == [0, 64] and res["shapes"]["grad_scores"] == [0, 2]
        assert res["end"] == res["start"]

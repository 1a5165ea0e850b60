"""Activation-slot assignment for Megatron's pipeline schedules (pure functions and hooks).

The hand-checked tables below were derived on paper from Megatron-Core 0.19's schedules:
1F1B runs min(PP - rank - 1, M) warmup forwards, then (F, B) pairs, then the remaining
backwards; interleaved 1F1B with PP=2, VP=2, M=4 (group size 2) runs the virtual microbatch
table (mb, chunk) = (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1), backwards in reversed chunk
order, with (PP - rank - 1) * 2 + (VP - 1) * 2 warmup forwards. A forward takes the lowest slot
whose previous owner has finished its backward.
"""

from __future__ import annotations

import pytest

from megatron_dist_moe.megatron.pipeline_slots import (
    Action,
    ScheduleError,
    SlotHooks,
    assign_slots,
    peak_live_slots,
    schedule_1f1b,
    schedule_interleaved_1f1b,
    schedule_no_pipelining,
)


def _parse(text: str) -> list[tuple[Action, int]]:
    """'F0.1:1 B0.0:0' -> [(Action F vstage 0 mb 1, slot 1), ...]."""
    out = []
    for tok in text.split():
        act, slot = tok.split(":")
        v, m = act[1:].split(".")
        out.append((Action(act[0], int(v), int(m)), int(slot)))
    return out


HAND_CHECKED = {
    # (pp_size, pp_rank, vp_size, M): "action:slot ..." and the peak live slots
    (2, 0, None, 4): ("F0.0:0 F0.1:1 B0.0:0 F0.2:0 B0.1:1 F0.3:1 B0.2:0 B0.3:1", 2),
    (2, 1, None, 4): ("F0.0:0 B0.0:0 F0.1:0 B0.1:0 F0.2:0 B0.2:0 F0.3:0 B0.3:0", 1),
    (2, 0, 2, 4): ("F0.0:0 F0.1:1 F1.0:2 F1.1:3 F0.2:4 B1.0:2 F0.3:2 B1.1:3 F1.2:3 B0.0:0 "
                   "F1.3:0 B0.1:1 B1.2:3 B1.3:0 B0.2:4 B0.3:2", 5),
    (2, 1, 2, 4): ("F0.0:0 F0.1:1 F1.0:2 B1.0:2 F1.1:2 B1.1:2 F0.2:2 B0.0:0 F0.3:0 B0.1:1 "
                   "F1.2:1 B1.2:1 F1.3:1 B1.3:1 B0.2:2 B0.3:0", 3),
}


@pytest.mark.parametrize("key", sorted(HAND_CHECKED, key=str))
def test_hand_checked_schedules_and_slots(key):
    pp, rank, vp, M = key
    table, peak = HAND_CHECKED[key]
    expected = _parse(table)
    schedule = (schedule_interleaved_1f1b(M, pp, rank, vp) if vp else schedule_1f1b(M, pp, rank))
    assert schedule == [a for a, _ in expected]
    assignment = assign_slots(schedule)
    assert [assignment.slots[a.lifetime] for a in schedule] == [s for _, s in expected]
    assert assignment.peak == peak == peak_live_slots(schedule) == assignment.num_slots
    assert assignment.live_after[-1] == 0, "every slot is released at the end"


def test_no_pipelining_uses_one_slot():
    assert peak_live_slots(schedule_no_pipelining(5)) == 1


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_1f1b_peak_is_pp_minus_rank(pp):
    for rank in range(pp):
        for M in (1, pp - 1, pp, 3 * pp):
            if M < 1:
                continue
            assert peak_live_slots(schedule_1f1b(M, pp, rank)) == min(pp - rank, M)


def test_interleaved_peak_is_warmup_plus_one():
    for pp, vp in ((2, 2), (4, 2), (4, 3)):
        for rank in range(pp):
            M = 4 * pp
            warmup = (pp - rank - 1) * 2 + (vp - 1) * pp
            assert peak_live_slots(schedule_interleaved_1f1b(M, pp, rank, vp)) == warmup + 1


@pytest.mark.parametrize("bad, message", [
    ([Action("B", 0, 0)], "backward before forward"),
    ([Action("F", 0, 0), Action("F", 0, 0)], "forwarded twice"),
    ([Action("F", 0, 0)], "never backwarded"),
    ([Action("F", 0, 0), Action("B", 0, 0), Action("B", 0, 0)], "backwarded twice"),
])
def test_malformed_schedules_raise(bad, message):
    with pytest.raises(ScheduleError, match=message):
        assign_slots(bad)


def test_megatron_checks_are_mirrored():
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage"):
        schedule_interleaved_1f1b(4, 4, 0, 2, microbatch_group_size_per_vp_stage=2)
    with pytest.raises(ValueError, match="pp_rank"):
        schedule_1f1b(4, 2, 2)


# -- against Megatron-Core's own schedule functions -----------------------------------------------

megatron_core = pytest.importorskip("megatron.core")


CASES = ([("1f1b", M, pp, r, None) for pp in (2, 4) for r in range(pp) for M in (1, 3, 8)]
         + [("interleaved", M, pp, r, vp) for pp, vp in ((2, 2), (2, 3), (4, 2))
            for r in range(pp) for M in (pp, 2 * pp, 3 * pp)]
         + [("no_pipelining", 3, 1, 0, None)])


def _expected(kind, M, pp, rank, vp):
    if kind == "interleaved":
        return schedule_interleaved_1f1b(M, pp, rank, vp)
    if kind == "1f1b":
        return schedule_1f1b(M, pp, rank)
    return schedule_no_pipelining(M)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_generators_reproduce_megatron_order(case):
    from megatron_shims.fake_pipeline import recording_steps, run_schedule

    kind, M, pp, rank, vp = case
    log: list = []
    fwd, bwd = recording_steps(log)
    run_schedule(kind, M, pp, rank, vp, forward_step=fwd, backward_step=bwd)
    assert [Action(*e) for e in log] == _expected(*case)


class FakeRuntime:
    """What SlotHooks drives: records plan/select/reset; counts fake dist_moe layers."""

    def __init__(self):
        self.calls: list = []

    def count_layers(self, module):
        from megatron_dist_moe.megatron.runtime import DistMoERuntime

        return DistMoERuntime.count_layers(module)

    def plan(self, num_slots, max_layers):
        self.calls.append(("plan", num_slots, max_layers))

    def select(self, slot, num_layers):
        self.calls.append(("select", slot, num_layers))

    def reset(self):
        self.calls.append(("reset",))


@pytest.mark.parametrize("key", sorted(HAND_CHECKED, key=str))
def test_hooks_select_and_release_slots_in_megatron_schedules(key):
    """The installed wrappers select the hand-checked slot before every forward (and before the
    backward, for recomputation) and leave no slot live."""
    from megatron_shims.fake_pipeline import recording_steps, run_schedule

    pp, rank, vp, M = key
    table, peak = HAND_CHECKED[key]
    runtime = FakeRuntime()
    hooks = SlotHooks(runtime)
    log: list = []
    fwd, bwd = recording_steps(log)
    run_schedule("interleaved" if vp else "1f1b", M, pp, rank, vp,
                 forward_step=hooks.wrap_forward_step(fwd),
                 backward_step=hooks.wrap_backward_step(bwd), wrap=hooks.wrap_schedule,
                 layers_per_chunk=3)
    assert runtime.calls[0] == ("plan", peak, 3)
    assert runtime.calls[1:] == [("select", slot, 3) for _, slot in _parse(table)]
    assert hooks.allocator.live == 0 and not hooks._by_output


def test_hooks_reset_after_an_aborted_schedule():
    from megatron_shims.fake_pipeline import recording_steps, run_schedule

    runtime = FakeRuntime()
    hooks = SlotHooks(runtime)
    log: list = []
    fwd, bwd = recording_steps(log)
    calls = {"n": 0}

    def failing_step(vstage, mb):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom (e.g. NaN check or OOM)")

    with pytest.raises(RuntimeError, match="boom"):
        run_schedule("1f1b", 4, 4, 0, forward_step=hooks.wrap_forward_step(fwd),
                     backward_step=hooks.wrap_backward_step(bwd), wrap=hooks.wrap_schedule,
                     forward_step_func=failing_step)
    # Three forwards had taken slots 0, 1, 2 when the third raised; the schedule wrapper
    # forgot them and rewound the contexts on the way out.
    assert [c for c in runtime.calls if c[0] == "select"] == [("select", s, 1) for s in (0, 1, 2)]
    assert runtime.calls[-1] == ("reset",)
    assert hooks.allocator.live == 0 and not hooks._by_output
    # The next schedule starts from slot 0 again and completes.
    runtime.calls.clear()
    run_schedule("1f1b", 4, 2, 0, forward_step=hooks.wrap_forward_step(fwd),
                 backward_step=hooks.wrap_backward_step(bwd), wrap=hooks.wrap_schedule)
    assert runtime.calls[0] == ("plan", 2, 1)
    expected = _parse(HAND_CHECKED[(2, 0, None, 4)][0])
    assert runtime.calls[1:] == [("select", s, 1) for _, s in expected]
    assert hooks.allocator.live == 0


def test_slot_memory_stage_vs_whole_microbatch():
    """Stage slots can be more numerous yet smaller in total (guide §06)."""
    from megatron_dist_moe.megatron.pipeline_slots import (B, F, peak_live_microbatches,
                                                           peak_live_slots, slot_memory)
    sched = [F(0, 0), F(1, 0), F(0, 1), B(1, 0), B(0, 0), F(1, 1), B(1, 1), B(0, 1)]
    assert peak_live_slots(sched) == 3          # F0.0 F1.0 F0.1 all live
    assert peak_live_microbatches(sched) == 2   # microbatch 0: steps 0-4, microbatch 1: 2-7
    # 1F1B without virtual stages: both policies coincide
    sm = slot_memory(8, 2, 0, 1, moe_layers_per_stage=4, bytes_per_layer=100)
    assert (sm.stage_slots, sm.microbatch_slots) == (2, 2)
    assert sm.stage_bytes == sm.microbatch_bytes == 2 * 4 * 100
    # PP=2 x VP=2, rank 0: 5 stage slots of 4 layers beat 4 microbatch slots of 8 layers
    sm = slot_memory(8, 2, 0, 2, moe_layers_per_stage=4, bytes_per_layer=100)
    assert (sm.stage_slots, sm.microbatch_slots) == (5, 4)
    assert sm.stage_bytes == 5 * 4 * 100 < sm.microbatch_bytes == 4 * 8 * 100

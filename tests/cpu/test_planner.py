"""Planner decisions (tensor functions) against hand-worked multi-layer examples."""

from __future__ import annotations

import pytest
import torch

import megatron_dist_moe as dm
from megatron_dist_moe.memory_plan import align128
from megatron_dist_moe.planner import (PlannerState, decide_need_recompute, full_state_bytes,
                                       plan_backward, plan_forward, saved_layout)


def run_slot(plan, rows_per_layer, rank, slot=0, planned=None):
    """Forward every layer into `slot`; returns (state, records, cursor after each layer)."""
    state = PlannerState.create(plan, "cpu")
    state.select(slot, planned or len(rows_per_layer))
    records, cursors = [], []
    for rows in rows_per_layer:
        records.append(plan_forward(state, torch.tensor(rows, dtype=torch.int64), rank, plan))
        cursors.append(int(state.buffer_offsets[slot]))
    return state, records, cursors


# -- the guide's worked example (§01/§04): T=2, K=2, D=F=256, EP=2, four layers in one slot -------
# The hand-worked numbers here and below use the guide's layout (route outputs saved).
def guide_plan(slot_bytes):
    c = dm.Config(num_local_input_tokens=2, hidden_dim=256, intermediate_dim=256, top_k=2,
                  num_experts=4, max_moe_layers_per_activation_slot=4,
                  activation_slot_bytes=slot_bytes, save_route_outputs=True)
    return dm.plan_memory(c, ep_size=2)


GUIDE_ROWS = [[4, 4], [4, 4], [5, 3], [5, 3]]


def test_guide_full_state_numbers():
    p = guide_plan(28 * 1024)
    # align(R*D*2) + align(R*2F*2) + align(T*K*D*2) with T*K*D*2 = 2048
    assert [p.layer.full_state(r) for r in (3, 4, 5)] == [
        3 * 512 + 3 * 1024 + 2048, 4 * 512 + 4 * 1024 + 2048, 5 * 512 + 5 * 1024 + 2048]
    assert [p.layer.full_state(r) for r in (3, 4, 5)] == [6656, 8192, 9728]
    assert p.input_bytes == 2 * 256 * 2 == 1024
    assert p.slot_bytes == 28672


@pytest.mark.parametrize("rank", [0, 1])
def test_guide_28KiB_keeps_L0_to_L2_and_L3_replays(rank):
    p = guide_plan(28 * 1024)
    state, recs, cursors = run_slot(p, GUIDE_ROWS, rank)
    assert [bool(r.need_recompute) for r in recs] == [False, False, False, True]
    # L2: worst rank 0 has 16384 saved + 9728 full + 1 x 1024 reserve = 27,136 <= 28,672
    saved_before_L2 = recs[2].saved_before
    assert saved_before_L2.tolist() == [16384, 16384]
    assert int((saved_before_L2 + full_state_bytes(torch.tensor([5, 3]), p)).max()) + 1024 == 27136
    # L3: 26112 + 9728 = 35,840 > 28,672: keep only x
    assert recs[3].saved_before.tolist() == [26112, 23040]
    assert 26112 + 9728 == 35840
    mine = [[8192, 16384, 26112, 27136], [8192, 16384, 23040, 24064]][rank]
    assert cursors == mine
    assert [int(r.start) for r in recs] == [0] + mine[:-1]
    assert state.saved_bytes[0].tolist() == [27136, 24064]


@pytest.mark.parametrize("rank", [0, 1])
def test_guide_24KiB_makes_L2_replay_though_rank1_alone_fits(rank):
    p = guide_plan(24 * 1024)
    state, recs, cursors = run_slot(p, GUIDE_ROWS, rank)
    assert [bool(r.need_recompute) for r in recs] == [False, False, True, True]
    # rank 1 alone at L2: 16384 + 6656 + 1024 = 24,064 <= 24,576 would fit; rank 0 needs 27,136
    assert 16384 + 6656 + 1024 <= 24576 < 16384 + 9728 + 1024
    assert cursors == [8192, 16384, 17408, 18432]          # replaying layers keep x: 1024 each
    assert state.saved_bytes[0].tolist() == [18432, 18432]


# -- a hand-worked example with four ranks and unequal rows -------------------------------------
# T=4 D=F=64 K=2 E=8 EP=4: input = 4*64*2 = 512 B; full_state(R) = 128R + 256R + 1024 = 384R + 1024
# slot = 12,800 B, five layers planned. Per layer (rows per rank; saved after, per rank):
#   L0 [8,8,8,8]    worst 0+4096 + 4*512 = 6144 <= 12800   save   [4096, 4096, 4096, 4096]
#   L1 [2,14,8,8]   worst 4096+6400 + 3*512 = 12032         save   [5888, 10496, 8192, 8192]
#   L2 [8,8,8,8]    worst 10496+4096 + 2*512 = 15616 > cap  replay [6400, 11008, 8704, 8704]
#                   (rank 0 alone: 5888 + 4096 + 1024 = 11008 would fit)
#   L3 [12,4,8,8]   worst 11008+2560 + 512 = 14080 > cap    replay [6912, 11520, 9216, 9216]
#   L4 [12,0,6,6]   worst 12544 (every rank) + 0 <= cap     save   [12544]*4  (8 routes inactive)
HAND_ROWS = [[8, 8, 8, 8], [2, 14, 8, 8], [8, 8, 8, 8], [12, 4, 8, 8], [12, 0, 6, 6]]
HAND_NEED = [False, False, True, True, False]
HAND_SAVED = [[4096] * 4, [5888, 10496, 8192, 8192], [6400, 11008, 8704, 8704],
              [6912, 11520, 9216, 9216], [12544] * 4]


def hand_plan(num_slots=1):
    c = dm.Config(num_local_input_tokens=4, hidden_dim=64, intermediate_dim=64, top_k=2,
                  num_experts=8, max_moe_layers_per_activation_slot=5, activation_slot_bytes=12800,
                  num_activation_slots=num_slots, save_route_outputs=True)
    return dm.plan_memory(c, ep_size=4)


@pytest.mark.parametrize("rank", range(4))
def test_hand_worked_unequal_rows(rank):
    p = hand_plan()
    assert p.input_bytes == 512 and p.layer.full_state(14) == 384 * 14 + 1024
    state, recs, cursors = run_slot(p, HAND_ROWS, rank)
    assert [bool(r.need_recompute) for r in recs] == HAND_NEED
    assert [r.position.item() for r in recs] == [0, 1, 2, 3, 4]
    assert [r.saved_before.tolist() for r in recs[1:]] == HAND_SAVED[:-1]
    assert cursors == [s[rank] for s in HAND_SAVED]
    assert state.saved_bytes[0].tolist() == HAND_SAVED[-1]
    # every rank's bytes stay inside the slot
    assert max(HAND_SAVED[-1]) <= p.slot_bytes


@pytest.mark.parametrize("rank", range(4))
def test_reverse_backward_rewinds_every_cursor(rank):
    p = hand_plan(num_slots=2)
    state, recs, cursors = run_slot(p, HAND_ROWS, rank, slot=1)
    start = p.slot_ends()
    assert int(state.buffer_offsets[0]) == start[0]           # the other slot is untouched
    for i in reversed(range(len(recs))):
        plan_backward(state, recs[i])
        assert int(state.buffer_offsets[1]) == int(recs[i].start)
        assert int(state.layer_position[1]) == i
    assert state.buffer_offsets.tolist() == start
    assert int(state.saved_bytes.abs().sum()) == 0


def test_record_keeps_its_slot_after_reselection():
    p = hand_plan(num_slots=2)
    state = PlannerState.create(p, "cpu")
    state.select(1, 2)
    rec = plan_forward(state, torch.tensor(HAND_ROWS[0]), 0, p)
    state.select(0, 1)                                       # a later selection...
    assert int(rec.slot) == 1 and int(rec.start) == p.slot_base(1)
    plan_backward(state, rec)                               # ...cannot redirect the backward
    assert state.buffer_offsets.tolist() == p.slot_ends()


def test_reset_rewinds_all_slots():
    p = hand_plan(num_slots=2)
    state, _, _ = run_slot(p, HAND_ROWS[:2], 0, slot=1, planned=5)
    state.reset(p)
    assert state.buffer_offsets.tolist() == p.slot_ends()
    assert int(state.saved_bytes.abs().sum()) == 0 and int(state.layer_position.sum()) == 0


@pytest.mark.parametrize("precision", ["bf16"])
def test_tensor_full_state_matches_layer_bytes(precision):
    c = dm.Config(num_local_input_tokens=8, hidden_dim=128, intermediate_dim=256, top_k=2,
                  num_experts=4, precision=precision)
    p = dm.plan_memory(c, ep_size=2)
    rows = torch.tensor([0, 1, 7, 16, 31, 32, 33], dtype=torch.int64)
    assert full_state_bytes(rows, p).tolist() == [p.layer.full_state(int(r)) for r in rows]


def test_decide_need_recompute_boundary():
    saved = torch.tensor([100, 200])
    full = torch.tensor([50, 10])
    # worst rank is 1 (210, not rank 0's 150); + 2 remaining layers x 25 B = 260 vs capacity
    assert not bool(decide_need_recompute(saved, full, torch.tensor(2), 25, 260))
    assert bool(decide_need_recompute(saved, full, torch.tensor(2), 25, 259))


def test_saved_layout_offsets():
    p = guide_plan(28 * 1024)
    state = PlannerState.create(p, "cpu")
    state.select(0, 4)
    plan_forward(state, torch.tensor([4, 4]), 0, p)
    rec = plan_forward(state, torch.tensor([5, 3]), 1, p)
    lay = saved_layout(rec, torch.tensor(3), p)
    start = int(rec.start)
    assert start == 8192
    assert int(lay.x) == int(lay.x_gathered) == start
    assert int(lay.h1) == start + align128(3 * 256 * 2)
    assert int(lay.routes) == int(lay.h1) + align128(3 * 512 * 2)
    assert int(lay.routes) + 2 * 2 * 256 * 2 == start + p.layer.full_state(3)
    assert int(state.buffer_offsets[0]) == start + p.layer.full_state(3)


def test_planner_functions_do_not_read_the_host(monkeypatch):
    """plan_forward / plan_backward must not call .item()/.tolist()/bool() on tensors (the GPU
    backend runs them inside CUDA graphs)."""
    p = hand_plan()
    state = PlannerState.create(p, "cpu")
    state.select(0, 5)
    rows = [torch.tensor(r) for r in HAND_ROWS]

    def boom(*a, **k):
        raise AssertionError("host read in the planner")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    recs = [plan_forward(state, r, 2, p) for r in rows]
    for r in reversed(recs):
        plan_backward(state, r)
    monkeypatch.undo()
    assert state.buffer_offsets.tolist() == p.slot_ends()
    assert [bool(r.need_recompute) for r in recs] == HAND_NEED

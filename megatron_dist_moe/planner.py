"""Save/recompute planner: slot cursors and decisions as tensor functions (no host reads).

Both backends run exactly this code: the reference backend on CPU tensors, the CUDA backend on
device tensors inside CUDA graphs. Nothing here calls `.item()`, `.tolist()` or branches on a
tensor value, so the decisions stay on the device.

State (one per context), for N activation slots and EP ranks:
    buffer_offsets [N+1] int64   absolute byte cursor of each slot from the activation buffer base;
                                 the last entry is the scratch end (constant).
    saved_bytes    [N, EP] int64 bytes saved in each slot by each rank. Every rank sees every
                                 rank's routing (the routing header is exchanged anyway), so each
                                 rank tracks all ranks' totals with the same arithmetic and all
                                 ranks take the same decision without reading peers' counters.
    layer_position [N] int64     layers currently stacked in each slot.
    slot_ids       [N] int64     immutable device slot IDs (what the selector points at).
    selected       [2] int64     (slot id, layers planned for that slot) set by the selector.

Decision for a layer forward in slot s at position p of P planned layers, with R_r rows received
by rank r (guide §04):

    need_recompute = max_r(saved[s, r] + full_state(R_r)) + (P - p - 1) * input_bytes > capacity

A recomputing layer keeps only its input x[T, D] (input_bytes); otherwise its full state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import saved_offsets
from .memory_plan import MemoryPlan

__all__ = ["PlannerState", "LayerRecord", "full_state_bytes", "decide_need_recompute",
           "plan_forward", "plan_backward", "SavedLayout", "saved_layout"]


def full_state_bytes(rows_R: torch.Tensor, plan: MemoryPlan) -> torch.Tensor:
    """Tensor twin of `LayerBytes.full_state` for int64 row counts (any shape)."""
    return plan.layer.full_state(rows_R.to(torch.int64))


def decide_need_recompute(saved_bytes_EP: torch.Tensor, full_state_EP: torch.Tensor,
                          remaining_layers: torch.Tensor, input_bytes: int,
                          capacity: int) -> torch.Tensor:
    """Worst-rank test: True (0-d bool tensor) when the full state must not be kept."""
    worst = (saved_bytes_EP + full_state_EP).max()
    return worst + remaining_layers * input_bytes > capacity


@dataclass
class PlannerState:
    buffer_offsets: torch.Tensor
    saved_bytes: torch.Tensor
    layer_position: torch.Tensor
    slot_ids: torch.Tensor
    selected: torch.Tensor
    layer_counts: torch.Tensor    # [max_layers + 1] int64 constants 0..max_layers

    @classmethod
    def create(cls, plan: MemoryPlan, device: torch.device | str) -> "PlannerState":
        N = plan.num_slots
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            buffer_offsets=torch.tensor(plan.slot_ends(), **i64),
            saved_bytes=torch.zeros(N, plan.ep_size, **i64),
            layer_position=torch.zeros(N, **i64),
            slot_ids=torch.arange(N, **i64),
            selected=torch.tensor([0, plan.config.max_moe_layers_per_activation_slot], **i64),
            layer_counts=torch.arange(plan.config.max_moe_layers_per_activation_slot + 1, **i64),
        )

    def select(self, slot: int, num_layers: int) -> None:
        """Point the selector at `slot` planned for `num_layers` layers.

        Device-to-device copies from immutable constant tensors, so the selection is recorded
        correctly inside a CUDA graph (host ints only choose which constant is copied).
        """
        self.selected[0:1].copy_(self.slot_ids[slot:slot + 1])
        self.selected[1:2].copy_(self.layer_counts[num_layers:num_layers + 1])

    def reset(self, plan: MemoryPlan) -> None:
        """Rewind every slot (after an aborted schedule, once no backward owns saved state)."""
        self.buffer_offsets.copy_(torch.tensor(plan.slot_ends(), dtype=torch.int64))
        self.saved_bytes.zero_()
        self.layer_position.zero_()


@dataclass
class LayerRecord:
    """Snapshot a forward keeps for its backward (all 0-d / small device tensors).

    The physical slot id and start offset are copied at forward time, so a later
    `select_activation_slot` or a checkpoint recomputation cannot redirect the backward.
    """

    slot: torch.Tensor            # 0-d int64, physical slot id
    start: torch.Tensor           # 0-d int64, absolute byte offset of this layer's saved state
    need_recompute: torch.Tensor  # 0-d bool
    saved_before: torch.Tensor    # [EP] int64, the slot's per-rank totals before this layer
    position: torch.Tensor        # 0-d int64, position of the layer in its slot


def plan_forward(state: PlannerState, rows_EP: torch.Tensor, rank: int,
                 plan: MemoryPlan) -> LayerRecord:
    """Take the save/recompute decision for one layer forward and advance the slot cursor."""
    slot = state.selected[0].clone()
    planned = state.selected[1]
    pos = state.layer_position.index_select(0, slot.view(1)).view(())
    saved = state.saved_bytes.index_select(0, slot.view(1)).view(-1)
    full = full_state_bytes(rows_EP, plan)
    need = decide_need_recompute(saved, full, planned - pos - 1, plan.input_bytes, plan.slot_bytes)
    start = state.buffer_offsets.index_select(0, slot.view(1)).view(()).clone()
    added = torch.where(need, torch.full_like(full, plan.input_bytes), full)
    record = LayerRecord(slot=slot, start=start, need_recompute=need, saved_before=saved.clone(),
                         position=pos.clone())
    state.saved_bytes.index_add_(0, slot.view(1), added.view(1, -1))
    state.buffer_offsets.index_add_(0, slot.view(1), added[rank].view(1))
    state.layer_position.index_add_(0, slot.view(1), torch.ones_like(pos).view(1))
    return record


def plan_backward(state: PlannerState, record: LayerRecord) -> None:
    """Rewind the slot to where this layer's forward started (backward runs in reverse)."""
    state.buffer_offsets.index_copy_(0, record.slot.view(1), record.start.view(1))
    state.saved_bytes.index_copy_(0, record.slot.view(1), record.saved_before.view(1, -1))
    state.layer_position.index_copy_(0, record.slot.view(1), record.position.view(1))


@dataclass
class SavedLayout:
    """Absolute byte offsets (0-d int64 tensors) of one layer's saved tensors in its slot."""

    x: torch.Tensor            # input x [T, D] (replay) — valid when need_recompute
    regions: dict              # {name: offset} of layout.saved_regions — valid otherwise
    routes: torch.Tensor       # h3 routes [T, K, D], after the saved regions

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.regions[name]

    @property
    def x_gathered(self) -> torch.Tensor:
        return self.regions["x_g"]

    @property
    def h1(self) -> torch.Tensor:
        return self.regions["h1"]


def saved_layout(record: LayerRecord, rows: torch.Tensor, plan: MemoryPlan) -> SavedLayout:
    """Where each saved tensor of a layer lives, for `rows` received by this rank: the saved
    regions of the layout (layout.saved_offsets) from the layer's start, then the routes."""
    c = plan.config
    offs = saved_offsets(rows.to(torch.int64), c.hidden_dim, c.intermediate_dim, c.precision,
                         plan.num_local_experts)
    end = offs.pop("end")
    return SavedLayout(x=record.start, regions={k: record.start + v for k, v in offs.items()},
                       routes=record.start + end)

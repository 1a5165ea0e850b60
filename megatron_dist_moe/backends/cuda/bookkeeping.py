"""Per-call device bookkeeping of the CUDA backend: planner decision, addresses, row counts.

Two implementations behind one interface (Execution.bookkeeping):
    "triton"  one launch each (kernels/bookkeeping.py), bit-equal to the torch version in the
              interpreter test.
    "torch"   the shared planner functions (`planner.plan_forward`, `plan_backward`,
              `saved_layout`) and the per-call layout (`layout.call_layout`): ~75 small
              launches per forward, ~45 per backward. The oracle of the other one.

Every value stays on the device (int64 [1] addresses, int32 [1] row counts), so both run
inside CUDA graphs. The scratch addresses come from the one per-call layout, anchored at the
arena end; the Triton version also checks on the device that the layout fits the scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.common import interpreting
from ...layout import call_layout
from ...memory_plan import MemoryPlan
from ...planner import LayerRecord, PlannerState, plan_backward, plan_forward, saved_layout
from .routing import RoutingTables

__all__ = ["ForwardAddresses", "BackwardAddresses", "TorchBookkeeping", "TritonBookkeeping",
           "make_bookkeeping"]


@dataclass
class ForwardAddresses:
    record: LayerRecord | None    # training: the planner's snapshot for backward
    rec_vec: torch.Tensor | None  # triton: the same snapshot as one int64 vector
    xg: torch.Tensor              # int64 [1] where x_g goes
    h1: torch.Tensor              # int64 [1] where h1 goes
    h2: torch.Tensor              # int64 [1] scratch h2 [R, F]
    x_slot: torch.Tensor | None   # int64 [1] slot address of the replay input x
    routes_save: torch.Tensor | None  # int64 [1] slot address of the route outputs
    save_flag: torch.Tensor | None    # int32 [1] 1: keep the full state (combine saves routes)
    x_rows: torch.Tensor | None       # int32 [1] T when x is kept for replay, else 0


@dataclass
class BackwardAddresses:
    xg: torch.Tensor              # int64 [1] x_g: slot, or scratch when replayed
    h1: torch.Tensor              # int64 [1] h1 (grad_h1 is written over it)
    h2: torch.Tensor              # int64 [1] scratch h2 [R, F] (rebuilt, scaled)
    g3: torch.Tensor              # int64 [1] scratch g3 [R, D] (gathered output gradients)
    x_slot: torch.Tensor          # int64 [1]
    routes_read: torch.Tensor     # int64 [1] route outputs: slot, or combine when replayed
    x_rows: torch.Tensor          # int32 [1] T when replayed, else 0
    replay_offsets: torch.Tensor  # int32 [E+1] expert offsets of the replay (zeros if none)
    replay_rows: torch.Tensor     # int32 [1] R when replayed, else 0


class TorchBookkeeping:
    name = "torch"

    def __init__(self, plan: MemoryPlan, planner: PlannerState, rank: int,
                 act_base: torch.Tensor, arena_end: torch.Tensor, combine_addr: torch.Tensor):
        self.plan, self.planner, self.rank = plan, planner, rank
        self.act_base, self.arena_end, self.combine_addr = act_base, arena_end, combine_addr
        cfg = plan.config
        self.D, self.F, self.precision = cfg.hidden_dim, cfg.intermediate_dim, cfg.precision

    def _layout(self, mode: str, R: torch.Tensor):
        lay = call_layout(mode, R.to(torch.int64), self.D, self.F, self.precision)
        base = self.arena_end - lay.total
        return lambda name: base + lay[name].offset

    def forward(self, tabs: RoutingTables, T: int, training: bool) -> ForwardAddresses:
        R = tabs.num_rows
        at = self._layout("train_forward" if training else "inference", R)
        if not training:
            return ForwardAddresses(None, None, at("x_g"), at("h1"), at("h2"), None, None, None,
                                    None)
        record = plan_forward(self.planner, tabs.rows_EP, self.rank, self.plan)
        lay = saved_layout(record, R[0], self.plan)
        need = record.need_recompute
        return ForwardAddresses(
            record=record, rec_vec=None,
            xg=torch.where(need, at("x_g"), self.act_base + lay.x_gathered),
            h1=torch.where(need, at("h1"), self.act_base + lay.h1), h2=at("h2"),
            x_slot=self.act_base + lay.x, routes_save=self.act_base + lay.routes,
            save_flag=(~need).to(torch.int32),
            x_rows=torch.where(need, torch.full_like(R, T), torch.zeros_like(R)))

    def backward(self, record: LayerRecord, rec_vec, tabs: RoutingTables,
                 T: int) -> BackwardAddresses:
        plan_backward(self.planner, record)      # rewind before any kernel runs
        need = record.need_recompute
        R = tabs.num_rows
        rp, bw = self._layout("replay", R), self._layout("backward", R)
        lay = saved_layout(record, R[0], self.plan)
        offs = torch.where(need, tabs.expert_offsets, torch.zeros_like(tabs.expert_offsets))
        pick = lambda name: torch.where(need, rp(name), bw(name))  # noqa: E731
        return BackwardAddresses(
            xg=torch.where(need, rp("x_g"), self.act_base + lay.x_gathered),
            h1=torch.where(need, rp("h1"), self.act_base + lay.h1),
            h2=pick("h2"), g3=pick("g3"),
            x_slot=self.act_base + lay.x,
            routes_read=torch.where(need, self.combine_addr, self.act_base + lay.routes),
            x_rows=torch.where(need, torch.full_like(R, T), torch.zeros_like(R)),
            replay_offsets=offs, replay_rows=offs[-1:])


class TritonBookkeeping(TorchBookkeeping):
    name = "triton"

    def __init__(self, *args, num_local_experts: int, **kw):
        super().__init__(*args, **kw)
        import triton
        self.E_local = num_local_experts
        self.EP = self.plan.ep_size
        self.EP_PAD = max(2, triton.next_power_of_2(self.EP))
        self.E_PAD = max(2, triton.next_power_of_2(num_local_experts + 1))
        self.routes_bytes = self.plan.layer.routes_bytes()
        dev = self.act_base.device
        # verdict of the layout guard where the kernel cannot trap (interpreter): (code, a, b)
        self.status = torch.zeros(3, dtype=torch.int64, device=dev)
        self._trap = dev.type == "cuda" and not interpreting()
        assert self.precision == "bf16", "the bookkeeping kernels implement the bf16 layout"

    def forward(self, tabs: RoutingTables, T: int, training: bool) -> ForwardAddresses:
        from ...kernels.bookkeeping import ADDR_LEN, I32_LEN, REC_FIXED, plan_forward_kernel
        dev = tabs.num_rows.device
        st = self.planner
        addr = torch.empty(ADDR_LEN, dtype=torch.int64, device=dev)
        i32 = torch.empty(I32_LEN, dtype=torch.int32, device=dev)
        rec = torch.empty(REC_FIXED + self.EP, dtype=torch.int64, device=dev)
        need = torch.empty(1, dtype=torch.bool, device=dev)
        plan_forward_kernel[(1,)](
            st.buffer_offsets, st.saved_bytes, st.layer_position, st.selected, tabs.rows_EP,
            tabs.num_rows, self.act_base, self.arena_end, rec, need, addr, i32, self.status,
            self.rank, self.EP, T, self.D, self.F, self.plan.input_bytes, self.plan.slot_bytes,
            self.routes_bytes, self.plan.total_scratch_bytes,
            TRAINING=training, EP_PAD=self.EP_PAD, TRAP=self._trap, num_warps=1)
        if not training:
            return ForwardAddresses(None, None, addr[0:1], addr[1:2], addr[4:5], None, None,
                                    None, None)
        record = LayerRecord(slot=rec[0], start=rec[1], need_recompute=need.view(()),
                             saved_before=rec[REC_FIXED:], position=rec[3])
        return ForwardAddresses(record=record, rec_vec=rec, xg=addr[0:1], h1=addr[1:2],
                                h2=addr[4:5], x_slot=addr[2:3], routes_save=addr[3:4],
                                save_flag=i32[0:1], x_rows=i32[1:2])

    def backward(self, record: LayerRecord, rec_vec, tabs: RoutingTables,
                 T: int) -> BackwardAddresses:
        from ...kernels.bookkeeping import ADDR_LEN, I32_LEN, plan_backward_kernel
        assert rec_vec is not None, "a forward taken by the torch bookkeeping"
        dev = tabs.num_rows.device
        st = self.planner
        addr = torch.empty(ADDR_LEN, dtype=torch.int64, device=dev)
        i32 = torch.empty(I32_LEN, dtype=torch.int32, device=dev)
        offs = torch.empty(self.E_local + 1, dtype=torch.int32, device=dev)
        plan_backward_kernel[(1,)](
            st.buffer_offsets, st.saved_bytes, st.layer_position, rec_vec, tabs.num_rows,
            tabs.expert_offsets, self.act_base, self.arena_end, self.combine_addr, addr, i32,
            offs, self.status, self.EP, T, self.D, self.F, self.E_local,
            self.plan.total_scratch_bytes, EP_PAD=self.EP_PAD,
            E_PAD=self.E_PAD, TRAP=self._trap, num_warps=1)
        return BackwardAddresses(xg=addr[0:1], h1=addr[1:2], h2=addr[4:5], g3=addr[5:6],
                                 x_slot=addr[2:3], routes_read=addr[3:4],
                                 x_rows=i32[1:2], replay_offsets=offs, replay_rows=i32[2:3])


def make_bookkeeping(impl: str, plan, planner, rank, act_base, arena_end, combine_addr,
                     num_local_experts):
    if impl == "torch":
        return TorchBookkeeping(plan, planner, rank, act_base, arena_end, combine_addr)
    assert impl == "triton", f"bookkeeping {impl!r}: expected 'torch' or 'triton'"
    return TritonBookkeeping(plan, planner, rank, act_base, arena_end, combine_addr,
                             num_local_experts=num_local_experts)

"""Per-call device bookkeeping of the CUDA backend: planner decision, addresses, row counts.

Two implementations behind one interface, chosen by DIST_MOE_BOOKKEEPING:
    "triton"  (default) one launch each (kernels/bookkeeping.py), bit-equal to the torch version
              in the interpreter test and checked end to end on 2xH200 (-0.2 ms fwd+bwd).
    "torch"   the shared planner functions (`planner.plan_forward`, `plan_backward`,
              `saved_layout`) and `ScratchPointers.for_rows`: ~75 small launches per forward,
              ~45 per backward. This is also the oracle of the other one.

Every value stays on the device (int64 [1] addresses, int32 [1] row counts), so both run
inside CUDA graphs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ...memory_plan import MemoryPlan
from ...planner import LayerRecord, PlannerState, plan_backward, plan_forward, saved_layout
from .experts import ScratchPointers
from .routing import RoutingTables

__all__ = ["ForwardAddresses", "BackwardAddresses", "TorchBookkeeping", "TritonBookkeeping",
           "make_bookkeeping"]


@dataclass
class ForwardAddresses:
    record: LayerRecord | None    # training: the planner's snapshot for backward
    rec_vec: torch.Tensor | None  # triton: the same snapshot as one int64 vector
    xg: torch.Tensor              # int64 [1] where x_g goes
    h1: torch.Tensor              # int64 [1] where h1 goes
    sp: ScratchPointers
    x_slot: torch.Tensor | None   # int64 [1] slot address of the replay input x
    routes_save: torch.Tensor | None  # int64 [1] slot address of the route outputs
    save_flag: torch.Tensor | None    # int32 [1] 1: keep the full state (combine saves routes)
    x_rows: torch.Tensor | None       # int32 [1] T when x is kept for replay, else 0


@dataclass
class BackwardAddresses:
    xg: torch.Tensor
    h1: torch.Tensor
    sp: ScratchPointers
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
        self.D, self.F = cfg.hidden_dim, cfg.intermediate_dim

    def _scratch(self, R: torch.Tensor) -> ScratchPointers:
        return ScratchPointers.for_rows(self.arena_end, R, self.D, self.F)

    def forward(self, tabs: RoutingTables, T: int, training: bool) -> ForwardAddresses:
        sp = self._scratch(tabs.num_rows)
        if not training:
            return ForwardAddresses(None, None, sp.xg, sp.h1, sp, None, None, None, None)
        record = plan_forward(self.planner, tabs.rows_EP, self.rank, self.plan)
        lay = saved_layout(record, tabs.num_rows[0], self.plan)
        need = record.need_recompute
        R = tabs.num_rows
        return ForwardAddresses(
            record=record, rec_vec=None,
            xg=torch.where(need, sp.xg, self.act_base + lay.x_gathered),
            h1=torch.where(need, sp.h1, self.act_base + lay.h1), sp=sp,
            x_slot=self.act_base + lay.x, routes_save=self.act_base + lay.routes,
            save_flag=(~need).to(torch.int32),
            x_rows=torch.where(need, torch.full_like(R, T), torch.zeros_like(R)))

    def backward(self, record: LayerRecord, rec_vec, tabs: RoutingTables,
                 T: int) -> BackwardAddresses:
        plan_backward(self.planner, record)      # rewind before any kernel runs
        need = record.need_recompute
        R = tabs.num_rows
        sp = self._scratch(R)
        lay = saved_layout(record, R[0], self.plan)
        offs = torch.where(need, tabs.expert_offsets, torch.zeros_like(tabs.expert_offsets))
        return BackwardAddresses(
            xg=torch.where(need, sp.xg, self.act_base + lay.x_gathered),
            h1=torch.where(need, sp.h1, self.act_base + lay.h1), sp=sp,
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
        cfg = self.plan.config
        self.routes_bytes = self.plan.layer.routes_bytes()
        assert cfg.precision == "bf16", "the bookkeeping kernels implement the bf16 layout"

    def _views(self, addr: torch.Tensor) -> ScratchPointers:
        v = [addr[i:i + 1] for i in range(10)]
        return ScratchPointers(xg=v[4], h1=v[5], h2=v[6], g3=v[7], grad_h1=v[8], grad_h2=v[9])

    def forward(self, tabs: RoutingTables, T: int, training: bool) -> ForwardAddresses:
        from ...kernels.bookkeeping import ADDR_LEN, I32_LEN, REC_FIXED, plan_forward_kernel
        from ...kernels.launch import pdl_args
        dev = tabs.num_rows.device
        st = self.planner
        addr = torch.empty(ADDR_LEN, dtype=torch.int64, device=dev)
        i32 = torch.empty(I32_LEN, dtype=torch.int32, device=dev)
        rec = torch.empty(REC_FIXED + self.EP, dtype=torch.int64, device=dev)
        need = torch.empty(1, dtype=torch.bool, device=dev)
        plan_forward_kernel[(1,)](
            st.buffer_offsets, st.saved_bytes, st.layer_position, st.selected, tabs.rows_EP,
            tabs.num_rows, self.act_base, self.arena_end, rec, need, addr, i32,
            self.rank, self.EP, T, self.D, self.F, self.plan.input_bytes, self.plan.slot_bytes,
            self.routes_bytes, TRAINING=training, EP_PAD=self.EP_PAD, num_warps=1, **pdl_args(dev))
        sp = self._views(addr)
        if not training:
            return ForwardAddresses(None, None, addr[0:1], addr[1:2], sp, None, None, None, None)
        record = LayerRecord(slot=rec[0], start=rec[1], need_recompute=need.view(()),
                             saved_before=rec[REC_FIXED:], position=rec[3])
        return ForwardAddresses(record=record, rec_vec=rec, xg=addr[0:1], h1=addr[1:2], sp=sp,
                                x_slot=addr[2:3], routes_save=addr[3:4], save_flag=i32[0:1],
                                x_rows=i32[1:2])

    def backward(self, record: LayerRecord, rec_vec, tabs: RoutingTables,
                 T: int) -> BackwardAddresses:
        from ...kernels.bookkeeping import ADDR_LEN, I32_LEN, plan_backward_kernel
        from ...kernels.launch import pdl_args
        assert rec_vec is not None, "a forward taken by the torch bookkeeping"
        dev = tabs.num_rows.device
        st = self.planner
        addr = torch.empty(ADDR_LEN, dtype=torch.int64, device=dev)
        i32 = torch.empty(I32_LEN, dtype=torch.int32, device=dev)
        offs = torch.empty(self.E_local + 1, dtype=torch.int32, device=dev)
        plan_backward_kernel[(1,)](
            st.buffer_offsets, st.saved_bytes, st.layer_position, rec_vec, tabs.num_rows,
            tabs.expert_offsets, self.act_base, self.arena_end, self.combine_addr, addr, i32,
            offs, self.EP, T, self.D, self.F, self.E_local, EP_PAD=self.EP_PAD,
            E_PAD=self.E_PAD, num_warps=1, **pdl_args(dev))
        return BackwardAddresses(xg=addr[0:1], h1=addr[1:2], sp=self._views(addr),
                                 x_slot=addr[2:3], routes_read=addr[3:4], x_rows=i32[1:2],
                                 replay_offsets=offs, replay_rows=i32[2:3])


def make_bookkeeping(plan, planner, rank, act_base, arena_end, combine_addr, num_local_experts,
                     impl: str | None = None):
    impl = impl or os.environ.get("DIST_MOE_BOOKKEEPING", "") or "triton"
    if impl == "torch":
        return TorchBookkeeping(plan, planner, rank, act_base, arena_end, combine_addr)
    if impl == "triton":
        return TritonBookkeeping(plan, planner, rank, act_base, arena_end, combine_addr,
                                 num_local_experts=num_local_experts)
    raise ValueError(f"DIST_MOE_BOOKKEEPING={impl!r}: expected 'torch' or 'triton'")

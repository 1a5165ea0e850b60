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
from ...layout import call_layout, precision_modes, region_specs, saved_regions
from ...memory_plan import MemoryPlan
from ...planner import LayerRecord, PlannerState, plan_backward, plan_forward, saved_layout
from .routing import RoutingTables

__all__ = ["ForwardAddresses", "BackwardAddresses", "TorchBookkeeping", "TritonBookkeeping",
           "make_bookkeeping"]


@dataclass
class ForwardAddresses:
    record: LayerRecord | None    # training: the planner's snapshot for backward
    rec_vec: torch.Tensor | None  # triton: the same snapshot as one int64 vector
    at: dict                      # {region: int64 [1]} every region of the call's layout (a
                                  # saved region of a full-save layer: its slot address)
    x_slot: torch.Tensor | None   # int64 [1] slot address of the replay input x
    routes_save: torch.Tensor | None  # int64 [1] slot address of the route outputs
    save_flag: torch.Tensor | None    # int32 [1] 1: keep the full state (combine saves routes)
    x_rows: torch.Tensor | None       # int32 [1] T when x is kept for replay, else 0


@dataclass
class BackwardAddresses:
    at: dict                      # {region: int64 [1]} the replay layout's regions (which
                                  # include the backward ones): scratch when replayed, else the
                                  # slot (saved regions) or the backward layout's scratch
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
        self.E_local = plan.num_local_experts

    def _layout(self, mode: str, R: torch.Tensor) -> dict:
        lay = call_layout(mode, R.to(torch.int64), self.D, self.F, self.precision, self.E_local)
        base = self.arena_end - lay.total
        return {r.name: base + r.offset for r in lay.regions}

    def forward(self, tabs: RoutingTables, T: int, training: bool) -> ForwardAddresses:
        R = tabs.num_rows
        at = self._layout("train_forward" if training else "inference", R)
        if not training:
            return ForwardAddresses(None, None, at, None, None, None, None)
        record = plan_forward(self.planner, tabs.rows_EP, self.rank, self.plan)
        lay = saved_layout(record, R[0], self.plan)
        need = record.need_recompute
        for name, off in lay.regions.items():
            at[name] = torch.where(need, at[name], self.act_base + off)
        return ForwardAddresses(
            record=record, rec_vec=None, at=at,
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
        at = {}
        for name, addr in rp.items():
            if name in lay.regions:
                other = self.act_base + lay.regions[name]
            elif name in bw:
                other = bw[name]
            else:
                other = addr       # a forward temporary: read only when replayed
            at[name] = torch.where(need, addr, other)
        return BackwardAddresses(
            at=at, x_slot=self.act_base + lay.x,
            routes_read=torch.where(need, self.combine_addr, self.act_base + lay.routes),
            x_rows=torch.where(need, torch.full_like(R, T), torch.zeros_like(R)),
            replay_offsets=offs, replay_rows=offs[-1:])


class TritonBookkeeping(TorchBookkeeping):
    name = "triton"

    def __init__(self, *args, num_local_experts: int, **kw):
        super().__init__(*args, **kw)
        import triton

        from ...kernels.bookkeeping import ADDR_FIXED, region_table
        assert num_local_experts == self.E_local
        self.EP = self.plan.ep_size
        self.EP_PAD = max(2, triton.next_power_of_2(self.EP))
        self.E_PAD = max(2, triton.next_power_of_2(num_local_experts + 1))
        self.routes_bytes = self.plan.layer.routes_bytes()
        dev = self.act_base.device
        # verdict of the layout guard where the kernel cannot trap (interpreter): (code, a, b)
        self.status = torch.zeros(3, dtype=torch.int64, device=dev)
        self._trap = dev.type == "cuda" and not interpreting()
        # the layout tables (layout.py) the kernels read
        D, F, prec = self.D, self.F, self.precision
        saved = saved_regions(D, F, prec)
        self._saved_names = [r.name for r in saved]
        modes = precision_modes(prec)      # an inference-only precision: inference
        self._names = {m: [r.name for r in region_specs(m, D, F, prec)] for m in modes}
        bw_names = self._names.get("backward", [])
        self._tabs = {m: region_table(region_specs(m, D, F, prec), self._saved_names, bw_names,
                                      dev) for m in modes}
        self._saved_tab = region_table(saved, device=dev)
        self._addr_len = ADDR_FIXED + max(len(v) for v in self._names.values())

    def forward(self, tabs: RoutingTables, T: int, training: bool) -> ForwardAddresses:
        from ...kernels.bookkeeping import ADDR_FIXED, I32_LEN, REC_FIXED, plan_forward_kernel
        dev = tabs.num_rows.device
        st = self.planner
        mode = "train_forward" if training else "inference"
        names = self._names[mode]
        addr = torch.empty(self._addr_len, dtype=torch.int64, device=dev)
        i32 = torch.empty(I32_LEN, dtype=torch.int32, device=dev)
        rec = torch.empty(REC_FIXED + self.EP, dtype=torch.int64, device=dev)
        need = torch.empty(1, dtype=torch.bool, device=dev)
        plan_forward_kernel[(1,)](
            st.buffer_offsets, st.saved_bytes, st.layer_position, st.selected, tabs.rows_EP,
            tabs.num_rows, self.act_base, self.arena_end, rec, need, addr, i32, self.status,
            self._tabs[mode], len(names), self._saved_tab, len(self._saved_names),
            self.rank, self.EP, T, self.E_local, self.plan.input_bytes, self.plan.slot_bytes,
            self.routes_bytes, self.plan.total_scratch_bytes,
            TRAINING=training, EP_PAD=self.EP_PAD, TRAP=self._trap, num_warps=1)
        at = {n: addr[ADDR_FIXED + i:ADDR_FIXED + i + 1] for i, n in enumerate(names)}
        if not training:
            return ForwardAddresses(None, None, at, None, None, None, None)
        record = LayerRecord(slot=rec[0], start=rec[1], need_recompute=need.view(()),
                             saved_before=rec[REC_FIXED:], position=rec[3])
        return ForwardAddresses(record=record, rec_vec=rec, at=at, x_slot=addr[0:1],
                                routes_save=addr[1:2], save_flag=i32[0:1], x_rows=i32[1:2])

    def backward(self, record: LayerRecord, rec_vec, tabs: RoutingTables,
                 T: int) -> BackwardAddresses:
        from ...kernels.bookkeeping import ADDR_FIXED, I32_LEN, plan_backward_kernel
        assert rec_vec is not None, "a forward taken by the torch bookkeeping"
        dev = tabs.num_rows.device
        st = self.planner
        names = self._names["replay"]
        addr = torch.empty(self._addr_len, dtype=torch.int64, device=dev)
        i32 = torch.empty(I32_LEN, dtype=torch.int32, device=dev)
        offs = torch.empty(self.E_local + 1, dtype=torch.int32, device=dev)
        plan_backward_kernel[(1,)](
            st.buffer_offsets, st.saved_bytes, st.layer_position, rec_vec, tabs.num_rows,
            tabs.expert_offsets, self.act_base, self.arena_end, self.combine_addr, addr, i32,
            offs, self.status, self._tabs["replay"], len(names), self._tabs["backward"],
            len(self._names["backward"]), self._saved_tab, len(self._saved_names), self.EP, T,
            self.E_local, self.plan.total_scratch_bytes, EP_PAD=self.EP_PAD,
            E_PAD=self.E_PAD, TRAP=self._trap, num_warps=1)
        at = {n: addr[ADDR_FIXED + i:ADDR_FIXED + i + 1] for i, n in enumerate(names)}
        return BackwardAddresses(at=at, x_slot=addr[0:1], routes_read=addr[1:2],
                                 x_rows=i32[1:2], replay_offsets=offs, replay_rows=i32[2:3])


def make_bookkeeping(impl: str, plan, planner, rank, act_base, arena_end, combine_addr,
                     num_local_experts):
    if impl == "torch":
        return TorchBookkeeping(plan, planner, rank, act_base, arena_end, combine_addr)
    assert impl == "triton", f"bookkeeping {impl!r}: expected 'torch' or 'triton'"
    return TritonBookkeeping(plan, planner, rank, act_base, arena_end, combine_addr,
                             num_local_experts=num_local_experts)

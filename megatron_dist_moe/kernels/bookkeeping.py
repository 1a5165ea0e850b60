"""One-launch device bookkeeping of a layer call: planner decision, saved layout, scratch.

The torch version of the same arithmetic (`backends/cuda/bookkeeping.py: torch_forward /
torch_backward`, built from the shared planner functions `plan_forward`, `plan_backward`,
`saved_layout` and `ScratchPointers.for_rows`) takes ~75 small launches per forward and ~45 per
backward; these kernels take one each (single program, a handful of scalars). They are checked
bit-equal against that torch version in the interpreter
(tests/cpu/test_kernels_bookkeeping_interp.py).

Outputs, one int64 vector `addr` and one int32 vector `i32` per call (kernel arguments of the
downstream kernels are views of single entries):

    addr[ADDR_XG]     where x_g goes (slot when the full state is kept, else scratch)
    addr[ADDR_H1]     where h1 goes
    addr[ADDR_X]      slot address of the saved layer input x (replay)
    addr[ADDR_ROUTES] slot address of the saved route outputs; in backward: where the route
                      outputs are read (slot, or the combine buffer when replayed)
    addr[ADDR_S_*]    scratch pointers xg, h1, h2, g3, grad_h1, grad_h2 for the call's R rows
    i32[I32_SAVE]     1 when the full state is kept (the combine kernel's save flag)
    i32[I32_XROWS]    T when the input x is kept for replay, else 0 (copy_rows row count)
    i32[I32_NROWS]    backward: R when the layer is replayed, else 0 (replay row count)
    rec = [slot, start, need, position, saved_before[EP]]  (training forward; kept for backward)
Backward also writes the predicated expert offsets (the replay's, zeros when not replayed).

Only the bf16 layout is implemented (the CUDA backend's precision); full_state(R) =
align128(R*D*2) + align128(R*2F*2) + routes_bytes, as `memory_plan.LayerBytes.full_state`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import grid_dependency_wait

__all__ = ["ADDR", "I32", "REC_FIXED", "plan_forward_kernel", "plan_backward_kernel"]

ADDR = dict(XG=0, H1=1, X=2, ROUTES=3, S_XG=4, S_H1=5, S_H2=6, S_G3=7, S_GRAD_H1=8,
            S_GRAD_H2=9)
ADDR_LEN = 16
I32 = dict(SAVE=0, XROWS=1, NROWS=2)
I32_LEN = 4
REC_FIXED = 4   # slot, start, need, position; then saved_before[EP]


@triton.jit
def _align128(n):
    return (n + 127) // 128 * 128


@triton.jit
def _scratch_and_layout(addr_ptr, R, start, need, act_base, arena_end, D, F):
    """Scratch pointers for R rows (anchored at the arena end) and the slot layout at start."""
    sx = _align128(R * D * 2)
    s1 = _align128(R * 4 * F)
    s2 = _align128(R * F * 2)
    top = tl.maximum(s2 + sx, s1)
    xg_s = arena_end - (sx + s1 + top + s2)
    h1_s = xg_s + sx
    h2_s = h1_s + s1
    tl.store(addr_ptr + 4, xg_s)
    tl.store(addr_ptr + 5, h1_s)
    tl.store(addr_ptr + 6, h2_s)
    tl.store(addr_ptr + 7, h2_s + s2)
    tl.store(addr_ptr + 8, h2_s)
    tl.store(addr_ptr + 9, h2_s + top)
    xg_slot = act_base + start
    h1_slot = xg_slot + sx
    routes_slot = h1_slot + s1
    tl.store(addr_ptr + 0, tl.where(need, xg_s, xg_slot))
    tl.store(addr_ptr + 1, tl.where(need, h1_s, h1_slot))
    tl.store(addr_ptr + 2, act_base + start)
    return routes_slot


@triton.jit
def plan_forward_kernel(offsets_ptr, saved_ptr, position_ptr, selected_ptr, rows_ep_ptr,
                        num_rows_ptr, act_base_ptr, arena_end_ptr, rec_ptr, need_ptr, addr_ptr,
                        i32_ptr, rank, EP, T, D, F, input_bytes, capacity, routes_bytes,
                        TRAINING: tl.constexpr, EP_PAD: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_wait(PDL)   # first: no memory access before it (launch.py)
    p = tl.arange(0, EP_PAD)
    pm = p < EP
    R = tl.load(num_rows_ptr).to(tl.int64)
    act_base = tl.load(act_base_ptr)
    arena_end = tl.load(arena_end_ptr)
    if TRAINING:
        slot = tl.load(selected_ptr)
        planned = tl.load(selected_ptr + 1)
        pos = tl.load(position_ptr + slot)
        saved = tl.load(saved_ptr + slot * EP + p, mask=pm, other=0)
        rows = tl.load(rows_ep_ptr + p, mask=pm, other=0)
        full = _align128(rows * D * 2) + _align128(rows * 4 * F) + routes_bytes
        worst = tl.max(tl.where(pm, saved + full, -(2 ** 62)), 0)
        need = worst + (planned - pos - 1) * input_bytes > capacity
        start = tl.load(offsets_ptr + slot)
        added = tl.where(need, input_bytes + full * 0, full)
        # the snapshot for backward, then the state update
        tl.store(rec_ptr + 0, slot)
        tl.store(rec_ptr + 1, start)
        tl.store(rec_ptr + 2, need.to(tl.int64))
        tl.store(rec_ptr + 3, pos)
        tl.store(rec_ptr + 4 + p, saved, mask=pm)
        tl.store(need_ptr, need)
        tl.store(saved_ptr + slot * EP + p, saved + added, mask=pm)
        tl.store(offsets_ptr + slot, start + tl.sum(tl.where(p == rank, added, 0), 0))
        tl.store(position_ptr + slot, pos + 1)
        routes_slot = _scratch_and_layout(addr_ptr, R, start, need, act_base, arena_end, D, F)
        tl.store(addr_ptr + 3, routes_slot)
        tl.store(i32_ptr + 0, tl.where(need, 0, 1).to(tl.int32))
        tl.store(i32_ptr + 1, tl.where(need, T, 0).to(tl.int32))
    else:
        # inference: everything in scratch (the slot addresses are never read)
        _scratch_and_layout(addr_ptr, R, 0, tl.full((), 1, tl.int1), act_base, arena_end, D, F)


@triton.jit
def plan_backward_kernel(offsets_ptr, saved_ptr, position_ptr, rec_ptr, num_rows_ptr,
                         expert_offsets_ptr, act_base_ptr, arena_end_ptr, combine_addr_ptr,
                         addr_ptr, i32_ptr, pred_offsets_ptr, EP, T, D, F, E_local,
                         EP_PAD: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_wait(PDL)   # first: no memory access before it (launch.py)
    p = tl.arange(0, EP_PAD)
    pm = p < EP
    slot = tl.load(rec_ptr + 0)
    start = tl.load(rec_ptr + 1)
    need = tl.load(rec_ptr + 2) != 0
    # rewind the slot to where this layer's forward started
    tl.store(offsets_ptr + slot, start)
    tl.store(saved_ptr + slot * EP + p, tl.load(rec_ptr + 4 + p, mask=pm, other=0), mask=pm)
    tl.store(position_ptr + slot, tl.load(rec_ptr + 3))
    R = tl.load(num_rows_ptr).to(tl.int64)
    routes_slot = _scratch_and_layout(addr_ptr, R, start, need, tl.load(act_base_ptr),
                                      tl.load(arena_end_ptr), D, F)
    tl.store(addr_ptr + 3, tl.where(need, tl.load(combine_addr_ptr), routes_slot))
    tl.store(i32_ptr + 0, tl.where(need, 0, 1).to(tl.int32))
    tl.store(i32_ptr + 1, tl.where(need, T, 0).to(tl.int32))
    tl.store(i32_ptr + 2, tl.where(need, R, 0).to(tl.int32))
    e = tl.arange(0, E_PAD)
    offs = tl.load(expert_offsets_ptr + e, mask=e <= E_local, other=0)
    tl.store(pred_offsets_ptr + e, tl.where(need, offs, 0), mask=e <= E_local)

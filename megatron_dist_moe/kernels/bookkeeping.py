"""One-launch device bookkeeping of a layer call: planner decision, saved layout, scratch layout.

The torch version of the same arithmetic (`backends/cuda/bookkeeping.py: TorchBookkeeping`,
built from the shared planner functions `plan_forward`, `plan_backward`, `saved_layout` and the
per-call layout `layout.call_layout`) takes ~75 small launches per forward and ~45 per
backward; these kernels take one each (single program, a handful of scalars). They are held
bit-equal to it in the interpreter (tests/cpu/test_kernels_bookkeeping_interp.py) and
`_bf16_layout` below to `layout.call_layout` (tests/cpu/test_layout.py).

Outputs, one int64 vector `addr` and one int32 vector `i32` per call (kernel arguments of the
downstream kernels are views of single entries):

    addr[XG]     where x_g goes (slot when the full state is kept, else scratch)
    addr[H1]     where h1 goes
    addr[X]      slot address of the saved layer input x (replay)
    addr[ROUTES] slot address of the saved route outputs; in backward: where the route outputs
                 are read (slot, or the combine buffer when replayed)
    addr[H2], addr[G3]   scratch regions of the call's layout (G3: backward)
    i32[SAVE]    1 when the full state is kept (the combine kernel's save flag)
    i32[XROWS]   T when the input x is kept for replay, else 0 (copy_rows row count)
    i32[NROWS]   backward: R when the layer is replayed, else 0 (replay row count)
    rec = [slot, start, need, position, saved_before[EP]]  (training forward; kept for backward)
Backward also writes the predicated expert offsets (the replay's, zeros when not replayed).

Layout guard: before any of the call's kernels writes the arena, the kernel checks that the
call's layout fits the scratch (bytes needed <= the plan's scratch bytes) and traps with
CHECK_LAYOUT_OUTSIDE_ARENA (bytes needed, bytes available, R) otherwise; in the interpreter,
which cannot trap, the verdict goes to `status` [3] int64.

Only the bf16 layout is implemented (the CUDA backend's precision); full_state(R) =
align128(R*D*2) + align128(R*2F*2) + routes_bytes, as `memory_plan.LayerBytes.full_state`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .checks import trap_on_code

__all__ = ["ADDR", "I32", "ADDR_LEN", "I32_LEN", "REC_FIXED", "plan_forward_kernel",
           "plan_backward_kernel", "bf16_layout_kernel"]

ADDR = dict(XG=0, H1=1, X=2, ROUTES=3, H2=4, G3=5)
ADDR_LEN = 8
I32 = dict(SAVE=0, XROWS=1, NROWS=2)
I32_LEN = 4
REC_FIXED = 4   # slot, start, need, position; then saved_before[EP]


@triton.jit
def _align128(n):
    return (n + 127) // 128 * 128


@triton.jit
def _bf16_layout(R, D, F, MODE: tl.constexpr):
    """Twin of layout.call_layout(mode, R, D, F, "bf16"): (x_g, h1, h2, g3 offsets from the
    layout base, total bytes). MODE 0 inference / train_forward, 1 backward, 2 replay; offsets
    of regions a mode does not have are 0."""
    sx = _align128(R * D * 2)
    s1 = _align128(R * 4 * F)
    s2 = _align128(R * F * 2)
    zero = R * 0
    if MODE == 0:
        return zero, sx, sx + s1, zero, sx + s1 + s2
    elif MODE == 1:
        return zero, zero, zero, s2, s2 + sx
    else:
        return zero, sx, sx + s1, sx + s1 + s2, sx + s1 + s2 + sx


@triton.jit
def _guard(total, scratch_bytes, R, status_ptr, TRAP: tl.constexpr):
    """The layout must fit the scratch: trap (or record the verdict) with the numbers."""
    if total > scratch_bytes:
        if TRAP:
            trap_on_code(6, total, scratch_bytes, R)
        else:
            tl.store(status_ptr + 0, tl.full((), 6, tl.int64))
            tl.store(status_ptr + 1, total.to(tl.int64))
            tl.store(status_ptr + 2, scratch_bytes + total * 0)


@triton.jit
def bf16_layout_kernel(rows_ptr, out_ptr, n, D, F, MODE: tl.constexpr):
    """out[i] = (x_g, h1, h2, g3, total) of `_bf16_layout` for rows_ptr[i] (the twin's test
    entry point)."""
    for i in range(n):
        R = tl.load(rows_ptr + i)
        xg, h1, h2, g3, total = _bf16_layout(R, D, F, MODE)
        tl.store(out_ptr + i * 5 + 0, xg)
        tl.store(out_ptr + i * 5 + 1, h1)
        tl.store(out_ptr + i * 5 + 2, h2)
        tl.store(out_ptr + i * 5 + 3, g3)
        tl.store(out_ptr + i * 5 + 4, total)


@triton.jit
def plan_forward_kernel(offsets_ptr, saved_ptr, position_ptr, selected_ptr, rows_ep_ptr,
                        num_rows_ptr, act_base_ptr, arena_end_ptr, rec_ptr, need_ptr, addr_ptr,
                        i32_ptr, status_ptr, rank, EP, T, D, F, input_bytes, capacity,
                        routes_bytes, scratch_bytes,
                        TRAINING: tl.constexpr, EP_PAD: tl.constexpr, TRAP: tl.constexpr):
    p = tl.arange(0, EP_PAD)
    pm = p < EP
    R = tl.load(num_rows_ptr).to(tl.int64)
    act_base = tl.load(act_base_ptr)
    arena_end = tl.load(arena_end_ptr)
    o_xg, o_h1, o_h2, _g3, total = _bf16_layout(R, D, F, 0)
    _guard(total, scratch_bytes, R, status_ptr, TRAP)
    base = arena_end - total
    tl.store(addr_ptr + 4, base + o_h2)
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
        # saved layout in the slot: x_g | h1 | routes (full save), or x alone (replay)
        xg_slot = act_base + start
        h1_slot = xg_slot + _align128(R * D * 2)
        tl.store(addr_ptr + 0, tl.where(need, base + o_xg, xg_slot))
        tl.store(addr_ptr + 1, tl.where(need, base + o_h1, h1_slot))
        tl.store(addr_ptr + 2, act_base + start)
        tl.store(addr_ptr + 3, h1_slot + _align128(R * 4 * F))
        tl.store(i32_ptr + 0, tl.where(need, 0, 1).to(tl.int32))
        tl.store(i32_ptr + 1, tl.where(need, T, 0).to(tl.int32))
    else:
        # inference: everything in scratch (the slot addresses are never read)
        tl.store(addr_ptr + 0, base + o_xg)
        tl.store(addr_ptr + 1, base + o_h1)


@triton.jit
def plan_backward_kernel(offsets_ptr, saved_ptr, position_ptr, rec_ptr, num_rows_ptr,
                         expert_offsets_ptr, act_base_ptr, arena_end_ptr, combine_addr_ptr,
                         addr_ptr, i32_ptr, pred_offsets_ptr, status_ptr, EP, T, D, F, E_local,
                         scratch_bytes, EP_PAD: tl.constexpr,
                         E_PAD: tl.constexpr, TRAP: tl.constexpr):
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
    arena_end = tl.load(arena_end_ptr)
    r_xg, r_h1, r_h2, r_g3, r_total = _bf16_layout(R, D, F, 2)
    _b_xg, _b_h1, b_h2, b_g3, b_total = _bf16_layout(R, D, F, 1)
    total = tl.where(need, r_total, b_total)
    _guard(total, scratch_bytes, R, status_ptr, TRAP)
    base = arena_end - total
    xg_slot = tl.load(act_base_ptr) + start
    h1_slot = xg_slot + _align128(R * D * 2)
    tl.store(addr_ptr + 0, tl.where(need, base + r_xg, xg_slot))
    tl.store(addr_ptr + 1, tl.where(need, base + r_h1, h1_slot))
    tl.store(addr_ptr + 2, xg_slot)
    tl.store(addr_ptr + 3, tl.where(need, tl.load(combine_addr_ptr),
                                    h1_slot + _align128(R * 4 * F)))
    tl.store(addr_ptr + 4, base + tl.where(need, r_h2, b_h2))
    tl.store(addr_ptr + 5, base + tl.where(need, r_g3, b_g3))
    tl.store(i32_ptr + 0, tl.where(need, 0, 1).to(tl.int32))
    tl.store(i32_ptr + 1, tl.where(need, T, 0).to(tl.int32))
    tl.store(i32_ptr + 2, tl.where(need, R, 0).to(tl.int32))
    e = tl.arange(0, E_PAD)
    offs = tl.load(expert_offsets_ptr + e, mask=e <= E_local, other=0)
    tl.store(pred_offsets_ptr + e, tl.where(need, offs, 0), mask=e <= E_local)

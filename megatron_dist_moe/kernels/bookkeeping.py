"""One-launch device bookkeeping of a layer call: planner decision, saved layout, scratch layout.

The torch version of the same arithmetic (`backends/cuda/bookkeeping.py: TorchBookkeeping`,
built from the shared planner functions `plan_forward`, `plan_backward`, `saved_layout` and the
per-call layout `layout.call_layout`) takes ~75 small launches per forward and ~45 per
backward; these kernels take one each (single program, a handful of scalars). They are held
bit-equal to it in the interpreter (tests/cpu/test_kernels_bookkeeping_interp.py).

The layout is not written here: the kernels receive the tables of layout.py (`region_table`):
one row per region, (bytes per row, bytes per padded row, index of the same region among the
saved ones or -1, index among the backward layout's or -1, tail bytes), so every precision's
layout runs through the same code. A region's bytes are align128(per_row * R + per_padded_row *
Rp + tail), Rp = layout.padded_rows(R, E_local).

Outputs, one int64 vector `addr` and one int32 vector `i32` per call (kernel arguments of the
downstream kernels are views of single entries):

    addr[X]          slot address of the saved layer input x (replay)
    addr[ROUTES]     slot address of the saved route outputs; in backward: where the route
                     outputs are read (slot, or the combine buffer when replayed)
    addr[REGIONS+i]  region i of the call's layout (forward: its mode's; backward: the replay
                     layout's, whose regions include the backward ones): a saved region of a
                     full-save layer is its slot address, every other region its scratch one
    i32[SAVE]    1 when the full state is kept (the combine kernel's save flag)
    i32[XROWS]   T when the input x is kept for replay, else 0 (copy_rows row count)
    i32[NROWS]   backward: R when the layer is replayed, else 0 (replay row count)
    rec = [slot, start, need, position, saved_before[EP]]  (training forward; kept for backward)
Backward also writes the predicated expert offsets (the replay's, zeros when not replayed).

Layout guard: before any of the call's kernels writes the arena, the kernel checks that the
call's layout fits the scratch (bytes needed <= the plan's scratch bytes) and traps with
CHECK_LAYOUT_OUTSIDE_ARENA (bytes needed, bytes available, R) otherwise; in the interpreter,
which cannot trap, the verdict goes to `status` [3] int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import trap_on_code

__all__ = ["ADDR", "I32", "ADDR_FIXED", "I32_LEN", "REC_FIXED", "TAB_COLS", "region_table",
           "plan_forward_kernel", "plan_backward_kernel", "layout_kernel"]

ADDR = dict(X=0, ROUTES=1)
ADDR_FIXED = 2     # region i of the call's layout is addr[ADDR_FIXED + i]
I32 = dict(SAVE=0, XROWS=1, NROWS=2)
I32_LEN = 4
REC_FIXED = 4      # slot, start, need, position; then saved_before[EP]
TAB_COLS = 5       # per_row, per_padded_row, saved index, backward index, tail
_COLS = tl.constexpr(TAB_COLS)


def region_table(specs, saved_names=(), backward_names=(), device=None) -> torch.Tensor:
    """int64 [n, TAB_COLS] table of layout.RegionSpec rows for the kernels below."""
    saved_names, backward_names = list(saved_names), list(backward_names)
    rows = [[s.per_row, s.per_padded_row,
             saved_names.index(s.name) if s.name in saved_names else -1,
             backward_names.index(s.name) if s.name in backward_names else -1, s.tail]
            for s in specs]
    return torch.tensor(rows or [[0, 0, -1, -1, 0]], dtype=torch.int64, device=device)


@triton.jit
def _align128(n):
    return (n + 127) // 128 * 128


@triton.jit
def _padded(R, E):
    """layout.padded_rows"""
    return (R + 127 * E + 127) // 128 * 128


@triton.jit
def _region_bytes(tab_ptr, i, R, Rp):
    return _align128(tl.load(tab_ptr + i * _COLS) * R + tl.load(tab_ptr + i * _COLS + 1) * Rp
                     + tl.load(tab_ptr + i * _COLS + 4))


@triton.jit
def _total(tab_ptr, n, R, Rp):
    total = R * 0
    for i in range(n):
        total += _region_bytes(tab_ptr, i, R, Rp)
    return total


@triton.jit
def _offset_of(tab_ptr, j, R, Rp):
    """Offset of region j from its layout's base."""
    off = R * 0
    for i in range(j):
        off += _region_bytes(tab_ptr, i, R, Rp)
    return off


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
def layout_kernel(rows_ptr, out_ptr, n_rows, tab_ptr, n, E):
    """out[i] = (offset of every region, total) of the table's layout for rows_ptr[i]: the
    layout twin's test entry point (out [n_rows, n + 1])."""
    for r in range(n_rows):
        R = tl.load(rows_ptr + r)
        Rp = _padded(R, E)
        off = R * 0
        for i in range(n):
            tl.store(out_ptr + r * (n + 1) + i, off)
            off += _region_bytes(tab_ptr, i, R, Rp)
        tl.store(out_ptr + r * (n + 1) + n, off)


@triton.jit
def plan_forward_kernel(offsets_ptr, saved_ptr, position_ptr, selected_ptr, rows_ep_ptr,
                        num_rows_ptr, act_base_ptr, arena_end_ptr, rec_ptr, need_ptr, addr_ptr,
                        i32_ptr, status_ptr, tab_ptr, n_regions, saved_tab_ptr, n_saved,
                        rank, EP, T, E_local, input_bytes, capacity, routes_bytes,
                        scratch_bytes, TRAINING: tl.constexpr, EP_PAD: tl.constexpr,
                        TRAP: tl.constexpr):
    p = tl.arange(0, EP_PAD)
    pm = p < EP
    R = tl.load(num_rows_ptr).to(tl.int64)
    Rp = _padded(R, E_local)
    act_base = tl.load(act_base_ptr)
    arena_end = tl.load(arena_end_ptr)
    total = _total(tab_ptr, n_regions, R, Rp)
    _guard(total, scratch_bytes, R, status_ptr, TRAP)
    base = arena_end - total
    if TRAINING:
        slot = tl.load(selected_ptr)
        planned = tl.load(selected_ptr + 1)
        pos = tl.load(position_ptr + slot)
        saved = tl.load(saved_ptr + slot * EP + p, mask=pm, other=0)
        rows = tl.load(rows_ep_ptr + p, mask=pm, other=0)
        rows_p = _padded(rows, E_local)
        full = _total(saved_tab_ptr, n_saved, rows, rows_p) + routes_bytes
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
        # saved layout in the slot: the saved regions then the routes (full save), or x alone
        slot_base = act_base + start
        off = R * 0
        for i in range(n_regions):
            j = tl.load(tab_ptr + i * _COLS + 2)
            at = base + off
            if j >= 0:
                at = tl.where(need, at, slot_base + _offset_of(saved_tab_ptr, j, R, Rp))
            tl.store(addr_ptr + 2 + i, at)
            off += _region_bytes(tab_ptr, i, R, Rp)
        tl.store(addr_ptr + 0, slot_base)
        tl.store(addr_ptr + 1, slot_base + _total(saved_tab_ptr, n_saved, R, Rp))
        tl.store(i32_ptr + 0, tl.where(need, 0, 1).to(tl.int32))
        tl.store(i32_ptr + 1, tl.where(need, T, 0).to(tl.int32))
    else:
        # inference: everything in scratch (the slot addresses are never read)
        off = R * 0
        for i in range(n_regions):
            tl.store(addr_ptr + 2 + i, base + off)
            off += _region_bytes(tab_ptr, i, R, Rp)


@triton.jit
def plan_backward_kernel(offsets_ptr, saved_ptr, position_ptr, rec_ptr, num_rows_ptr,
                         expert_offsets_ptr, act_base_ptr, arena_end_ptr, combine_addr_ptr,
                         addr_ptr, i32_ptr, pred_offsets_ptr, status_ptr, rp_tab_ptr, n_replay,
                         bw_tab_ptr, n_backward, saved_tab_ptr, n_saved, EP, T, E_local,
                         scratch_bytes, EP_PAD: tl.constexpr, E_PAD: tl.constexpr,
                         TRAP: tl.constexpr):
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
    Rp = _padded(R, E_local)
    arena_end = tl.load(arena_end_ptr)
    r_total = _total(rp_tab_ptr, n_replay, R, Rp)
    b_total = _total(bw_tab_ptr, n_backward, R, Rp)
    total = tl.where(need, r_total, b_total)
    _guard(total, scratch_bytes, R, status_ptr, TRAP)
    r_base = arena_end - r_total
    b_base = arena_end - b_total
    slot_base = tl.load(act_base_ptr) + start
    off = R * 0
    for i in range(n_replay):
        js = tl.load(rp_tab_ptr + i * _COLS + 2)
        jb = tl.load(rp_tab_ptr + i * _COLS + 3)
        other = r_base + off   # a forward temporary: read only when replayed
        if js >= 0:
            other = slot_base + _offset_of(saved_tab_ptr, js, R, Rp)
        elif jb >= 0:
            other = b_base + _offset_of(bw_tab_ptr, jb, R, Rp)
        tl.store(addr_ptr + 2 + i, tl.where(need, r_base + off, other))
        off += _region_bytes(rp_tab_ptr, i, R, Rp)
    tl.store(addr_ptr + 0, slot_base)
    tl.store(addr_ptr + 1, tl.where(need, tl.load(combine_addr_ptr),
                                    slot_base + _total(saved_tab_ptr, n_saved, R, Rp)))
    tl.store(i32_ptr + 0, tl.where(need, 0, 1).to(tl.int32))
    tl.store(i32_ptr + 1, tl.where(need, T, 0).to(tl.int32))
    tl.store(i32_ptr + 2, tl.where(need, R, 0).to(tl.int32))
    e = tl.arange(0, E_PAD)
    offs = tl.load(expert_offsets_ptr + e, mask=e <= E_local, other=0)
    tl.store(pred_offsets_ptr + e, tl.where(need, offs, 0), mask=e <= E_local)

"""The one per-call layout (layout.py) and everything that must agree with it.

Invariants, for every mode and precision the layout knows, random shapes and every row count a
context can receive (0 to the total bound, device tier and VMM host tier):
  * regions are contiguous, aligned and disjoint, inside [base, base + total);
  * plan_memory's scratch holds the layout of every mode the context runs at every R <= its
    row bound, so a layout anchored at the arena end stays inside the scratch region;
  * the CUDA backend's bookkeeping (the torch version here, the Triton kernels in the
    interpreter child) hands out exactly the layout's addresses, all inside the scratch;
  * the reference backend's scratch views are the same offsets, inside its arena;
  * the Triton twin of the layout (kernels/bookkeeping.py) gives the same numbers.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import megatron_dist_moe as dm
from megatron_dist_moe import layout as L
from megatron_dist_moe import testing as tt

HERE = os.path.dirname(os.path.abspath(__file__))
PRECISIONS = L.PRECISIONS_WITH_LAYOUT


def random_configs(n: int, seed: int = 0):
    """(Config, EP) pairs: random shapes, inference and training, with and without VMM host
    scratch, device factors below and above the balanced rows."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ep = rng.choice([1, 2, 4, 8])
        K = rng.choice([1, 2, 6, 8])
        E_local = rng.choice([max(1, K // 2), K, K + 2])
        E_local = max(E_local, -(-K // ep))   # E = E_local * EP >= K
        inference = i % 3 == 0
        dev = rng.choice([0.5, 1.0, 2.0, 3.0])
        host = rng.choice([None, dev * 2, dev * 4])
        precision = rng.choice([p for p in L.PRECISIONS_WITH_LAYOUT
                                if inference or "train_forward" in L.precision_modes(p)])
        mult = 64 if precision == "bf16" else 128
        cfg = dm.Config(num_local_input_tokens=rng.choice([1, 7, 64, 96, 128, 333, 2048]),
                        hidden_dim=mult * rng.randint(1, 7680 // mult),
                        intermediate_dim=mult * rng.randint(1, 3840 // mult), precision=precision,
                        top_k=K, num_experts=E_local * ep, inference=inference,
                        num_activation_slots=0 if inference else rng.randint(1, 3),
                        activation_slot_capacity_factor=None if inference else 1.0,
                        device_scratch_capacity_factor=dev, host_scratch_capacity_factor=host,
                        backend="reference")
        out.append((cfg, ep))
    return out


def row_counts(plan, rng: random.Random):
    bound = plan.total_scratch_rows
    rows = {0, 1, bound, plan.device_scratch_rows, max(0, bound - 1)}
    rows |= {rng.randint(0, bound) for _ in range(6)}
    return sorted(r for r in rows if 0 <= r <= bound)


@pytest.mark.parametrize("mode,precision", [(m, p) for p in PRECISIONS
                                            for m in L.precision_modes(p)])
def test_regions_are_contiguous_aligned_disjoint(mode, precision):
    rng = random.Random(hash((mode, precision)) & 0xFFFF)
    for _ in range(200):
        D, F, R = 128 * rng.randint(1, 64), 128 * rng.randint(1, 32), rng.randint(0, 50000)
        lay = L.call_layout(mode, R, D, F, precision, rng.randint(1, 32))
        off = 0
        for reg in lay.regions:
            assert reg.offset == off, (mode, reg)
            assert reg.nbytes % 128 == 0 and reg.offset % 128 == 0
            off += reg.nbytes
        assert lay.total == off
        spans = sorted((r.offset, r.offset + r.nbytes) for r in lay.regions)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans


def test_plan_scratch_holds_every_layout_of_every_row_count():
    rng = random.Random(1)
    for cfg, ep in random_configs(60):
        plan = dm.plan_memory(cfg, ep_size=ep)
        for R in row_counts(plan, rng):
            for mode in L.modes_of(not cfg.inference):
                need = L.call_layout(mode, R, cfg.hidden_dim, cfg.intermediate_dim,
                                     cfg.precision, plan.num_local_experts).total
                assert need <= plan.total_scratch_bytes, (cfg, ep, mode, R)
                if R <= plan.device_scratch_rows:   # device tier: device pages only
                    assert need <= plan.device_scratch_bytes, (cfg, ep, mode, R)
        # and it is no larger than it needs to be: the largest layout at the bound
        top = max(L.call_layout(m, plan.total_scratch_rows, cfg.hidden_dim, cfg.intermediate_dim,
                                cfg.precision, plan.num_local_experts).total
                  for m in L.modes_of(not cfg.inference))
        assert plan.total_scratch_bytes == dm.memory_plan.align128(top)


def _addresses_inside(addrs: dict, lo: int, hi: int, what):
    for name, (a, n) in addrs.items():
        assert lo <= a and a + n <= hi, f"{what}: {name} [{a}, {a + n}) outside [{lo}, {hi})"
    spans = sorted((a, a + n) for a, n in addrs.values() if n)
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:])), f"{what}: overlap {spans}"


def _tables(R: int, E_local: int, ep: int, rank: int):
    from megatron_dist_moe.backends.cuda.routing import RoutingTables
    z = torch.zeros(1, dtype=torch.int64)
    cuts = torch.linspace(0, R, E_local + 1).round().to(torch.int32)
    rows_EP = torch.full((ep,), R, dtype=torch.int64)
    return RoutingTables(expert_offsets=cuts, num_rows=torch.tensor([R], dtype=torch.int32),
                         rows_EP=rows_EP, fwd_gather_ptrs=z, combine_ptrs=z,
                         dispatch_route_ptrs=z, max_rows=R)


def test_cuda_bookkeeping_hands_out_the_layout_inside_the_scratch():
    """The torch bookkeeping (the Triton one is held equal to it in the interpreter child):
    every region of every call lies where the layout places it: scratch regions in
    [arena_end - scratch, arena_end), the saved regions of a full-save layer in its slot, and
    no two overlap. At cfa8b72 an inference call placed x_g 2R(D+F) bytes below the arena."""
    from megatron_dist_moe.backends.cuda.bookkeeping import TorchBookkeeping
    from megatron_dist_moe.planner import PlannerState
    rng = random.Random(2)
    for cfg, ep in random_configs(40, seed=3):
        plan = dm.plan_memory(cfg, ep_size=ep)
        base = 1 << 40
        end = base + plan.scratch_offset + plan.total_scratch_bytes
        lo = end - plan.total_scratch_bytes
        D, F, E_local = cfg.hidden_dim, cfg.intermediate_dim, plan.num_local_experts
        saved = {r.name for r in L.saved_regions(D, F, cfg.precision)}
        for R in row_counts(plan, rng):
            st = PlannerState.create(plan, "cpu")
            bk = TorchBookkeeping(plan, st, 0, torch.tensor([base]), torch.tensor([end]),
                                  torch.tensor([7 << 40]))
            tabs = _tables(R, E_local, ep, 0)
            T = cfg.num_local_input_tokens
            training = not cfg.inference
            if training:
                st.select(0, 1)
            fa = bk.forward(tabs, T, training)
            mode = "train_forward" if training else "inference"
            lay = L.call_layout(mode, R, D, F, cfg.precision, E_local)
            assert list(fa.at) == list(lay.names)
            in_slot = training and not bool(fa.record.need_recompute)
            scratch = {n: (int(a), lay[n].nbytes) for n, a in fa.at.items()
                       if not (in_slot and n in saved)}
            _addresses_inside(scratch, lo, end, f"{mode} R={R} {cfg}")
            for name, (a, _n) in scratch.items():
                assert a == end - lay.total + lay[name].offset, (mode, name)
            if in_slot:
                offs = L.saved_offsets(R, D, F, cfg.precision, E_local)
                slot = {n: (int(fa.at[n]), lay[n].nbytes) for n in saved}
                _addresses_inside(slot, base, base + plan.slot_bytes, f"slot R={R} {cfg}")
                for n in saved:
                    assert int(fa.at[n]) == base + offs[n], n
            if training:
                ba = bk.backward(fa.record, None, tabs, T)
                need = bool(fa.record.need_recompute)
                lay = L.call_layout("replay" if need else "backward", R, D, F, cfg.precision,
                                    E_local)
                got = {n: (int(ba.at[n]), lay[n].nbytes) for n in lay.names
                       if need or n not in saved}
                _addresses_inside(got, lo, end, f"backward R={R} {cfg}")


def test_reference_backend_scratch_views_follow_the_layout():
    """The reference backend's views are the layout's offsets from its arena end."""
    from megatron_dist_moe.backends.reference import ReferenceBackend
    import types
    rng = random.Random(4)
    for cfg, ep in random_configs(12, seed=5):
        if cfg.hidden_dim * cfg.intermediate_dim > 1 << 20:
            cfg = cfg.replace(hidden_dim=128, intermediate_dim=256)
        plan = dm.plan_memory(cfg, ep_size=ep)
        ctx = types.SimpleNamespace(config=cfg, plan=plan, device=torch.device("cpu"),
                                    num_local_experts=plan.num_local_experts)
        be = ReferenceBackend(ctx)
        arena = be._arena(torch.bfloat16)
        end = arena.data_ptr() + arena.numel()
        for R in row_counts(plan, rng)[:4]:
            for mode in L.modes_of(not cfg.inference):
                lay = L.call_layout(mode, R, cfg.hidden_dim, cfg.intermediate_dim,
                                    cfg.precision, plan.num_local_experts)
                views = be._views(torch.bfloat16, mode, R)
                for reg in lay.regions:
                    if reg.nbytes == 0:
                        continue
                    v = views(reg.name, (reg.nbytes,), torch.uint8)
                    assert v.data_ptr() == end - lay.total + reg.offset, (mode, reg.name, R)
                    assert end - plan.total_scratch_bytes <= v.data_ptr()
                    assert v.data_ptr() + v.numel() <= end


@pytest.fixture(scope="module")
def twin_results():
    pytest.importorskip("triton")
    return tt.run_child_checks([os.path.join(HERE, "children", "layout_twin.py")])[0]


def test_triton_twin_gives_the_same_layout(twin_results):
    r = twin_results["layout_twin"]
    assert r["ok"], r.get("error")
    assert r["cases"] > 100


def test_triton_bookkeeping_guard_traps_on_a_layout_past_the_arena(twin_results):
    """The device guard: a call whose layout does not fit the scratch is stopped before any
    write, with the numbers (in the interpreter: the status word instead of a trap)."""
    r = twin_results["layout_guard"]
    assert r["ok"], r.get("error")
    code, need, avail = r["status"]
    assert code == 6 and need > avail == r["scratch_bytes"]

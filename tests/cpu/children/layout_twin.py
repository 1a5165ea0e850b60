"""Child of tests/cpu/test_layout.py (TRITON_INTERPRET=1): the device twin of the per-call
layout (kernels/bookkeeping.py reading layout.py's tables) against layout.call_layout, and the
bookkeeping kernel's layout guard."""

import json
import random
import traceback

import torch

import megatron_dist_moe as dm
from megatron_dist_moe import layout as L
from megatron_dist_moe.kernels.bookkeeping import layout_kernel, region_table


def twin():
    rng = random.Random(0)
    cases = 0
    for _ in range(20):
        D, F, E = 128 * rng.randint(1, 64), 128 * rng.randint(1, 32), rng.randint(1, 16)
        rows = torch.tensor([0, 1, 127, 128, 129] + [rng.randint(0, 60000) for _ in range(5)],
                            dtype=torch.int64)
        for precision in L.PRECISIONS_WITH_LAYOUT:
            for mode in L.precision_modes(precision):
                specs = L.region_specs(mode, D, F, precision)
                n = len(specs)
                out = torch.zeros(rows.numel(), n + 1, dtype=torch.int64)
                layout_kernel[(1,)](rows, out, rows.numel(), region_table(specs), n, E)
                for i, R in enumerate(rows.tolist()):
                    lay = L.call_layout(mode, R, D, F, precision, E)
                    want = [r.offset for r in lay.regions] + [lay.total]
                    assert out[i].tolist() == want, (precision, mode, R, D, F, E)
                    cases += 1
    return dict(cases=cases)


def guard():
    """A forward whose rows exceed what the scratch holds: the kernel must refuse it."""
    from megatron_dist_moe.backends.cuda.bookkeeping import TritonBookkeeping
    from megatron_dist_moe.backends.cuda.routing import RoutingTables
    from megatron_dist_moe.planner import PlannerState
    cfg = dm.Config(num_local_input_tokens=16, hidden_dim=64, intermediate_dim=128, top_k=2,
                    num_experts=4, inference=True, num_activation_slots=0,
                    device_scratch_capacity_factor=1.0, backend="reference")
    plan = dm.plan_memory(cfg, ep_size=1)
    base = torch.tensor([1 << 40])
    end = base + plan.activation_buffer_bytes
    bk = TritonBookkeeping(plan, PlannerState.create(plan, "cpu"), 0, base, end,
                           torch.tensor([7 << 40]), num_local_experts=4)
    R = plan.total_scratch_rows + 1
    z = torch.zeros(1, dtype=torch.int64)
    tabs = RoutingTables(expert_offsets=torch.tensor([0, R, R, R, R], dtype=torch.int32),
                         num_rows=torch.tensor([R], dtype=torch.int32),
                         rows_EP=torch.tensor([R]), fwd_gather_ptrs=z, combine_ptrs=z,
                         dispatch_route_ptrs=z, max_rows=R)
    bk.forward(tabs, 16, False)
    return dict(status=bk.status.tolist(), scratch_bytes=plan.total_scratch_bytes)


if __name__ == "__main__":
    for name, fn in (("layout_twin", twin), ("layout_guard", guard)):
        try:
            res = dict(name=name, ok=True, **fn())
        except Exception as ex:
            res = dict(name=name, ok=False, error=f"{type(ex).__name__}: {ex}",
                       trace=traceback.format_exc()[-2000:])
        print("RESULT " + json.dumps(res), flush=True)

"""Child of tests/cpu/test_layout.py (TRITON_INTERPRET=1): the Triton twin of the per-call
layout against layout.call_layout, and the bookkeeping kernel's layout guard."""

import json
import random
import traceback

import torch

import megatron_dist_moe as dm
from megatron_dist_moe import layout as L
from megatron_dist_moe.kernels.bookkeeping import bf16_layout_kernel

MODES = {"inference": 0, "train_forward": 0, "backward": 1, "replay": 2}
FIELDS = ("x_g", "h1", "h2", "g3")


def twin():
    rng = random.Random(0)
    cases = 0
    for _ in range(30):
        D, F = 64 * rng.randint(1, 128), 64 * rng.randint(1, 64)
        rows = torch.tensor([0, 1, 127, 128, 129] + [rng.randint(0, 60000) for _ in range(6)],
                            dtype=torch.int64)
        for mode, code in MODES.items():
            out = torch.zeros(rows.numel(), 5, dtype=torch.int64)
            bf16_layout_kernel[(1,)](rows, out, rows.numel(), D, F, MODE=code)
            for i, R in enumerate(rows.tolist()):
                lay = L.call_layout(mode, R, D, F)
                want = [lay[n].offset if n in lay else 0 for n in FIELDS] + [lay.total]
                assert out[i].tolist() == want, (mode, R, D, F, out[i].tolist(), want)
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
    for name, fn in (("bf16_layout_twin", twin), ("layout_guard", guard)):
        try:
            res = dict(name=name, ok=True, **fn())
        except Exception as ex:
            res = dict(name=name, ok=False, error=f"{type(ex).__name__}: {ex}",
                       trace=traceback.format_exc()[-2000:])
        print("RESULT " + json.dumps(res), flush=True)

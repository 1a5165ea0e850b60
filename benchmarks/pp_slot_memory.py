"""Saved-state memory of stage-microbatch slots vs whole-microbatch slots (pure, runs anywhere).

    python benchmarks/pp_slot_memory.py [--config configs/guide_bench.yaml] [--csv out.csv]

For Megatron's schedules on each pipeline rank: the peak number of live slots under each policy
and the budget = peak live slots x MoE layers per slot x balanced full-state bytes per layer
(from plan_memory). Guide §06: stage slots can use less memory despite a higher live count,
because each slot holds fewer MoE layers.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_dist_moe as dm  # noqa: E402
from megatron_dist_moe.megatron.pipeline_slots import slot_memory  # noqa: E402

SCHEDULES = [  # (microbatches, PP, VP, MoE layers per virtual stage)
    (8, 2, 1, 8), (8, 2, 2, 4), (16, 4, 2, 4), (16, 4, 4, 2), (32, 8, 2, 2),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs",
                                                     "guide_bench.yaml"))
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    cfg = dm.load_config(args.config)
    per_layer = dm.plan_memory(cfg, args.ep).balanced_full_state_bytes
    rows = []
    print(f"balanced full state per MoE layer: {per_layer / 2**20:.0f} MiB ({args.config}, EP={args.ep})")
    print(f"{'M':>3} {'PP':>3} {'VP':>3} {'rank':>4} {'stage slots':>11} {'GiB':>7} "
          f"{'mb slots':>8} {'GiB':>7} {'saving':>7}")
    for M, PP, VP, L in SCHEDULES:
        worst = None
        for r in range(PP):
            sm = slot_memory(M, PP, r, VP, L, per_layer)
            row = dict(microbatches=M, pp=PP, vp=VP, rank=r, moe_layers_per_stage=L,
                       stage_slots=sm.stage_slots, stage_gib=round(sm.stage_bytes / 2**30, 2),
                       microbatch_slots=sm.microbatch_slots,
                       microbatch_gib=round(sm.microbatch_bytes / 2**30, 2))
            rows.append(row)
            if worst is None or sm.stage_bytes > worst[0].stage_bytes:
                worst = (sm, r)
        sm, r = worst
        print(f"{M:>3} {PP:>3} {VP:>3} {r:>4} {sm.stage_slots:>11} {sm.stage_bytes / 2**30:>7.2f} "
              f"{sm.microbatch_slots:>8} {sm.microbatch_bytes / 2**30:>7.2f} "
              f"{1 - sm.stage_bytes / sm.microbatch_bytes:>6.0%}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()

"""Judge the opt-in candidates: their guide-load times against the defaults, next to the
predictions written before measuring (docs/perf_notes.md).

Reads the bench_layer.csv files that `scripts/device/gpu_session.sh candidates` writes
(`<out>/cand_default/` for the defaults, `<out>/cand_<KNOB>/` for each knob alone and
`<out>/cand_all/` for all together; `<out>/bench_layer.csv` stands in for the defaults when
there is no cand_default), prints one row per (candidate, path, mode) with the time, the change
against the defaults measured in the same call, and the predicted range, and writes the table
as CSV and a bar plot.

    python benchmarks/compare_candidates.py <out dir of the GPU session> [--csv F] [--plot F]

A knob is worth making the default when its change is negative beyond the run-to-run range of
the default (the ms_min..ms_max columns) and dist_check passed with it on.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

from plotting import pyplot

# Predicted change of the fwd+bwd iteration (ms), from docs/perf_notes.md; path it applies to.
PREDICTIONS = {
    "DIST_MOE_CLAIM_SLICE_K": ("dist_moe_staged", (-0.5, -0.4)),
    "DIST_MOE_ROUTING": ("dist_moe", (-0.15, -0.08)),
    "DIST_MOE_BOOKKEEPING": ("dist_moe", (-0.15, -0.08)),
    "DIST_MOE_FUSE_SWIGLU_BWD": ("dist_moe", (-0.15, -0.1)),
    "DIST_MOE_WGRAD_OVERLAP": ("dist_moe", (-0.2, -0.05)),
}


def read_rows(path: str, case: str = "guide") -> list[dict]:
    with open(path) as f:
        return [r for r in csv.DictReader(f) if r["case"] == case]


def compare(out_dir: str, case: str = "guide") -> list[dict]:
    base_path = os.path.join(out_dir, "cand_default", "bench_layer.csv")
    if not os.path.exists(base_path):
        base_path = os.path.join(out_dir, "bench_layer.csv")
    if not os.path.exists(base_path):
        raise SystemExit(f"{out_dir}: no default-path run (cand_default/ or bench_layer.csv)")
    base = {(r["path"], r["mode"]): r for r in read_rows(base_path, case)}
    out = []
    names = sorted(d for d in os.listdir(out_dir) if d.startswith("cand_") and d != "cand_default"
                   and os.path.exists(os.path.join(out_dir, d, "bench_layer.csv")))
    if not names:
        raise SystemExit(f"{out_dir}: no cand_*/bench_layer.csv (gpu_session.sh candidates)")
    for name in names:
        knob = name[len("cand_"):]
        for r in read_rows(os.path.join(out_dir, name, "bench_layer.csv"), case):
            b = base.get((r["path"], r["mode"]))
            if b is None:
                continue
            ms, ms_b = float(r["ms"]), float(b["ms"])
            noise = (float(b["ms_max"]) - float(b["ms_min"])) / 2
            pred_path, pred = PREDICTIONS.get(knob, (None, None))
            out.append(dict(
                candidate=knob, path=r["path"], mode=r["mode"], ms=round(ms, 4),
                default_ms=round(ms_b, 4), change_ms=round(ms - ms_b, 4),
                default_half_range_ms=round(noise, 4),
                predicted_ms=(f"{pred[0]:+.2f}..{pred[1]:+.2f}"
                              if pred and r["mode"] == "fwdbwd" and r["path"] == pred_path
                              else ""),
                useful_tflops=r["useful_tflops"], commit=r["commit"], gpu=r["gpu"]))
    return out


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    sel = [r for r in rows if r["mode"] == "fwdbwd"]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(sel) + 1.5))
    labels = [f"{r['candidate']} ({r['path']})" for r in sel]
    ax.barh(labels, [r["change_ms"] for r in sel],
            color=["tab:green" if r["change_ms"] < -r["default_half_range_ms"] else "tab:gray"
                   for r in sel])
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("fwd+bwd change vs default (ms, negative = faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--case", default="guide")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    rows = compare(args.out_dir, args.case)
    cols = ["candidate", "path", "mode", "ms", "default_ms", "change_ms", "default_half_range_ms",
            "predicted_ms"]
    print("  ".join(f"{c:>22}" for c in cols))
    for r in rows:
        print("  ".join(f"{str(r[c]):>22}" for c in cols))
    csv_path = args.csv or os.path.join(args.out_dir, "candidates.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {csv_path}")
    plot(rows, args.plot or os.path.join(args.out_dir, "candidates.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two source trees' bench_layer runs, alternated round by round in one call, compared per path
and mode: each round's difference (this tree - the baseline tree) and their median.

A lever worth a few hundredths of a millisecond hides in one bench_layer run's spread (its
windows range over ~0.1 ms at the guide load) and in the GPU's drift from one run to the next;
rounds that alternate the trees share that drift, rounds that swap which tree runs first
(`gpu_session.sh abtrees` does, every other round) cancel a bias of the order, and a path that
both trees run unchanged (the control) shows how much of a difference is the trees and how much
the run.

    python benchmarks/ab_trees.py --this out/abtrees/this_r1 out/abtrees/this_r2 ... \\
        --base out/abtrees/base_r1 out/abtrees/base_r2 ... --out out/abtrees

Each folder holds one bench_layer.csv; round i pairs --this[i] with --base[i]. Rows:
ab_trees.csv (commit of each tree, gpu, case, path, mode, rounds, this_ms and base_ms medians,
diff_ms median, min, max, ratio base/this); a plot ab_trees.png of each round's difference.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plotting import pyplot  # noqa: E402

FIELDS = ["commit", "base_commit", "gpu", "case", "precision", "path", "mode", "rounds",
          "this_ms", "base_ms", "diff_ms", "diff_min_ms", "diff_max_ms", "ratio"]


def load(folder: str) -> dict[tuple, dict]:
    """bench_layer.csv's rows of one run keyed by (case, path, mode)."""
    path = os.path.join(folder, "bench_layer.csv")
    if not os.path.isfile(path):
        raise SystemExit(f"{folder}: no bench_layer.csv (did that round's run fail?)")
    out: dict[tuple, dict] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            key = (r["case"], r["path"], r["mode"])
            if key in out:   # bench_layer appends: a reused folder holds two runs
                raise SystemExit(f"{path}: {key} appears twice; give each run its own folder")
            out[key] = r
    return out


def compare(this: list[dict], base: list[dict]) -> list[dict]:
    """Per (case, path, mode) that every round of both trees measured: the medians and the
    per-round differences."""
    if len(this) != len(base) or not this:
        raise SystemExit(f"--this has {len(this)} runs, --base {len(base)}: give one per round")
    keys = set(this[0])
    for run in this + base:
        keys &= set(run)
    out = []
    for key in sorted(keys):
        a = [float(r[key]["ms"]) for r in this]
        b = [float(r[key]["ms"]) for r in base]
        d = [x - y for x, y in zip(a, b)]
        first = this[0][key]
        out.append(dict(commit=first["commit"], base_commit=base[0][key]["commit"],
                        gpu=first["gpu"], case=key[0], precision=first.get("precision", ""),
                        path=key[1], mode=key[2], rounds=len(d),
                        this_ms=round(statistics.median(a), 4),
                        base_ms=round(statistics.median(b), 4),
                        diff_ms=round(statistics.median(d), 4), diff_min_ms=round(min(d), 4),
                        diff_max_ms=round(max(d), 4),
                        ratio=round(statistics.median(b) / statistics.median(a), 4), _d=d))
    return out


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    for i, r in enumerate(rows):
        ax.scatter([i] * len(r["_d"]), r["_d"], color="tab:blue", s=18)
        ax.hlines(r["diff_ms"], i - 0.3, i + 0.3, color="tab:red")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['path']}\n{r['mode']}" for r in rows], fontsize=7)
    ax.set_ylabel("this - base (ms), per round; red: median")
    ax.set_title(f"{rows[0]['commit']} vs {rows[0]['base_commit']} on {rows[0]['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--this", nargs="+", required=True, help="this tree's run folders, by round")
    ap.add_argument("--base", nargs="+", required=True, help="the baseline's run folders, by round")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows = compare([load(f) for f in args.this], [load(f) for f in args.base])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ab_trees.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"{'case':8s} {'path':20s} {'mode':8s} {'this':>8s} {'base':>8s} {'diff':>8s} "
          f"{'[min, max]':>18s} rounds")
    for r in rows:
        print(f"{r['case']:8s} {r['path']:20s} {r['mode']:8s} {r['this_ms']:8.3f} "
              f"{r['base_ms']:8.3f} {r['diff_ms']:+8.3f} "
              f"[{r['diff_min_ms']:+.3f}, {r['diff_max_ms']:+.3f}] {r['rounds']:>4d}")
    plot(rows, os.path.join(args.out, "ab_trees.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Do dist_moe's and alltoall's Megatron loss curves agree within run-to-run noise?

    python benchmarks/megatron_loss_noise.py RUN_A.csv RUN_B.csv [...] --out OUTDIR

Each CSV is one `examples/tiny_gpt_dist_moe.py --compare --csv` run (columns step,
loss_alltoall, loss_dist_moe, ...; with --repeat-alltoall also loss_alltoall_repeat, a second
alltoall model from the same weights and batches, which gives a noise pair within one run). Two runs with the same seed give two alltoall curves from
identical weights and batches: on the GPU they still separate (non-deterministic bf16 reductions
amplified by the loss spikes of early training), and the gap between them is the noise band.
Every pair of curves is compared over step windows by the largest gap of the 10-step moving
averages and the mean difference; the verdict for dist_moe is "within noise" when, in every
window, some dist_moe-vs-alltoall gap is no larger than the largest alltoall-vs-alltoall gap
(or, with one run, when dist_moe's window mean is within 2% of alltoall's).

Writes OUTDIR/loss_noise.csv (one row per window and pair) and OUTDIR/loss_noise.png.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys


def load_curves(paths: list[str]) -> dict[str, list[float]]:
    """{'alltoall#0': [...], 'dist_moe#0': [...], ...}, one pair per CSV, in file order."""
    curves = {}
    for i, path in enumerate(paths):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows or "loss_alltoall" not in rows[0] or "loss_dist_moe" not in rows[0]:
            raise ValueError(f"{path}: expected a --compare CSV with loss_alltoall and "
                             "loss_dist_moe columns")
        for kind in ("alltoall", "dist_moe"):
            curves[f"{kind}#{i}"] = [float(r[f"loss_{kind}"]) for r in rows]
        if "loss_alltoall_repeat" in rows[0]:   # --repeat-alltoall: a noise pair in one run
            curves[f"alltoall#{i}r"] = [float(r["loss_alltoall_repeat"]) for r in rows]
    return curves


def moving_average(v: list[float], width: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(v):
        acc += x - (v[i - width] if i >= width else 0.0)
        out.append(acc / min(i + 1, width))
    return out


def default_windows(n: int) -> list[tuple[int, int]]:
    edges = [e for e in (0, 20, 60, 120, 200, n) if e <= n]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def compare(curves: dict[str, list[float]], windows: list[tuple[int, int]]) -> list[dict]:
    smooth = {k: moving_average(v) for k, v in curves.items()}
    rows = []
    for lo, hi in windows:
        for a, b in itertools.combinations(curves, 2):
            n = min(hi, len(curves[a]), len(curves[b]))
            if n <= lo:
                continue
            ka, kb = a.split("#")[0], b.split("#")[0]
            kind = "noise" if ka == kb == "alltoall" else ("dist_moe_vs_alltoall"
                                                            if {ka, kb} == {"alltoall", "dist_moe"}
                                                            else "other")
            gap = max(abs(smooth[a][i] - smooth[b][i]) for i in range(lo, n))
            mean_a = sum(curves[a][lo:n]) / (n - lo)
            mean_b = sum(curves[b][lo:n]) / (n - lo)
            rows.append(dict(window=f"{lo}-{n}", a=a, b=b, kind=kind, max_gap_ma10=round(gap, 4),
                             mean_a=round(mean_a, 4), mean_b=round(mean_b, 4),
                             mean_diff=round(mean_a - mean_b, 4)))
    return rows


def verdict(rows: list[dict]) -> tuple[bool, list[str]]:
    ok, lines = True, []
    for w in dict.fromkeys(r["window"] for r in rows):
        noise = [r["max_gap_ma10"] for r in rows if r["window"] == w and r["kind"] == "noise"]
        ours = [r for r in rows if r["window"] == w and r["kind"] == "dist_moe_vs_alltoall"]
        if not ours:
            continue
        best = min(r["max_gap_ma10"] for r in ours)
        if noise:
            good = best <= max(noise)
            lines.append(f"steps {w}: dist_moe vs alltoall gap {best:.3f} (smallest pair), "
                         f"alltoall vs alltoall {max(noise):.3f}: "
                         f"{'within noise' if good else 'OUTSIDE noise'}")
        else:
            r = ours[0]
            ref = r["mean_a"] if r["a"].startswith("alltoall") else r["mean_b"]
            good = abs(r["mean_diff"]) <= 0.02 * abs(ref)
            lines.append(f"steps {w}: mean loss difference {abs(r['mean_diff']):.4f} "
                         f"({'within' if good else 'beyond'} 2% of {ref:.4f}; one run: no noise band)")
        ok &= good
    return ok, lines


def plot(curves: dict[str, list[float]], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, v in curves.items():
        style = "-" if name.startswith("dist_moe") else "--"
        ax.plot(moving_average(v), style, label=name, lw=1.2)
        ax2.plot(range(len(v))[60:], moving_average(v)[60:], style, label=name, lw=1.2)
    ax.set_yscale("log")
    ax.set_title("loss (10-step moving average)")
    ax2.set_title("from step 60")
    for a in (ax, ax2):
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csvs", nargs="+")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    curves = load_curves(args.csvs)
    n = max(len(v) for v in curves.values())
    rows = compare(curves, default_windows(n))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "loss_noise.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"{r['window']:>8} {r['a']:>11} vs {r['b']:<11} {r['kind']:<21} "
              f"gap {r['max_gap_ma10']:.3f}  means {r['mean_a']:.4f} / {r['mean_b']:.4f}")
    ok, lines = verdict(rows)
    print("\n".join(lines))
    plot(curves, os.path.join(args.out, "loss_noise.png"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

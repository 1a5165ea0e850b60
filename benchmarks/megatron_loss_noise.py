"""Do dist_moe's and alltoall's Megatron loss curves agree within run-to-run noise?

    python benchmarks/megatron_loss_noise.py RUN_A.csv RUN_B.csv [...] --out OUTDIR

Each CSV is one `examples/tiny_gpt_dist_moe.py --compare --csv` run (columns step,
loss_alltoall, loss_dist_moe, ...). With --repeat-alltoall it also has loss_alltoall_repeat, a
second alltoall model from the same (or, with --repeat-perturb, rounding-sized perturbed) weights
and the same batches: a noise pair within one run. With --repeat-dist-moe it has
loss_dist_moe_repeat, a second dist_moe model from the same start as the alltoall repeat. Two
runs with the same seed also give two alltoall curves from identical weights and batches: on
the GPU they still separate (non-deterministic bf16 reductions amplified by the loss spikes of
early training).

Two verdicts, both per step window:
- pairs: every pair of curves is compared by the largest gap of the 10-step moving averages;
  "within noise" when some dist_moe-vs-alltoall gap is no larger than the largest
  alltoall-vs-alltoall gap (with one run and no repeat: dist_moe's window mean within 2% of
  alltoall's);
- group means (with >= 2 alltoall curves): the mean window loss over the dist_moe curves minus
  that over the alltoall curves, against the larger of the two groups' spreads (largest minus
  smallest curve mean): "no systematic difference" when it is within.
The exit status is 0 only when both hold in every window.

A run with `--fp8-recipe` (column loss_dist_moe_bf16) judges its fp8 dist_moe curve against a
bf16 band: its bf16 dist_moe curve (`bf16_dist_moe#i`) joins the alltoall curves in the
reference group, so every bf16-vs-bf16 pair counts as noise.

Writes OUTDIR/loss_noise.csv (one row per window and pair) and OUTDIR/loss_noise.png.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys

from plotting import pyplot

from megatron_dist_moe.testing import moving_average


# curve names (before '#') of the reference group: bf16 curves that dist_moe's is judged against
REFERENCE = ("alltoall", "bf16_dist_moe")


def group(name: str) -> str:
    """'alltoall' for a reference-group curve, else its kind ('dist_moe')."""
    kind = name.split("#")[0]
    return "alltoall" if kind in REFERENCE else kind


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
        for kind in ("alltoall", "dist_moe"):   # --repeat-alltoall / --repeat-dist-moe
            if f"loss_{kind}_repeat" in rows[0]:
                curves[f"{kind}#{i}r"] = [float(r[f"loss_{kind}_repeat"]) for r in rows]
        if "loss_dist_moe_bf16" in rows[0]:   # --fp8-recipe: the bf16 dist_moe model
            curves[f"bf16_dist_moe#{i}"] = [float(r["loss_dist_moe_bf16"]) for r in rows]
    return curves


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
            ka, kb = group(a), group(b)
            kind = {("alltoall", "alltoall"): "noise", ("dist_moe", "dist_moe"): "dist_moe_noise"
                    }.get((ka, kb), "dist_moe_vs_alltoall")
            gap = max(abs(smooth[a][i] - smooth[b][i]) for i in range(lo, n))
            mean_a = sum(curves[a][lo:n]) / (n - lo)
            mean_b = sum(curves[b][lo:n]) / (n - lo)
            rows.append(dict(window=f"{lo}-{n}", a=a, b=b, kind=kind, max_gap_ma10=round(gap, 4),
                             mean_a=round(mean_a, 4), mean_b=round(mean_b, 4),
                             mean_diff=round(mean_a - mean_b, 4)))
    return rows


def group_means(curves: dict[str, list[float]], windows: list[tuple[int, int]]) -> list[dict]:
    """Per window: every curve's mean loss, the mean over the alltoall curves and over the
    dist_moe curves, their difference, and each group's spread (largest minus smallest mean)."""
    out = []
    for lo, hi in windows:
        means = {k: sum(v[lo:hi]) / len(v[lo:hi]) for k, v in curves.items() if len(v) > lo}
        grp = {g: [m for k, m in means.items() if group(k) == g]
               for g in ("alltoall", "dist_moe")}
        if not grp["alltoall"] or not grp["dist_moe"]:
            continue
        out.append(dict(window=f"{lo}-{hi}",
                        diff=round(sum(grp["dist_moe"]) / len(grp["dist_moe"])
                                   - sum(grp["alltoall"]) / len(grp["alltoall"]), 4),
                        spread_alltoall=round(max(grp["alltoall"]) - min(grp["alltoall"]), 4),
                        spread_dist_moe=round(max(grp["dist_moe"]) - min(grp["dist_moe"]), 4),
                        n_alltoall=len(grp["alltoall"]), n_dist_moe=len(grp["dist_moe"])))
    return out


def group_verdict(groups: list[dict]) -> tuple[bool, list[str]]:
    """No systematic difference: in every window the dist_moe group's mean loss is within the
    larger of the two groups' spreads of the alltoall group's (needs >= 2 alltoall curves)."""
    ok, lines = True, []
    for g in groups:
        if g["n_alltoall"] < 2:
            continue
        band = max(g["spread_alltoall"], g["spread_dist_moe"])
        good = abs(g["diff"]) <= band
        ok &= good
        lines.append(f"steps {g['window']}: group means dist_moe - alltoall {g['diff']:+.4f} "
                     f"({g['n_dist_moe']} vs {g['n_alltoall']} curves), spreads alltoall "
                     f"{g['spread_alltoall']:.4f} dist_moe {g['spread_dist_moe']:.4f}: "
                     f"{'no systematic difference' if good else 'SYSTEMATIC difference'}")
    return ok, lines


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
            ref = r["mean_a"] if group(r["a"]) == "alltoall" else r["mean_b"]
            good = abs(r["mean_diff"]) <= 0.02 * abs(ref)
            lines.append(f"steps {w}: mean loss difference {abs(r['mean_diff']):.4f} "
                         f"({'within' if good else 'beyond'} 2% of {ref:.4f}; one run: no noise band)")
        ok &= good
    return ok, lines


def plot(curves: dict[str, list[float]], path: str) -> None:
    plt = pyplot()
    if plt is None:
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
    groups = group_means(curves, default_windows(n))
    gok, glines = group_verdict(groups)
    if any(k.startswith("bf16_dist_moe") for k in curves):
        lines.insert(0, "reference group ('alltoall' below): the alltoall curves and the bf16 "
                        "dist_moe curve; 'dist_moe' is the fp8 curve")
    print("\n".join(lines + glines))
    ok &= gok
    plot(curves, os.path.join(args.out, "loss_noise.png"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Are the quantized training precisions' loss curves within the bf16 run-to-run noise band?

    python benchmarks/lm_noise_band.py --seed 11=a.csv,b.csv --seed 23=c.csv ... --out OUTDIR

Each CSV is an `examples/tiny_lm_nvfp4_eval.py --csv` run (columns step, loss_bf16,
loss_bf16_repeatN, loss_fp8_block, loss_mxfp8). One seed's runs are merged by column: a seed
trained once more with `--first-repeat N --repeats M` (and the same `--repeat-perturb`, which
the CSV does not record) adds repeats N+1 ... N+M to its first run. A column present in two of
a seed's files must hold the same losses to the CSV's last digit, as reruns of the same code on
CPU do (GPU runs need not reproduce bit for bit: merge CPU runs); otherwise, or where a file
adds no column, the merge is refused.

Per seed, from the 10-step moving averages (testing.moving_average_gap, testing.noise_band):
- band: the largest gap between two bf16 curves (the unperturbed one and its perturbed repeats),
  the rule of examples/tiny_lm_nvfp4_eval.py and benchmarks/megatron_loss_noise.py; a precision
  is within it when its largest gap to the unperturbed bf16 curve is no larger;
- rank: where a precision's gap to the unperturbed curve falls among the repeats' gaps to it
  (1 = smallest of the n + 1; ties count half). If a precision's curve behaved like one more
  perturbed repeat, its rank would be uniform on 1 ... n + 1 over seeds; ranks piling up at
  n + 1 say it strays further than the noise. The band, a maximum over every bf16 pair, widens
  as repeats are added while the precision's gap stays one sample: the rank is the sounder
  of the two.

Writes OUTDIR/lm_noise_band.csv (one row per seed and precision) and OUTDIR/lm_noise_band.png;
exits 1 when a precision is outside the band at some seed, 2 when a seed has no precision to
judge.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plotting import pyplot  # noqa: E402

from megatron_dist_moe.testing import moving_average_gap, noise_band  # noqa: E402

FIELDS = ["seed", "precision", "gap", "band", "within", "rank", "of", "bf16_curves"]


def load_seed(paths: list[str]) -> dict[str, list[float]]:
    """{column without 'loss_': losses} merged over one seed's CSVs; ValueError when two files
    disagree on a column they share, or their steps differ."""
    curves: dict[str, list[float]] = {}
    origin: dict[str, str] = {}
    steps = None
    for path in paths:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows or "loss_bf16" not in rows[0]:
            raise ValueError(f"{path}: expected an examples/tiny_lm_nvfp4_eval.py --csv file "
                             "(a loss_bf16 column)")
        s, new = [int(r["step"]) for r in rows], False
        if steps is not None and s != steps:
            raise ValueError(f"{path}: steps {s[0]}..{s[-1]} differ from {paths[0]}'s")
        steps = s
        for col in rows[0]:
            if not col.startswith("loss_"):
                continue
            v = [float(r[col]) for r in rows]
            name = col[len("loss_"):]
            if name in curves and curves[name] != v:
                bad = next(i for i, (a, b) in enumerate(zip(curves[name], v)) if a != b)
                raise ValueError(
                    f"{path}: {col} differs from {origin[name]}'s from step {steps[bad]} "
                    f"({v[bad]} vs {curves[name][bad]}): the runs do not reproduce each other "
                    "(other code, or GPU runs), cannot merge")
            new = new or name not in curves
            curves[name], origin[name] = v, path
        if not new:
            raise ValueError(f"{path}: adds no curve to {', '.join(paths[:paths.index(path)])} "
                             "(a rerun without --first-repeat?)")
    return curves


def judge(curves: dict[str, list[float]]) -> list[dict]:
    """One row per precision other than bf16: its gap to bf16, the band, within, rank."""
    bf16 = [k for k in curves if k == "bf16" or k.startswith("bf16_repeat")]
    if len(bf16) < 2:
        raise ValueError("a band needs the bf16 curve and at least one perturbed repeat")
    band = noise_band([curves[k] for k in bf16])
    repeat_gaps = [moving_average_gap(curves[k], curves["bf16"]) for k in bf16 if k != "bf16"]
    out = []
    for q in (k for k in curves if k not in bf16):
        gap = moving_average_gap(curves[q], curves["bf16"])
        out.append(dict(precision=q, gap=round(gap, 4), band=round(band, 4),
                        within=gap <= band,
                        rank=1 + sum(g < gap for g in repeat_gaps)
                        + 0.5 * sum(g == gap for g in repeat_gaps),
                        of=len(repeat_gaps) + 1, bf16_curves=len(bf16),
                        repeat_gaps=repeat_gaps))
    return out


def parse_seed(text: str) -> tuple[int, list[str]]:
    seed, sep, files = text.partition("=")
    if not sep or not files:
        raise argparse.ArgumentTypeError(f"--seed {text!r}: expected SEED=a.csv[,b.csv...]")
    try:
        seed, files = int(seed), [p for p in files.split(",") if p]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed {text!r}: SEED must be an integer") from None
    if not files:
        raise argparse.ArgumentTypeError(f"--seed {text!r}: no file")
    return seed, files


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    seeds = list(dict.fromkeys(r["seed"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(seeds)), 4))
    marks = {"fp8_block": ("o", "C0"), "mxfp8": ("s", "C1")}
    for i, seed in enumerate(seeds):
        mine = [r for r in rows if r["seed"] == seed]
        ax.scatter([i] * len(mine[0]["repeat_gaps"]), mine[0]["repeat_gaps"], color="gray",
                   marker="_", s=120, label="bf16 repeat vs bf16" if i == 0 else None)
        ax.hlines(mine[0]["band"], i - 0.35, i + 0.35, color="k", lw=1.2,
                  label="band (largest bf16-bf16 gap)" if i == 0 else None)
        for j, r in enumerate(mine):
            m, c = marks.get(r["precision"], ("^", f"C{j + 2}"))
            ax.scatter([i + 0.12 * (j + 1)], [r["gap"]], marker=m, color=c,
                       label=r["precision"] if i == 0 else None)
    ax.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
    ax.set_ylabel("largest 10-step moving-average gap to bf16")
    ax.set_title("tiny MoE LM: precisions against the bf16 noise band", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=parse_seed, action="append", required=True,
                    metavar="SEED=a.csv[,b.csv]", help="one seed's runs (repeat per seed)")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    seeds = [seed for seed, _ in args.seed]
    if len(set(seeds)) != len(seeds):
        ap.error(f"--seed: a seed given twice in {seeds} (list all of its files in one --seed)")
    rows = []
    for seed, paths in args.seed:
        verdicts = judge(load_seed(paths))
        if not verdicts:
            print(f"seed {seed}: no precision besides bf16 in {paths}: nothing to judge",
                  file=sys.stderr)
            return 2
        rows += [dict(seed=seed, **r) for r in verdicts]
    print("| seed | precision | gap to bf16 | band | within | rank among the repeats | bf16 curves |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['precision']} | {r['gap']:.4f} | {r['band']:.4f} | "
              f"{'yes' if r['within'] else 'NO'} | {r['rank']:g} of {r['of']} | "
              f"{r['bf16_curves']} |")
    for q in dict.fromkeys(r["precision"] for r in rows):
        mine = [r for r in rows if r["precision"] == q]
        print(f"{q}: within the band at {sum(r['within'] for r in mine)} of {len(mine)} seeds; "
              f"ranks {[r['rank'] for r in mine]} (of {[r['of'] for r in mine]}; "
              f"{sum(r['rank'] for r in mine) / len(mine):.2f} on average, "
              f"{sum((r['of'] + 1) / 2 for r in mine) / len(mine):.2f} for noise)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lm_noise_band.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, os.path.join(args.out, "lm_noise_band.png"))
    return 0 if all(r["within"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

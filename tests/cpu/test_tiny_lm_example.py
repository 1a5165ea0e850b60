"""examples/tiny_lm_nvfp4_eval.py on CPU (2 gloo ranks, reference backend), shortened.

The example trains a tiny MoE language model on a Markov chain and evaluates its held-out loss
with bf16 and with NVFP4 experts. Checked here: training lowers the loss from its start
(ln(vocab) = 4.85) towards the chain's entropy, every requested precision trains (fp8_block
here), the NVFP4 held-out loss stays within the example's 2% bound of the bf16 one, the CSV
holds one row per step and the JSON the figures. The full runs (300 steps, the bf16 noise band
from perturbed repeats) are in BENCHMARKS.md.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_lm_trains_and_nvfp4_eval_stays_within_bound(tmp_path):
    out_csv, out_json = tmp_path / "losses.csv", tmp_path / "res.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "tiny_lm_nvfp4_eval.py"),
         "--steps", "40", "--layers", "1", "--eval-batches", "4",
         "--train-precisions", "bf16,fp8_block", "--csv", str(out_csv), "--json", str(out_json)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "PASS: nvfp4 held-out loss" in proc.stdout
    rows = list(csv.DictReader(open(out_csv)))
    assert [int(r["step"]) for r in rows] == list(range(1, 41))
    assert set(rows[0]) == {"step", "loss_bf16", "loss_fp8_block"}
    res = json.load(open(out_json))
    start = math.log(128)
    for name in ("loss_bf16", "loss_fp8_block"):
        last = sum(float(r[name]) for r in rows[-5:]) / 5
        assert res["entropy"] < last < 0.6 * start, (name, last)
    assert res["loss_bf16"] > res["entropy"] and abs(res["increase"]) <= 0.02, res
    assert res["backend"] == "reference" and res["world"] == 2


def _losses(tmp_path, name, *extra):
    path = tmp_path / f"{name}.csv"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "tiny_lm_nvfp4_eval.py"),
         "--steps", "12", "--layers", "1", "--eval-batches", "1", "--repeat-perturb", "1e-3",
         "--csv", str(path), *extra], capture_output=True, text=True, timeout=600, cwd=REPO)
    # no training precision but bf16, so only the 2 % NVFP4 bound can fail a 12-step run
    assert proc.returncode == 0 or "FAIL: nvfp4" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-4000:])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: [r[k] for r in rows] for k in rows[0] if k != "step"}


def test_later_repeats_alone_reproduce_the_full_runs_columns(tmp_path):
    """--first-repeat 1 trains repeat 2 alone, to the CSV's last digit as the run with two
    repeats does, so benchmarks/lm_noise_band.py can merge a seed's later repeats into its
    first run."""
    full = _losses(tmp_path, "full", "--repeats", "2")
    later = _losses(tmp_path, "later", "--repeats", "1", "--first-repeat", "1")
    assert set(full) == {"loss_bf16", "loss_bf16_repeat1", "loss_bf16_repeat2"}
    assert set(later) == {"loss_bf16", "loss_bf16_repeat2"}
    assert later["loss_bf16"] == full["loss_bf16"]
    assert later["loss_bf16_repeat2"] == full["loss_bf16_repeat2"]
    assert later["loss_bf16_repeat2"] != full["loss_bf16_repeat1"]

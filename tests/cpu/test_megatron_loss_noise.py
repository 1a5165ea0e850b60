"""benchmarks/megatron_loss_noise.py: dist_moe vs alltoall loss agreement against the noise band
of two same-seed alltoall runs."""

from __future__ import annotations

import csv
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))
import megatron_loss_noise as mln  # noqa: E402


def _write(path, a2a, dm):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss_alltoall", "tokens_per_s_alltoall", "loss_dist_moe",
                    "tokens_per_s_dist_moe"])
        for i, (a, d) in enumerate(zip(a2a, dm)):
            w.writerow([i, a, 1.0, d, 1.0])


def _curve(n, offset=0.0, wiggle=0.0):
    return [10.0 / (1 + 0.05 * i) + offset + (wiggle if i % 2 else -wiggle) for i in range(n)]


def test_moving_average_and_windows():
    assert mln.moving_average([1.0, 3.0, 5.0], width=2) == [1.0, 2.0, 4.0]
    assert mln.default_windows(300) == [(0, 20), (20, 60), (60, 120), (120, 200), (200, 300)]
    assert mln.default_windows(50) == [(0, 20), (20, 50)]


def test_within_noise_when_dist_moe_gap_is_below_the_alltoall_gap(tmp_path):
    _write(tmp_path / "a.csv", _curve(130), _curve(130, 0.01))
    _write(tmp_path / "b.csv", _curve(130, 0.05), _curve(130, 0.04))
    assert mln.main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--out",
                     str(tmp_path / "o")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "o" / "loss_noise.csv")))
    kinds = {(r["a"], r["b"]): r["kind"] for r in rows}
    assert kinds[("alltoall#0", "alltoall#1")] == "noise"
    assert kinds[("alltoall#0", "dist_moe#0")] == "dist_moe_vs_alltoall"
    assert kinds[("dist_moe#0", "dist_moe#1")] == "dist_moe_noise"


def test_outside_noise_when_dist_moe_drifts(tmp_path):
    _write(tmp_path / "a.csv", _curve(130), _curve(130, 0.5))
    _write(tmp_path / "b.csv", _curve(130, 0.01), _curve(130, 0.6))
    assert mln.main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--out",
                     str(tmp_path / "o")]) == 1


def test_one_run_uses_the_mean_difference(tmp_path):
    _write(tmp_path / "a.csv", _curve(60), _curve(60, 0.001))
    assert mln.main([str(tmp_path / "a.csv"), "--out", str(tmp_path / "o")]) == 0
    _write(tmp_path / "b.csv", _curve(60), _curve(60, 1.0))
    assert mln.main([str(tmp_path / "b.csv"), "--out", str(tmp_path / "o")]) == 1


def test_rejects_a_csv_without_both_curves(tmp_path):
    (tmp_path / "x.csv").write_text("step,loss\n0,1.0\n")
    with pytest.raises(ValueError, match="loss_alltoall and loss_dist_moe"):
        mln.main([str(tmp_path / "x.csv")])


def _write_repeats(path, a2a, dm, a2a_r, dm_r):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss_alltoall", "loss_alltoall_repeat", "loss_dist_moe",
                    "loss_dist_moe_repeat"])
        for i, row in enumerate(zip(a2a, a2a_r, dm, dm_r)):
            w.writerow([i, *row])


def test_group_means_flag_a_systematic_offset_the_pairs_miss(tmp_path):
    """One dist_moe curve inside the alltoall band passes the pairwise check, but when the
    dist_moe group sits above the alltoall group by more than either group's spread, the
    group-mean verdict fails."""
    # alltoall at +0 and +0.02, dist_moe at +0.01 and +0.30: dist_moe's spread covers the gap
    _write_repeats(tmp_path / "a.csv", _curve(130), _curve(130, 0.01), _curve(130, 0.02),
                   _curve(130, 0.30))
    assert mln.main([str(tmp_path / "a.csv"), "--out", str(tmp_path / "o")]) == 0
    # alltoall at +0 and +0.10, dist_moe at +0.16 and +0.17: the closest pair (0.06) is inside
    # the alltoall band (0.10), but the groups sit 0.115 apart, more than either spread
    _write_repeats(tmp_path / "b.csv", _curve(130), _curve(130, 0.16), _curve(130, 0.10),
                   _curve(130, 0.17))
    assert mln.main([str(tmp_path / "b.csv"), "--out", str(tmp_path / "o")]) == 1
    ok, _ = mln.verdict(mln.compare(mln.load_curves([str(tmp_path / "b.csv")]), [(0, 130)]))
    assert ok   # the pairwise check alone passes
    groups = mln.group_means(mln.load_curves([str(tmp_path / "b.csv")]), [(0, 130)])
    assert groups[0]["diff"] == pytest.approx(0.115, abs=1e-4)
    assert groups[0]["spread_alltoall"] == pytest.approx(0.10, abs=1e-4)
    assert groups[0]["spread_dist_moe"] == pytest.approx(0.01, abs=1e-4)
    rows = list(csv.DictReader(open(tmp_path / "o" / "loss_noise.csv")))
    kinds = {(r["a"], r["b"]): r["kind"] for r in rows}
    assert kinds[("dist_moe#0", "dist_moe#0r")] == "dist_moe_noise"


def test_an_fp8_run_judges_its_dist_moe_curve_against_every_bf16_curve(tmp_path):
    """A --fp8-recipe CSV: the bf16 dist_moe curve joins the alltoall curves in the reference
    group (its gaps to them count as noise, and it widens the group spread), and the fp8
    dist_moe curve is judged against that band."""
    path = tmp_path / "fp8.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss_alltoall", "loss_alltoall_repeat", "loss_dist_moe",
                    "loss_dist_moe_bf16"])
        for i, row in enumerate(zip(_curve(130), _curve(130, 0.01), _curve(130, 0.03),
                                    _curve(130, 0.05))):
            w.writerow([i, *row])
    curves = mln.load_curves([str(path)])
    assert set(curves) == {"alltoall#0", "alltoall#0r", "dist_moe#0", "bf16_dist_moe#0"}
    kinds = {(r["a"], r["b"]): r["kind"] for r in mln.compare(curves, [(0, 130)])}
    assert kinds[("alltoall#0", "bf16_dist_moe#0")] == "noise"
    assert kinds[("dist_moe#0", "bf16_dist_moe#0")] == "dist_moe_vs_alltoall"
    g = mln.group_means(curves, [(0, 130)])[0]
    assert g["n_alltoall"] == 3 and g["spread_alltoall"] == pytest.approx(0.05, abs=1e-4)
    # fp8 at +0.03 sits inside the bf16 band [0, 0.05]: within noise on both verdicts
    assert mln.main([str(path), "--out", str(tmp_path / "o")]) == 0

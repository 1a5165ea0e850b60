"""benchmarks/lm_noise_band.py: one seed's tiny-LM runs merged by column (refused where they
disagree), the bf16 band over every pair of bf16 curves, each precision's verdict and rank."""

from __future__ import annotations

import csv
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))
import lm_noise_band as lnb  # noqa: E402


def _curve(n, offset=0.0):
    return [2.0 / (1 + 0.05 * i) + offset for i in range(n)]


def _write(path, cols: dict):
    names = list(cols)
    n = len(cols[names[0]])
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + [f"loss_{k}" for k in names])
        for i in range(n):
            w.writerow([i + 1] + [f"{cols[k][i]:.6f}" for k in names])


def test_merge_band_rank_and_verdicts(tmp_path):
    n = 60
    base = _curve(n)
    _write(tmp_path / "first.csv", dict(bf16=base, bf16_repeat1=_curve(n, 0.01),
                                        fp8_block=_curve(n, 0.005), mxfp8=_curve(n, 0.05)))
    # the same seed once more: repeats 2 and 3, the base curve reproduced
    _write(tmp_path / "more.csv", dict(bf16=base, bf16_repeat2=_curve(n, -0.02),
                                       bf16_repeat3=_curve(n, 0.03)))
    curves = lnb.load_seed([str(tmp_path / "first.csv"), str(tmp_path / "more.csv")])
    assert sorted(curves) == ["bf16", "bf16_repeat1", "bf16_repeat2", "bf16_repeat3",
                              "fp8_block", "mxfp8"]
    rows = {r["precision"]: r for r in lnb.judge(curves)}
    # band: the widest bf16 pair, repeat2 (-0.02) against repeat3 (+0.03)
    assert rows["fp8_block"]["band"] == pytest.approx(0.05, abs=1e-5)
    assert rows["fp8_block"]["within"] and rows["fp8_block"]["rank"] == 1
    assert rows["mxfp8"]["within"]          # 0.05 <= 0.05
    assert rows["mxfp8"]["rank"] == 4 and rows["mxfp8"]["of"] == 4
    assert rows["mxfp8"]["bf16_curves"] == 4
    out = tmp_path / "o"
    assert lnb.main(["--seed", f"11={tmp_path / 'first.csv'},{tmp_path / 'more.csv'}",
                     "--out", str(out)]) == 0
    assert (out / "lm_noise_band.csv").is_file()
    # one repeat only: mxfp8 (0.05) outside the band (0.01)
    assert lnb.main(["--seed", f"11={tmp_path / 'first.csv'}", "--out", str(out)]) == 1


def test_runs_of_different_code_are_not_merged(tmp_path):
    n = 30
    _write(tmp_path / "a.csv", dict(bf16=_curve(n), bf16_repeat1=_curve(n, 0.01)))
    other = _curve(n)
    other[17] += 1e-6
    _write(tmp_path / "b.csv", dict(bf16=other, bf16_repeat2=_curve(n, 0.02)))
    with pytest.raises(ValueError, match="step 18"):
        lnb.load_seed([str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])


def test_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        lnb.main(["--seed", "eleven=a.csv"])
    with pytest.raises(SystemExit):
        lnb.main(["--seed", "11"])
    _write(tmp_path / "lone.csv", dict(bf16=_curve(20), mxfp8=_curve(20, 0.1)))
    with pytest.raises(ValueError, match="repeat"):
        lnb.main(["--seed", f"1={tmp_path / 'lone.csv'}", "--out", str(tmp_path / "o")])


def test_refusals_and_ties(tmp_path):
    n = 30
    base = _curve(n)
    _write(tmp_path / "a.csv", dict(bf16=base, bf16_repeat1=_curve(n, 0.02),
                                    mxfp8=_curve(n, 0.02)))
    # a rerun that adds nothing (no --first-repeat) is refused, not merged silently
    with pytest.raises(ValueError, match="adds no curve"):
        lnb.load_seed([str(tmp_path / "a.csv"), str(tmp_path / "a.csv")])
    # a tie with a repeat's gap counts half
    (r,) = lnb.judge(lnb.load_seed([str(tmp_path / "a.csv")]))
    assert r["rank"] == 1.5 and r["of"] == 2 and r["within"]
    # bf16 runs alone give no verdict: exit 2, not a vacuous pass
    _write(tmp_path / "b.csv", dict(bf16=base, bf16_repeat1=_curve(n, 0.01)))
    assert lnb.main(["--seed", f"3={tmp_path / 'b.csv'}", "--out", str(tmp_path / "o")]) == 2
    with pytest.raises(SystemExit):     # one seed given twice
        lnb.main(["--seed", f"3={tmp_path / 'a.csv'}", "--seed", f"3={tmp_path / 'b.csv'}"])
    with pytest.raises(SystemExit):
        lnb.main(["--seed", "3=,"])

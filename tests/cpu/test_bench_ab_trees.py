"""benchmarks/ab_trees.py: two trees' bench_layer runs paired round by round, each round's
difference per (case, path, mode) and their median; mismatched round counts refused."""

from __future__ import annotations

import csv
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))
import ab_trees  # noqa: E402

FIELDS = ["commit", "gpu", "case", "precision", "path", "mode", "ms"]


def _run(folder, commit, times: dict):
    os.makedirs(folder)
    with open(os.path.join(folder, "bench_layer.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for (path, mode), ms in times.items():
            w.writerow(dict(commit=commit, gpu="GPU", case="guide", precision="bf16", path=path,
                            mode=mode, ms=ms))
    return folder


def test_rounds_paired_and_summarised(tmp_path):
    this = [_run(tmp_path / f"t{i}", "new", {("a", "fwd"): 2.0 + d, ("b", "fwd"): 1.0})
            for i, d in enumerate((0.0, 0.1, 0.3))]
    base = [_run(tmp_path / f"b{i}", "old", {("a", "fwd"): 2.1, ("b", "fwd"): 1.0,
                                              ("c", "fwd"): 5.0})
            for i in range(3)]
    assert ab_trees.main(["--this", *map(str, this), "--base", *map(str, base),
                          "--out", str(tmp_path / "o")]) == 0
    with open(tmp_path / "o" / "ab_trees.csv") as f:
        rows = {r["path"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"a", "b"}          # "c" ran on one tree only
    a = rows["a"]
    assert (a["commit"], a["base_commit"], a["rounds"]) == ("new", "old", "3")
    assert float(a["diff_ms"]) == pytest.approx(0.0)          # median of -0.1, 0.0, +0.2
    assert float(a["diff_min_ms"]) == pytest.approx(-0.1)
    assert float(a["diff_max_ms"]) == pytest.approx(0.2)
    assert float(rows["b"]["diff_ms"]) == 0.0


def test_unequal_rounds_and_missing_runs_refused(tmp_path):
    t = _run(tmp_path / "t", "new", {("a", "fwd"): 1.0})
    with pytest.raises(SystemExit, match="one per round"):
        ab_trees.main(["--this", str(t), str(t), "--base", str(t), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no bench_layer.csv"):
        ab_trees.main(["--this", str(t), "--base", str(tmp_path / "nothing"),
                       "--out", str(tmp_path)])


def test_a_folder_holding_two_runs_is_refused(tmp_path):
    t = _run(tmp_path / "t", "new", {("a", "fwd"): 1.0})
    with open(t / "bench_layer.csv", "a", newline="") as f:
        csv.DictWriter(f, FIELDS).writerow(dict(commit="new", gpu="GPU", case="guide",
                                               precision="bf16", path="a", mode="fwd", ms=2.0))
    with pytest.raises(SystemExit, match="appears twice"):
        ab_trees.main(["--this", str(t), "--base", str(t), "--out", str(tmp_path)])

"""benchmarks/compare_candidates.py on synthetic bench_layer.csv files (the GPU session's layout)."""

from __future__ import annotations

import csv
import importlib.util
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIELDS = ["commit", "gpu", "ep", "case", "T", "D", "F", "K", "E_local", "imbalance", "path",
          "mode", "ms", "ms_min", "ms_max", "useful_tflops", "ratio_to_baseline", "note"]


def _load():
    spec = importlib.util.spec_from_file_location("compare_candidates",
                                                  REPO / "benchmarks" / "compare_candidates.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(d, rows):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "bench_layer.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for path, mode, ms in rows:
            w.writerow(dict(commit="abc", gpu="H200", ep=2, case="guide", T=2048, D=7168, F=3072,
                            K=6, E_local=6, imbalance=1.0, path=path, mode=mode, ms=ms,
                            ms_min=ms - 0.02, ms_max=ms + 0.02, useful_tflops=500,
                            ratio_to_baseline=1.4, note=""))


def test_changes_against_the_same_call_defaults(tmp_path):
    cc = _load()
    _write(tmp_path / "cand_default", [("dist_moe", "fwdbwd", 9.5), ("dist_moe_staged", "fwdbwd", 9.7)])
    _write(tmp_path / "cand_DIST_MOE_ROUTING", [("dist_moe", "fwdbwd", 9.4),
                                                ("dist_moe_staged", "fwdbwd", 9.6)])
    _write(tmp_path / "cand_all", [("dist_moe", "fwdbwd", 8.9)])
    _write(tmp_path, [("dist_moe", "fwdbwd", 99.0)])     # ignored: cand_default wins
    rows = cc.compare(str(tmp_path))
    got = {(r["candidate"], r["path"]): r for r in rows}
    assert got[("DIST_MOE_ROUTING", "dist_moe")]["change_ms"] == -0.1
    assert got[("DIST_MOE_ROUTING", "dist_moe")]["predicted_ms"] == "-0.15..-0.08"
    assert got[("DIST_MOE_ROUTING", "dist_moe_staged")]["predicted_ms"] == ""
    assert got[("all", "dist_moe")]["change_ms"] == -0.6
    assert ("default", "dist_moe") not in got
    assert cc.main([str(tmp_path)]) == 0
    assert (tmp_path / "candidates.csv").exists()

"""benchmarks/common.py: the dense matmul behind the benchmarks' floors (runs without a GPU;
the Config overrides are tested with ab_layer, the timing on the GPU machine)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import common  # noqa: E402


def test_dense_mm_setup_is_checked_against_fp32_and_counts_its_flops():
    call, flops, err = common.dense_mm_setup("cpu", n=128)
    assert flops == 2 * 128 ** 3
    assert 0 < err < 1e-2            # bf16 rounding, not a wrong product
    call()                           # a second call writes the same preallocated output


def test_dense_mm_peak_refuses_a_wrong_product(monkeypatch):
    monkeypatch.setattr(common, "dense_mm_setup", lambda device, n: (lambda: None, 1.0, 0.5))
    with pytest.raises(RuntimeError, match="relative error 5.00e-01"):
        common.dense_mm_peak("cpu", n=8)


def test_append_csv_fields_keeps_rows_under_their_columns(tmp_path):
    import csv
    path = str(tmp_path / "b.csv")
    common.append_csv_fields(path, [dict(a=1, b=2)], ["a", "b"])
    common.append_csv_fields(path, [dict(a=3, b=4)], ["a", "b"])
    # a newer version of the benchmark writes one column more, in the middle
    common.append_csv_fields(path, [dict(a=5, t="x", b=6)], ["a", "t", "b"])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["a"], r["b"], r["t"]) for r in rows] == [("1", "2", ""), ("3", "4", ""),
                                                        ("5", "6", "x")]

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

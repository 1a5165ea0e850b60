"""benchmarks/bench_decode.py: the weight-read floors it reports (the timing runs on the GPU)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_decode as B  # noqa: E402


def test_weight_bytes_at_the_guide_shape():
    E, D, F = 6, 7168, 3072
    bf16 = B.weight_read_bytes("bf16", E, D, F)
    assert bf16 == 6 * 3 * 3072 * 7168 * 2                     # 793 MB, the figure
    assert round(bf16 / 1e6) == 793
    assert B.weight_read_bytes("mxfp8", E, D, F) == bf16       # its GEMMs read bf16 copies
    assert B.weight_read_bytes("fp8_block", E, D, F) == bf16 // 2 + bf16 // 2 * 4 // 16384
    nv = B.weight_read_bytes("nvfp4", E, D, F)
    assert 3.9 < bf16 / nv < 4.0                               # E2M1 + one E4M3 per 16 x 16
    assert B.floor_us("bf16", E, D, F, 4000) == pytest.approx(198.2, abs=0.1)
    with pytest.raises(ValueError, match="int4"):
        B.weight_read_bytes("int4", E, D, F)

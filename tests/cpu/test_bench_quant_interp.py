"""benchmarks/bench_quant.py under Triton's CPU interpreter: every case it times passes its
own bit-exactness check at small shapes (so a GPU session spends no time on a benchmark whose
checks are wrong), and its --tiles / --fp8-tiles arguments accept exactly the tiles the
launchers do."""

from __future__ import annotations

import os
import sys

import pytest

from megatron_dist_moe import testing as tt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "children",
                     "bench_quant_cases.py")

CASES = [f"mxfp8:{k}" for k in ("quantize_x", "quantize_g3", "quantize_gh1", "quantize_h2",
                                "swiglu_quant", "dequantize_rows", "dequantize_cols")] + [
    f"fp8_block:{k}" for k in ("quantize_x", "quantize_gh1", "quantize_h2_cols",
                               "swiglu_quant")]


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    return tt.run_child_checks([CHILD], timeout_s=900, paths=(BENCH,))[0]


@pytest.mark.parametrize("case", CASES)
def test_every_case_passes_its_check(results, case):
    r = results.get(f"{case}:default")
    assert r is not None, f"{case}: no result"
    assert r["equal"] and r["nbytes"] > 0, r


@pytest.mark.parametrize("tile", ["32x32x1", "128x32x8"])
def test_mxfp8_quantize_tiles_pass_the_check(results, tile):
    for k in ("quantize_x", "quantize_g3", "quantize_gh1", "quantize_h2"):
        r = results.get(f"mxfp8:{k}:{tile}")
        assert r is not None and r["equal"], (k, r)


@pytest.mark.parametrize("tile", ["32x2", "64x4"])
def test_fp8_quantize_tiles_pass_the_check(results, tile):
    for k in ("quantize_x", "quantize_gh1", "quantize_h2_cols"):
        r = results.get(f"fp8_block:{k}:{tile}")
        assert r is not None and r["equal"], (k, r)


def test_tiles_argument():
    sys.path.insert(0, BENCH)
    try:
        import bench_quant as B
        from megatron_dist_moe.kernels import quant_fp8 as KF, quant_mxfp8 as KM
        mx = ("--tiles", KM.QUANT_TILES, "RxCxW")
        assert B.parse_tiles("", *mx) == [None]
        assert B.parse_tiles("all", *mx) == list(KM.QUANT_TILES)
        assert B.parse_tiles("32x32x1,128x32x4", *mx) == [(32, 32, 1), (128, 32, 4)]
        with pytest.raises(SystemExit, match="--tiles"):
            B.parse_tiles("16x32x1", *mx)
        f8 = ("--fp8-tiles", KF.QUANT_TILES, "CxW")
        assert B.parse_tiles("all", *f8) == list(KF.QUANT_TILES)
        assert B.parse_tiles("32x2,64x4", *f8) == [(32, 2), (64, 4)]
        for bad in ("16x1", "32x2x1", "x", "cuda"):   # "cuda" only where it is a name
            with pytest.raises(SystemExit, match="--fp8-tiles"):
                B.parse_tiles(bad, *f8)
        named = (*f8, ("cuda",))   # the CUDA C++ quantizer beside the Triton tiles
        assert B.parse_tiles("all", *named) == list(KF.QUANT_TILES) + ["cuda"]
        assert B.parse_tiles("cuda,32x2", *named) == ["cuda", (32, 2)]
    finally:
        sys.path.remove(BENCH)

"""Where fp8_block's CUTLASS GEMMs enter the pipeline (Execution.fp8_gemm = "cutlass"), checked
on CPU with a stand-in for the CUTLASS unit: our Triton FP8 GEMM with the "store" epilogue
under the interpreter, which has the unit's contract (kernels/grouped_gemm_sm90.py:
GroupedFp8FpropSm90). The unit itself runs in tests/gpu/test_grouped_gemm_sm90_gpu.py and
tests/fp8_kernel_checks.py (check_fp8_fprop_cutlass).

    W13 FPROP   the unit stores h1 (the Triton kernel's "store" epilogue otherwise)
    W2 DGRAD    the GEMM (the unit, or Triton's "store" epilogue on the Triton engine) stores
                u = g3 W2 into h2's region, then (fp8_quant "triton", the interpreter's)
                quant_fp8.swiglu_bwd_rows writes grad_h1, h2 and the score parts, and the
                quantizer their bundles: bitwise alike on both engines, and close to the fused
                epilogue ("swiglu_bwd", u in fp32) followed by the quantizer (the CUDA pass of
                fp8_quant "cuda" is checked on the GPU: tests/fp8_kernel_checks.py)
    W13 DGRAD   the unit stores dense rows into the dead g3 buffer, rows.scatter_rows copies
                them to the owners' addresses; bitwise the scattering epilogue's rows
"""

from __future__ import annotations

import os

import pytest

from megatron_dist_moe import testing as tt

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    return tt.run_child_checks([os.path.join(HERE, "children", "fp8_cutlass_wiring.py")],
                               timeout_s=900)[0]


@pytest.mark.parametrize("scored", [False, True])
def test_cutlass_engine_routes_the_w13_fprop_and_splits_the_w2_dgrad(results, scored):
    tt.assert_child_check(results, f"wiring_scored={scored}")
    # the W13 FPROP, the W2 DGRAD, the W13 DGRAD
    assert results[f"wiring_scored={scored}"]["unit_calls"] == 3

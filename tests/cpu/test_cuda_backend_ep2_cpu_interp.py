"""The CUDA backend at EP=2 on CPU: two ranks as two threads of one process, Triton interpreter.

Both ranks live in one address space, so a "peer pointer" is just the other rank's buffer
(tests/cpu/cuda_cpu_harness.py: symmetric memory and device barriers stood in for by the
thread group, interpreted kernels one at a time). What this adds to
test_cuda_backend_cpu_interp.py (one rank): routing tables over two sources, peer gathers, W2
stores into the other rank's combine buffer, route input gradients returned into the other
rank's dispatch buffer, weight gradients landing on the owner,
and the worst-rank save/replay rule with different row counts per rank (one rank receives most
routes). Still not covered here: real concurrency, NVLink, TMA hardware, CUDA graphs (GPU tests).

Each variant runs three layers forward (keep / replay / replay on the worst rank) and backward
in reverse order on both ranks; every result must be within the bf16 bound of the fp64 oracle.
"""

from __future__ import annotations

import os

import pytest

from megatron_dist_moe import testing as tt

HERE = os.path.dirname(os.path.abspath(__file__))
BF16_TOL = 2e-2

CHILD = os.path.join(HERE, "children", "cuda_backend_ep2.py")


NAMES = ["torch_gemm,torch_tables", "triton_gemm,standard,clamped",
         "triton_gemm,staged,saved_routes", "expert_score_grads,triton_gemm,standard",
         "torch_gemm,torch_tables,saved_routes"]


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    out, stdout = tt.run_child_checks([CHILD], timeout_s=600, paths=(HERE,))
    return dict(out, stdout=stdout)


@pytest.mark.parametrize("routing", ["torch", "triton"])
def test_a_rank_with_bad_input_makes_its_peer_trap_instead_of_hang(results, routing):
    """Rank 1's validation fails: it meets rank 0 at the first device barrier with T = -1 in its
    header and returns (ops then raises its own error); rank 0's routing check traps (in the
    interpreter: prints the trap message, then raises) naming rank 1 instead of waiting."""
    r = results.get(f"rejected,{routing}_routing")
    assert r is not None, "no result"
    assert r["rank1"] == {"returned": True}, r["rank1"]
    assert "raised" in r["rank0"], f"rank 0 did not trap: {r['rank0']}"
    assert "a peer rank rejected its inputs" in results["stdout"]


@pytest.mark.parametrize("routing", ["torch", "triton"])
def test_ranks_with_different_slot_selections_trap(results, routing):
    """Training forwards after different select_activation_slot calls: the schedule words in
    the routing headers differ (rank 0 publishes slot 0 x (3 + 1) + 2 layers = 2, rank 1
    publishes 1), and both ranks' routing checks trap naming the peer's word before any
    planner decides."""
    r = results.get(f"schedule,{routing}_routing")
    assert r is not None, "no result"
    for rank in (0, 1):
        assert "raised" in r[f"rank{rank}"], f"rank {rank} did not trap: {r[f'rank{rank}']}"
    assert "EP ranks differ in grad mode or in select_activation_slot" in results["stdout"]


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_match_oracle(results, name):
    r = results.get(name)
    assert r is not None, f"{name}: no result"
    assert r["ok"], f"{name}: {r['error']}"
    for rank, layers in enumerate(r["errors"]):
        for layer, errs in enumerate(layers):
            for k, e in errs.items():
                assert e < BF16_TOL, f"{name}: rank {rank} layer {layer} {k} error {e:.3e}"
    assert all(r["cursors_back"]), "slot cursors did not return to their start"
    # the worst-rank rule: both ranks take the same decisions; keep, then replay
    assert r["needs"][0] == r["needs"][1] == [False, True, True], r["needs"]

"""One-launch bookkeeping kernels (kernels/bookkeeping.py) under Triton's CPU interpreter, bit-equal
to the torch bookkeeping built from the shared planner functions (backends/cuda/bookkeeping.py).

A sequence of layer forwards (two slots, changing per-rank row counts, a capacity that makes
some layers replay) then their backwards in reverse order runs on twin planner states, one per
implementation; every address, row count, flag, snapshot and planner state must be equal after
every call, the cursors must return to their start and the Triton version's layout guard must
stay silent. Runs in a child process (children/bookkeeping_twins.py) with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import pytest

from megatron_dist_moe import testing as tt

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "children",
                     "bookkeeping_twins.py")


NAMES = ["ep2_rank0_tight", "ep2_rank1_tight", "ep4_roomy", "ep1_tight", "fp8_block_ep2_tight",
         "fp8_block_ep1_roomy"]


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    return tt.run_child_checks([CHILD])[0]


@pytest.mark.parametrize("name", NAMES)
def test_bookkeeping_kernels_match_torch(results, name):
    res = results.get(name)
    assert res is not None, f"{name}: no result"
    assert res["ok"], f"{name}: {res['error']}\n{res['trace']}"


def test_tight_budgets_exercise_both_decisions(results):
    """The comparison covers both branches: some layers keep their state, some replay."""
    for names in (("ep2_rank0_tight", "ep2_rank1_tight", "ep1_tight"), ("fp8_block_ep2_tight",)):
        needs = [n for name in names for n in results[name].get("needs", [])]
        assert any(needs) and not all(needs), (names, needs)

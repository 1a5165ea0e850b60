"""benchmarks/bench_nvlink_rows.py's persistent row-copy kernel under Triton's CPU interpreter:
any number of programs copies every row from its source address to its destination address
(the pull and push tables of the GPU benchmark are just two such address tables)."""

from __future__ import annotations

import os

import pytest

from megatron_dist_moe import testing as tt

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "benchmarks")

CHILD = r'''
import json, torch
import bench_nvlink_rows as B

R = 10
g = torch.Generator().manual_seed(0)
src = torch.randn(R, B.D, generator=g).to(torch.bfloat16)
perm = torch.randperm(R, generator=g)
rb = B.D * 2
for programs in (1, 3, 16):
    dst = torch.zeros(R, B.D, dtype=torch.bfloat16)
    # "pull": dst row i <- src row perm[i];  "push": dst row perm[i] <- src row i
    B.copy_rows(src.data_ptr() + perm * rb, dst.data_ptr() + torch.arange(R) * rb, programs)
    ok_pull = torch.equal(dst, src[perm])
    dst.zero_()
    B.copy_rows(src.data_ptr() + torch.arange(R) * rb, dst.data_ptr() + perm * rb, programs)
    ok_push = torch.equal(dst[perm], src)
    print("RESULT " + json.dumps(dict(name=f"P{programs}", pull=ok_pull, push=ok_push)), flush=True)
'''


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    return tt.run_child_checks(["-c", CHILD], timeout_s=600, paths=(BENCH,))[0]


@pytest.mark.parametrize("name", ["P1", "P3", "P16"])
def test_every_row_lands_for_any_grid(results, name):
    assert results[name]["pull"] and results[name]["push"], results[name]

"""benchmarks/bench_kernel_gaps.py: its kernels under Triton's CPU interpreter (the counter and
the row copy its correctness checks rely on) and the window summary."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

CHILD = r'''
import sys
sys.path.insert(0, "benchmarks")
import torch
import bench_kernel_gaps as B
c = torch.zeros(1, dtype=torch.int32)
for _ in range(3):
    B._tiny_kernel[(1,)](c)
src = torch.randn(5, 300).to(torch.bfloat16)
dst = torch.zeros_like(src)
B._copy_kernel[(5,)](src, dst, W=300, BLOCK=128)   # W not a multiple of BLOCK
assert int(c) == 3, int(c)
assert torch.equal(src, dst)
assert B.summarize([3.0, 1.0, 2.0]) == {"us": 2.0, "us_min": 1.0, "us_max": 3.0}
try:
    B.summarize([])
except ValueError:
    print("GAPS_OK")
'''


def test_gap_benchmark_kernels_count_and_copy():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0 and "GAPS_OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]

"""CUDA backend checks on 1 and 2 GPUs, launched through torchrun (the scripts also run alone).

    dist_check.py     forward + every gradient vs the fp64 oracle, graph replay, no host sync,
                      replay from the minimum slot, VMM host-backed scratch
    packing_check.py  ten layers in one slot inside one CUDA graph: gradients, planner flags,
                      cursors, for three slot budgets
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(__file__)


def _torchrun(script, nproc, *args):
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)):
        pytest.skip("needs an sm_90+ GPU")
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
           os.path.join(HERE, script), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


@pytest.mark.parametrize("nproc", [1, 2])
def test_cuda_backend_matches_oracle(nproc):
    _torchrun("dist_check.py", nproc)


@pytest.mark.parametrize("nproc", [1, 2])
def test_ten_layer_packing_in_one_graph(nproc):
    _torchrun("packing_check.py", nproc)

"""CUDA backend vs the fp64 oracle on 1 and 2 GPUs (launches tests/gpu/dist_check.py via torchrun)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(__file__)


def _capable():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.parametrize("nproc", [1, 2])
def test_cuda_backend_matches_oracle(nproc, tmp_path):
    if not _capable():
        pytest.skip("needs an sm_90+ GPU")
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-endpoint=localhost:0", "--rdzv-backend=c10d",
           os.path.join(HERE, "dist_check.py"), "--json", str(tmp_path / "r.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]

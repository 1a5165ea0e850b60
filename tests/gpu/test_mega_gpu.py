"""The Mega forward kernel on the GPU against the standard two launches
(tests/mega_kernel_checks.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mega_kernel_checks as C  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs an sm_90+ GPU")]


@pytest.mark.parametrize("name", list(C.CHECKS))
def test_mega_kernel_on_gpu(name):
    C.CHECKS[name]("cuda", big=True)
    torch.cuda.synchronize()

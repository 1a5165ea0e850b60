"""Every kernel check module (tests/kernel_checks.py) on an sm_90 GPU at the guide's shapes:
quantizers bit-exact against their torch twins, GEMMs to the summation order, the Mega forward
against the standard launches."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernel_checks as KC  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs an sm_90+ GPU")]

CHECKS = KC.all_checks()


@pytest.mark.parametrize("name", list(CHECKS))
def test_kernel_check_on_gpu(name):
    CHECKS[name]("cuda", big=True)
    torch.cuda.synchronize()

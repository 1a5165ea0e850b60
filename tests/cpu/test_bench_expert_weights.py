"""benchmarks/bench_expert_weights.py: its correctness checks on CPU (the timing needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_expert_weights as bew  # noqa: E402


def test_checks_pass_and_leave_main_grad_zero():
    torch.manual_seed(0)
    fc1, fc2, g13, g2 = bew.check_case("tiny", torch.device("cpu"))
    assert len(fc1) == 3 and g13.shape == (3, 64, 64) and g2.shape == (3, 64, 32)
    assert all((p.main_grad == 0).all() for p in fc1 + fc2)


def test_the_check_catches_a_wrong_add(monkeypatch):
    """A fused add that rounds the sum to bf16 must fail the bit comparison."""
    def rounding_add(params, grads_E):
        for p, g in zip(params, grads_E.unbind(0)):
            p.main_grad.copy_((p.main_grad + g.float()).to(torch.bfloat16).float() + 1e-3)
    monkeypatch.setattr(bew, "add_fused", rounding_add)
    with pytest.raises(SystemExit, match="differ"):
        bew.check_case("tiny", torch.device("cpu"))


def test_unknown_case_is_named():
    with pytest.raises(SystemExit):
        bew.main(["--cases", "nope"])


def test_the_check_catches_a_stack_that_copies_packed_weights(monkeypatch):
    """If the packed weights were still copied, the view check must fail."""
    from megatron_dist_moe.megatron import layer
    view = layer.stack_expert_weights
    monkeypatch.setattr(layer, "stack_expert_weights", lambda ws, *a: view(ws, *a).clone())
    with pytest.raises(SystemExit, match="not a view"):
        bew.check_case("tiny", torch.device("cpu"))

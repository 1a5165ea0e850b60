"""kernels/launch.py: when our kernels get programmatic dependent launch (DIST_MOE_PDL)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_dist_moe.kernels import launch as L  # noqa: E402


def test_pdl_args_only_when_switched_on_for_a_cuda_device(monkeypatch):
    monkeypatch.setattr(L, "PDL", False)
    assert L.pdl_args("cpu") == {} and L.pdl_args(torch.device("cuda", 0)) == {}
    monkeypatch.setattr(L, "PDL", True)
    assert L.pdl_args("cpu") == {}                       # CPU tensors: nothing to launch
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert L.pdl_args(torch.device("cuda", 0)) == {}     # the interpreter has no inline PTX
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert L.pdl_args(torch.device("cuda", 0)) == {}     # before Hopper: no griddepcontrol
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    assert L.pdl_args(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}


def test_every_kernel_of_the_package_has_the_prologue():
    """A PDL kernel that touched memory before griddepcontrol.wait could read a predecessor's
    unfinished writes: every launched kernel takes PDL and calls grid_dependency_wait first."""
    import inspect

    import triton

    from megatron_dist_moe.kernels import bookkeeping, grouped_gemm, routing, rows

    kernels = [(m.__name__, name, f) for m in (bookkeeping, grouped_gemm, routing, rows)
               for name, f in vars(m).items()
               if isinstance(f, triton.runtime.JITFunction) and name.endswith("_kernel")
               and f.__module__ == m.__name__]
    assert len(kernels) >= 20
    for mod, name, f in kernels:
        assert "PDL" in [p.name for p in f.params], f"{mod}.{name}: no PDL parameter"
        body = inspect.getsource(f.fn).split("):\n", 1)[1]
        first = next(ln.strip() for ln in body.splitlines() if ln.strip())
        assert first.startswith("grid_dependency_wait(PDL)"), f"{mod}.{name} starts with {first!r}"

"""The kernel check modules and what they share.

Each `*_kernel_checks.py` module holds CHECKS = {name: check(device, big=False)}: a kernel
against its torch twin (quantizers bit-exact, GEMMs to the summation order), on any device.
tests/cpu/test_kernel_checks_interp.py runs them in Triton's interpreter (small shapes),
tests/gpu/test_kernel_checks_gpu.py on an sm_90 GPU (big=True: the guide's shapes).
"""

from __future__ import annotations

import importlib

import torch

MODULES = ("fp8_kernel_checks", "mxfp8_kernel_checks", "nvfp4_kernel_checks",
           "mega_kernel_checks")


def all_checks(interpreter: bool = False) -> dict:
    """{"module:check": check} over MODULES (imported from this folder); interpreter=True
    leaves out each module's GPU_ONLY checks (CUDA C++ kernels)."""
    out = {}
    for m in MODULES:
        mod = importlib.import_module(m)
        skip = getattr(mod, "GPU_ONLY", ()) if interpreter else ()
        out.update({f"{m}:{n}": fn for n, fn in mod.CHECKS.items() if n not in skip})
    return out


def close(name, got, want, tol):
    """max |got - want| <= tol x max |want| (no NaN in got: an unwritten output)."""
    g, w = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(g).any(), f"{name}: NaN (unwritten?)"
    err = ((g - w).abs().max() / w.abs().max().clamp(min=1e-30)).item()
    assert err <= tol, f"{name}: max error {err:.3e} x max|ref| > {tol:.1e}"

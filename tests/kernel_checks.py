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


def scattered_rows(x: torch.Tensor, generator: torch.Generator, zero_row: int = 5):
    """(row addresses, x as read through them): x's rows placed in a shuffled copy (kept alive
    by the returned table's owner: the copy is returned too) and an int64 address per row, row
    `zero_row`'s address 0, which a gathering kernel reads as a row of zeros."""
    R, K = x.shape
    perm = torch.randperm(R, generator=generator).to(x.device)
    src = torch.empty_like(x)
    src[perm] = x
    ptrs = src.data_ptr() + perm.long() * (K * x.element_size())
    ptrs[zero_row] = 0
    xz = x.clone()
    xz[zero_row] = 0
    return ptrs, xz, src


def close(name, got, want, tol):
    """max |got - want| <= tol x max |want| (no NaN in got: an unwritten output)."""
    g, w = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(g).any(), f"{name}: NaN (unwritten?)"
    err = ((g - w).abs().max() / w.abs().max().clamp(min=1e-30)).item()
    assert err <= tol, f"{name}: max error {err:.3e} x max|ref| > {tol:.1e}"

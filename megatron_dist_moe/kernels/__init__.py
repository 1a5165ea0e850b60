"""Triton kernels, one file per kernel family, each beside a plain-torch `*_ref` twin.

Importing this package touches neither CUDA nor Triton: names resolve lazily on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "device_ptr": "grouped_gemm",
    "GroupedGemmConfig": "grouped_gemm",
    "select_config": "grouped_gemm",
    "grouped_mm_fwd": "grouped_gemm",
    "grouped_mm_dgrad": "grouped_gemm",
    "grouped_mm_wgrad": "grouped_gemm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

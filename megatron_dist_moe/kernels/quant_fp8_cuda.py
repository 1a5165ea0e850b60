"""fp8_block's rows + columns quantizer on CUDA C++ (csrc/fp8_block_quant.cu).

The contract of `quant_fp8.quantize_rows_cols` (the Triton kernel, which the CPU interpreter
runs), bit for bit: the same torch twin (quant/fp8_block.py) checks both. Where it runs: the
CUDA backend's fp8_block contexts where its library loads (`Execution.fp8_quant`). Why a second
kernel: the column bundle is a transpose, which the Triton kernel stores at ~1.2-1.6 TB/s (the
source file says how this one holds the tile).

The library builds with nvcc on first use (seconds; no CUTLASS, no torch headers) and is cached
as csrc_build says. `loads(device)` tells whether it can run here.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from ..quant.fp8_block import BLOCK, BlockScaling
from . import csrc_build
from .common import as_device_ptr, check_rows

__all__ = ["quantize_rows_cols", "loads", "load", "build_library"]

_UNIT = "fp8_block_quant"
_STATUS = {1: "bad arguments: K not a positive multiple of 128, E < 1, no output bundle, or "
              "neither / both of x and row_ptrs"}
_CUDA_ERRORS = {209: "no kernel image for this device: the library is built for sm_90a (Hopper)"}


def build_library(verbose: bool = False) -> Path:
    return csrc_build.build("dm_fp8q", csrc_build.csrc_dir(f"{_UNIT}.cu"), (_UNIT,), (),
                            what="fp8_block quantizer", verbose=verbose)


@functools.lru_cache(maxsize=1)
def _run_fn():
    fn = ctypes.CDLL(str(build_library())).dm_fp8_block_quant_run
    vp = ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, vp, vp, vp, vp, vp, vp, vp,
                   ctypes.c_int, ctypes.c_float, vp]
    fn.restype = ctypes.c_int
    return fn


def load() -> None:
    """Build (first use) or load the library; raises RuntimeError / OSError where it cannot."""
    _run_fn()


loads = csrc_build.LoadProbe(
    lambda: load(), "fp8_block's quantizer runs on our Triton kernel: the CUDA library "
    f"(csrc/{_UNIT}.cu) could not be built or loaded here")


def quantize_rows_cols(x, offsets: torch.Tensor, max_rows: int, K: int, *, rows=None,
                       cols=None, recipe: BlockScaling = BlockScaling(),
                       row_ptrs: torch.Tensor | None = None) -> None:
    """`quant_fp8.quantize_rows_cols` (its arguments but the Triton tile and launch order) on
    the CUDA kernel: x bf16 rows [R, K] (tensor or int64 [1] device pointer) or row_ptrs (int64
    [>= R] 16-byte aligned row addresses, 0: a row of zeros); rows = (q, s), cols = (q_t, s_t)
    as there; R = offsets[-1] on the device, max_rows its host bound."""
    assert rows is not None or cols is not None
    assert K % BLOCK == 0 and K > 0, f"K={K} must be a positive multiple of {BLOCK}"
    assert (x is None) != (row_ptrs is None), "pass x or row_ptrs"
    assert offsets.dtype == torch.int32 and offsets.is_cuda and offsets.is_contiguous(), (
        "offsets: contiguous int32 [E + 1] on a CUDA device")
    if row_ptrs is not None:
        check_rows(row_ptrs, "row_ptrs", max_rows, offsets.device)
    E = offsets.numel() - 1
    from ..layout import padded_rows
    n_pb = max(1, padded_rows(max_rows, E) // BLOCK)

    def ptr(t):
        return None if t is None else t.data_ptr()

    xa = as_device_ptr(x, "x", torch.bfloat16) if x is not None else None
    q, s = (as_device_ptr(rows[0], "q"), as_device_ptr(rows[1], "s")) if rows else (None, None)
    qc, sc = ((as_device_ptr(cols[0], "q_t"), as_device_ptr(cols[1], "s_t")) if cols
              else (None, None))
    dev = offsets.device
    with torch.cuda.device(dev):
        rc = _run_fn()(K, E, n_pb, ptr(xa), ptr(row_ptrs), offsets.data_ptr(), ptr(q), ptr(s),
                       ptr(qc), ptr(sc), int(recipe.power_2_scales), float(recipe.amax_epsilon),
                       torch.cuda.current_stream(dev).cuda_stream)
    if rc >= 100:
        err = rc - 100
        raise RuntimeError(f"fp8_block quantizer (csrc/{_UNIT}.cu): the launch failed with "
                           f"cudaError {err}" + (f" ({_CUDA_ERRORS[err]})" if err in _CUDA_ERRORS
                                                 else ""))
    if rc != 0:
        raise RuntimeError(f"fp8_block quantizer (csrc/{_UNIT}.cu): {_STATUS.get(rc, rc)}")

"""fp8_block's quantizing kernels on CUDA C++ (csrc/fp8_block_quant.cu).

    quantize_rows_cols  the contract of `quant_fp8.quantize_rows_cols` (the Triton kernel, which
                        the CPU interpreter runs), bit for bit: the same torch twin
                        (quant/fp8_block.py) checks both. Why a second kernel: the column bundle
                        is a transpose, which the Triton kernel stores at ~1.2-1.6 TB/s (the
                        source file says how this one holds the tile).
    swiglu_bwd_quant    the SwiGLU backward after the W2 DGRAD's GEMM stored u = g3 W2, with the
                        quantizations that follow it in one pass: grad_h1's row and column
                        bundles and h2's column bundle (and the score-gradient parts), where the
                        Triton path runs quant_fp8.swiglu_bwd_rows and then quantize_rows_cols
                        twice, storing and reloading grad_h1 and h2 in bf16. Twin:
                        kernels/rows_ref.swiglu_bwd_quant_ref (the bf16 values as
                        swiglu_bwd_rows_ref's up to the exp and reciprocal approximations, then
                        quant/fp8_block.py's quantizers).

Where they run: the CUDA backend's fp8_block contexts where the library loads
(`Execution.fp8_quant`).

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

__all__ = ["quantize_rows_cols", "swiglu_bwd_quant", "loads", "load", "build_library"]

_UNIT = "fp8_block_quant"
_E4M3 = torch.float8_e4m3fn
_CUDA_ERRORS = {209: "no kernel image for this device: the library is built for sm_90a (Hopper)"}


def build_library(verbose: bool = False) -> Path:
    return csrc_build.build("dm_fp8q", csrc_build.csrc_dir(f"{_UNIT}.cu"), (_UNIT,), (),
                            what="fp8_block quantizer", verbose=verbose)


@functools.lru_cache(maxsize=1)
def _lib():
    lib = ctypes.CDLL(str(build_library()))
    vp, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.dm_fp8_block_quant_run.argtypes = [i32, i32, i64] + [vp] * 7 + [i32, f32, vp]
    lib.dm_fp8_block_quant_run.restype = i32
    lib.dm_fp8_block_swiglu_bwd_quant_run.argtypes = (
        [i32, i32, i64] + [vp] * 11 + [i64, i64, i32, i32, f32, f32, i32, f32, vp])
    lib.dm_fp8_block_swiglu_bwd_quant_run.restype = i32
    return lib


def _check_rc(rc: int, what: str, bad_args: str) -> None:
    """The entry points' status: 0, 1 (bad_args), 100 + the cudaError_t of a failed launch."""
    if rc >= 100:
        err = rc - 100
        raise RuntimeError(f"{what} (csrc/{_UNIT}.cu): the launch failed with cudaError {err}"
                           + (f" ({_CUDA_ERRORS[err]})" if err in _CUDA_ERRORS else ""))
    if rc != 0:
        raise RuntimeError(f"{what} (csrc/{_UNIT}.cu): " + (f"bad arguments: {bad_args}"
                                                             if rc == 1 else f"status {rc}"))


def _ptr(t):
    return None if t is None else t.data_ptr()


def _n_pb(max_rows: int, E: int) -> int:
    from ..layout import padded_rows
    return max(1, padded_rows(max_rows, E) // BLOCK)


def load() -> None:
    """Build (first use) or load the library; raises RuntimeError / OSError where it cannot."""
    _lib()


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
    xa = as_device_ptr(x, "x", torch.bfloat16) if x is not None else None
    q, s = (as_device_ptr(rows[0], "q"), as_device_ptr(rows[1], "s")) if rows else (None, None)
    qc, sc = ((as_device_ptr(cols[0], "q_t"), as_device_ptr(cols[1], "s_t")) if cols
              else (None, None))
    dev = offsets.device
    with torch.cuda.device(dev):
        rc = _lib().dm_fp8_block_quant_run(
            K, E, _n_pb(max_rows, E), _ptr(xa), _ptr(row_ptrs), offsets.data_ptr(), _ptr(q),
            _ptr(s), _ptr(qc), _ptr(sc), int(recipe.power_2_scales), float(recipe.amax_epsilon),
            torch.cuda.current_stream(dev).cuda_stream)
    _check_rc(rc, "fp8_block quantizer", "K not a positive multiple of 128, E < 1, no output "
              "bundle, or neither / both of x and row_ptrs")


def swiglu_bwd_quant(u, h1q, offsets: torch.Tensor, max_rows: int, F: int, *, gh1_rows,
                     gh1_cols, h2_cols, recipe: BlockScaling = BlockScaling(),
                     score_ptrs: torch.Tensor | None = None, score_grad_delta: int = 0,
                     part_stride: int = 0, part_cols: int = 128, activation: str = "swiglu",
                     swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> None:
    """From u (bf16 [R, F], tensor or device pointer: u = g3 W2) and the saved h1 row bundle
    h1q = (q [R, 2F] e4m3, s [R, 2F/128] fp32): gh1_rows = (q [R, 2F], s [R, 2F/128]) and
    gh1_cols = (q_t [2F, Rp], s_t [Rp/128, 2F]) of grad_h1 = round(act'(h1) round(s u)), and
    h2_cols = (q_t [F, Rp], s_t [Rp/128, F]) of h2 = round(s act(h1)) (s = 1 without scores),
    the bundles as quantize_rows_cols writes them (R = offsets[-1] on the device, max_rows its
    host bound). score_ptrs (int64 [>= max_rows], 0: no score): row r's score address, and each
    part_cols-wide column block's <u, round(act(h1))> goes to score_ptrs[r] + score_grad_delta
    + block * part_stride (bytes), as quant_fp8.swiglu_bwd_rows writes them."""
    assert F % BLOCK == 0 and F > 0, f"F={F} must be a positive multiple of {BLOCK}"
    assert offsets.dtype == torch.int32 and offsets.is_cuda and offsets.is_contiguous(), (
        "offsets: contiguous int32 [E + 1] on a CUDA device")
    assert activation in ("swiglu", "swiglu_clamped"), f"activation={activation!r}"
    dev = offsets.device
    if score_ptrs is not None:
        check_rows(score_ptrs, "score_ptrs", max_rows, dev)
        assert 16 <= part_cols <= 128 and 128 % part_cols == 0, (
            f"part_cols={part_cols}: 16 to 128, dividing 128")
    E = offsets.numel() - 1
    ptrs = [as_device_ptr(u, "u", torch.bfloat16)]
    for name, pair in (("h1q", h1q), ("gh1_rows", gh1_rows), ("gh1_cols", gh1_cols),
                       ("h2_cols", h2_cols)):
        ptrs += [as_device_ptr(pair[0], f"{name} q", _E4M3), as_device_ptr(pair[1], f"{name} s",
                                                                          torch.float32)]
    u_p, hq_p, hs_p, gq, gs, gqc, gsc, hqc, hsc = ptrs
    with torch.cuda.device(dev):
        rc = _lib().dm_fp8_block_swiglu_bwd_quant_run(
            F, E, _n_pb(max_rows, E), _ptr(u_p), _ptr(hq_p), _ptr(hs_p), offsets.data_ptr(),
            _ptr(gq), _ptr(gs), _ptr(gqc), _ptr(gsc), _ptr(hqc), _ptr(hsc), _ptr(score_ptrs),
            int(score_grad_delta), int(part_stride), int(part_cols),
            int(activation == "swiglu_clamped"), float(swiglu_alpha), float(swiglu_limit),
            int(recipe.power_2_scales), float(recipe.amax_epsilon),
            torch.cuda.current_stream(dev).cuda_stream)
    _check_rc(rc, "fp8_block SwiGLU backward + quantization",
              "F not a positive multiple of 128, E < 1, a null operand, or part_cols not 16, 32, "
              "64 or 128")

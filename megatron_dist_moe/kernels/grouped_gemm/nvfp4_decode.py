"""NVFP4 grouped GEMM for the decode regime on CUDA C++ (csrc/nvfp4_decode_mm.cu).

The contract of `nvfp4.nvfp4_grouped_mm` with the A rows decoded once (`a16`; the same torch
twin checks both): row r of expert e gets S_dec(r) S_dec(e) a16[r] @ dequant(W[e])^T in bf16,
stored at out[r] ("store") or at out_row_ptrs[r] ("scatter", skipped where 0).

Where it runs: up to MAX_ROWS_PER_EXPERT (16) rows per expert on average in the CUDA engine
(decode: the GEMM is a stream of 4.5-bit weights and their decode); above, the stream-K wgmma
GEMM measured faster (nvfp4_wgmma.cuda_variant). The library keeps variants with 32-token
passes for the sweeps of bench_nvfp4_gemm.
Weights are the MMA's M side and tokens its N side (one mma.sync.m16n8k16 per 16 weight rows x
8 tokens x 16 k), each thread decodes exactly the weight values of its fragment straight from
its 16-byte loads, and every warp streams its rows over its slice of K (long K is split over
2-4 warps of a block; the source file says how). Larger row counts run the wgmma GEMM of the
same library (nvfp4_wgmma.py).

The library (both GEMMs) builds with nvcc on first use (seconds; no CUTLASS, no torch headers)
and is cached as csrc_build says. `loads(device)` tells whether it can run here.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional

import torch

from ...layout import nvfp4_row_bytes
from .. import csrc_build
from ..common import as_device_ptr, check_offsets, check_rows

__all__ = ["variants", "variant_shape", "describe", "default_variant", "nvfp4_decode_mm",
           "launch", "loads", "build_library", "MAX_ROWS_PER_EXPERT"]

_UNIT = "nvfp4_decode_mm"
MAX_ROWS_PER_EXPERT = 16   # above this (on average) the wgmma GEMM (nvfp4_wgmma.py) runs
_STATUS = {1: "bad shape: E < 1 (above 256 for the wgmma GEMM), N not a multiple of 16, K not a "
              "multiple of 128, a row stride not a multiple of 4, neither / both of out and "
              "out_row_ptrs, or a stream-K variant without a 16-byte aligned workspace",
           5: "the kernel launch failed"}


_LONG_K = 56 * 128   # K with this many 128-wide chunks or more: its rows split over 4 warps


def default_variant(max_rows: int, E: int, K: int) -> Optional[int]:
    """The variant by rows per expert on average (max_rows / E) and the contraction length K,
    None above the decode regime: the fastest of bench_nvfp4_gemm --cuda-sweep on one H200 at
    1, 8 and 16 rows per expert (guide shapes; docs/decisions.md). Splitting K over 4 warps
    pays where each keeps 14+ chunks (W13, K=7168), not at K=3072 (W2)."""
    per_expert = -(-max_rows // E)
    if per_expert > MAX_ROWS_PER_EXPERT:
        return None
    long_k = K >= _LONG_K
    if per_expert <= 8:
        return 332142 if long_k else 32142
    return 32242


# the library's units: this decode GEMM and the wgmma one (nvfp4_wgmma.py), one shared header
_UNITS = (_UNIT, "nvfp4_wgmma_mm")
_HEADERS = ("nvfp4_decode.cuh",)


def build_library(verbose: bool = False) -> Path:
    return csrc_build.build("dm_nvfp4", csrc_build.csrc_dir(f"{_UNIT}.cu"), _UNITS, _HEADERS,
                            what="NVFP4 GEMMs", verbose=verbose)


def _entry(dll, name: str):
    fn = getattr(dll, f"dm_{name}_run")
    i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    # the wgmma GEMM takes its stream-K workspace and wait bound (polls) last
    fn.argtypes = ([i32, i32, i32, i32, i64, vp, vp, vp, vp, vp, vp, vp, vp, vp]
                   + ([vp, i64] if name == "nvfp4_wgmma_mm" else []))
    fn.restype = i32
    codes = (ctypes.c_int * 64)()
    n = getattr(dll, f"dm_{name}_variants")(codes, 64)
    return fn, tuple(codes[:n])


@functools.lru_cache(maxsize=1)
def _dll():
    dll = ctypes.CDLL(str(build_library()))
    ws = dll.dm_nvfp4_wgmma_mm_workspace   # bytes of a stream-K variant's workspace
    ws.argtypes, ws.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int64
    return dll


@functools.lru_cache(maxsize=1)
def _lib():
    """{unit: (run function, variant codes)} of the library's two GEMMs."""
    return {u: _entry(_dll(), u) for u in _UNITS}


def _run_fn():
    return _lib()[_UNIT][0]


def variants() -> tuple:
    """The library's variant codes: (k slices per row group - 1) * 100000 + weight rows per warp
    * 1000 + token groups of 8 per pass * 100 + warps per block * 10 + chunks in the register
    ring (variant_shape decodes one)."""
    return _lib()[_UNIT][1]


def variant_shape(code: int) -> dict:
    return dict(k_slices=code // 100000 + 1, rows_per_warp=code // 1000 % 100,
                token_groups=code // 100 % 10, warps=code // 10 % 10, ring=code % 10)


def describe(code: int) -> str:
    v = variant_shape(code)
    split = (f", K split over {v['k_slices']} warps (fixed-order sum)" if v["k_slices"] > 1
             else "")
    return (f"variant {code}: {v['rows_per_warp']} weight rows per warp x {8 * v['token_groups']}"
            f" token rows per pass, {v['warps']} warps per block{split}, {v['ring']}-chunk "
            "register ring")


# whether the library's GEMMs run here (loads(device)): a Hopper GPU where it builds or loads
loads = csrc_build.LoadProbe(
    lambda: _run_fn(), "nvfp4's GEMMs run on our Triton kernel: the CUDA library "
    f"(csrc/{_UNIT}.cu, csrc/nvfp4_wgmma_mm.cu) could not be built or loaded here")


def _check_dense(x: torch.Tensor, name: str, dtype: torch.dtype, width: int,
                 dev: torch.device) -> None:
    """A dense operand (not a device pointer) has the rows the kernel reads: 16-byte aligned,
    row width `width`, on the weights' device."""
    if x.dtype == torch.int64 and x.numel() == 1:
        assert x.device == dev, f"{name}: the device pointer is on {x.device}, expected {dev}"
        return
    assert x.device == dev, f"{name} is on {x.device}, expected {dev}"
    assert x.dim() == 2 and x.shape[1] == width and x.dtype == dtype, (
        f"{name}: expected {dtype} [R, {width}], got {x.dtype} {tuple(x.shape)}")


def nvfp4_decode_mm(*, a, a16, weight, expert_offsets: torch.Tensor, max_rows: int,
                    epilogue: str = "store", out=None, out_row_ptrs=None,
                    variant: Optional[int] = None) -> None:
    """Row r of expert e gets S_dec(r) S_dec(e) a16[r] @ dequant(W[e])^T (bf16).

    a               NVFP4 byte rows [>= R, nvfp4_row_bytes(K)] (tensor or device pointer): each
                    row's fp32 S_dec is read from it
    a16             fp16 [>= R, K] (tensor or device pointer): the rows' values before their
                    global scales (quant_nvfp4.dequantize_rows)
    weight          a prepared.PreparedWeight [E, N, K] (16 x 16 tile scales)
    expert_offsets  int32 [E+1] device, R = expert_offsets[E] (never read on the host)
    max_rows        host bound on R (picks the variant)
    epilogue        "store": out [R, N] bf16 (tensor or device pointer); "scatter":
                    out_row_ptrs int64 [>= max_rows]
    variant         one of variants(); default: default_variant(max_rows, E, K)
    """
    E, N, K = weight.shape
    variant = variant if variant is not None else default_variant(max_rows, E, K)
    assert variant is not None, (
        f"max_rows={max_rows} over E={E} experts is above {MAX_ROWS_PER_EXPERT} rows per "
        "expert, where no variant is the default (nvfp4_wgmma.nvfp4_wgmma_mm runs that "
        "regime); pass variant= to force one")
    launch(_UNIT, "nvfp4_decode_mm", variant, a=a, a16=a16, weight=weight,
           expert_offsets=expert_offsets, max_rows=max_rows, epilogue=epilogue, out=out,
           out_row_ptrs=out_row_ptrs)


def launch(unit: str, name: str, variant: int, *, a, a16, weight, expert_offsets, max_rows,
           epilogue, out, out_row_ptrs, workspace: Optional[torch.Tensor] = None,
           polls_max: int = 0) -> None:
    """Check what the library's kernels assume and launch `unit`'s `variant` on the current
    stream of the weights' device (both GEMMs share the argument block; the wgmma GEMM's
    stream-K variants also take `workspace` and `polls_max`, checked by the caller)."""
    E, N, K = weight.shape
    dev = weight.packed.device
    check_offsets(expert_offsets, E, dev)
    assert K % 128 == 0 and N % 16 == 0, f"[N={N}, K={K}]: K % 128 and N % 16 must be 0"
    assert tuple(weight.scales.shape) == (E, N // 16, K // 16), (
        f"weight scales {tuple(weight.scales.shape)}: expected 16 x 16 tiles {(E, N // 16, K // 16)}")
    senc = weight.global_scale
    assert senc.dtype == torch.float32 and senc.is_contiguous() and senc.device == dev, (
        "weight.global_scale must be a contiguous fp32 tensor on the weights' device")
    # what the kernels' loads assume: 16-byte weight rows, 2-byte scale pairs, 16-byte a16 rows
    packed, scales = weight.packed, weight.scales
    assert (packed.dtype == torch.uint8 and packed.is_contiguous()
            and packed.data_ptr() % 16 == 0), (
        "weight.packed must be a contiguous, 16-byte aligned uint8 tensor")
    assert scales.is_contiguous() and scales.device == dev and scales.data_ptr() % 2 == 0, (
        "weight.scales must be a contiguous, 2-byte aligned tensor on the weights' device")
    _check_dense(a, "a", torch.uint8, nvfp4_row_bytes(K), dev)
    _check_dense(a16, "a16", torch.float16, K, dev)
    fn, codes = _lib()[unit]
    assert variant in codes, f"variant={variant}: expected one of {codes}"
    out_addr = rows_ptr = None
    if epilogue == "store":
        assert out is not None, "epilogue='store' needs out"
        out_addr = as_device_ptr(out, "out", torch.bfloat16)
    else:
        assert epilogue == "scatter", f"epilogue={epilogue!r}: 'store' or 'scatter'"
        assert out_row_ptrs is not None, "epilogue='scatter' needs out_row_ptrs"
        check_rows(out_row_ptrs, "out_row_ptrs", max_rows, dev)
        rows_ptr = out_row_ptrs
    a_addr = as_device_ptr(a, "a")
    a16_addr = as_device_ptr(a16, "a16", torch.float16)
    with torch.cuda.device(dev):   # the launch goes to the current device: the weights' one
        status = fn(
            variant, E, N, K, nvfp4_row_bytes(K), a16_addr.data_ptr(), a_addr.data_ptr(),
            packed.data_ptr(), scales.data_ptr(), senc.data_ptr(), expert_offsets.data_ptr(),
            None if out_addr is None else out_addr.data_ptr(),
            None if rows_ptr is None else rows_ptr.data_ptr(),
            torch.cuda.current_stream(dev).cuda_stream,
            *(() if unit == _UNIT else (None if workspace is None else workspace.data_ptr(),
                                        int(polls_max))))
    if status != 0:
        raise RuntimeError(f"{name} [E={E}, N={N}, K={K}], variant {variant}: "
                           f"{_STATUS.get(status, f'status {status}')}")

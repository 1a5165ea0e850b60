"""What every precision's pipeline shares: where a WGRAD is stored and in which dtype."""

from __future__ import annotations

import torch



def wgrad_store_dtype(wgrad_dtype: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the WGRAD GEMMs store: Config.wgrad_dtype, but never wider than the weights.

    The op returns weight gradients in the weights' dtype (autograd's rule, library.py). The
    kernels sum in fp32 and round once in their epilogue, so storing fp32 and rounding to bf16
    afterwards gives the same bits as storing bf16 directly (GPU test
    `test_wgrad_bf16_store_equals_rounded_fp32_store`), at three times the bytes."""
    if wgrad_dtype not in ("bf16", "fp32"):
        raise ValueError(f"wgrad_dtype {wgrad_dtype!r}: expected 'bf16' or 'fp32'")
    if wgrad_dtype == "fp32" and weight_dtype in (torch.float32, torch.float64):
        return torch.float32
    return torch.bfloat16


def wgrad_output(wgrad_into, which: int, shape: tuple, dtype: torch.dtype, device):
    """Where a WGRAD goes: wgrad_into[which] (an ExpertOutTable the kernel adds into) or a new
    stacked [E, M, N] tensor."""
    if wgrad_into is not None:
        return wgrad_into[which]
    return torch.empty(shape, dtype=dtype, device=device)

"""The CUDA backend's WGRAD store dtype: Config.wgrad_dtype, never wider than the weights.

The op returns weight gradients in the weights' dtype, so on bf16 weights an fp32 store would only
be rounded afterwards (same bits, tests/gpu: test_wgrad_bf16_store_equals_rounded_fp32_store)."""

from __future__ import annotations

import pytest
import torch

from megatron_dist_moe.backends.cuda.experts import wgrad_store_dtype


@pytest.mark.parametrize("wgrad_dtype,weight_dtype,stored", [
    ("fp32", torch.bfloat16, torch.bfloat16),   # the default Config on the CUDA backend
    ("bf16", torch.bfloat16, torch.bfloat16),
    ("fp32", torch.float32, torch.float32),
    ("bf16", torch.float32, torch.bfloat16),
    ("fp32", torch.float64, torch.float32),
])
def test_store_dtype(wgrad_dtype, weight_dtype, stored):
    assert wgrad_store_dtype(wgrad_dtype, weight_dtype) == stored


def test_unknown_wgrad_dtype_names_the_argument():
    with pytest.raises(ValueError, match="wgrad_dtype 'fp16'"):
        wgrad_store_dtype("fp16", torch.bfloat16)

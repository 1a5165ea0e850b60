"""What every kernel family shares: device pointers, dtype maps, argument checks, grid sizes.

Operands whose address is chosen on the device (activation-slot offsets, peer buffers) travel
as *device pointers*: int64 [1] tensors holding an absolute address (`device_ptr`), loaded and
cast inside the kernels (`load_ptr`). Rows read from or written to peers travel as per-row
address tables: int64 [>= R] tensors, 0 meaning "no row".
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["interpreting", "device_ptr", "as_device_ptr", "TL_DTYPES", "load_ptr",
           "check_offsets", "check_rows", "num_sms", "default_num_programs",
           "ensure_tma_allocator", "HAS_TMA", "grouped_tile", "grouped_grid"]

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
             torch.float64: tl.float64, torch.float8_e4m3fn: tl.float8e4nv}

HAS_TMA = hasattr(tl, "make_tensor_descriptor")


def interpreting() -> bool:
    """True in Triton's CPU interpreter (TRITON_INTERPRET=1), read when a kernel is launched."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_ptr(t: torch.Tensor) -> torch.Tensor:
    """int64 [1] tensor on t's device holding t's (16-byte aligned) address.

    Written by a fill kernel (the address is a kernel argument), not copied from the host, so it
    neither synchronises nor leaves a host-memory source behind inside a CUDA graph.
    """
    assert t.data_ptr() % 16 == 0, f"device_ptr: address {t.data_ptr():#x} must be 16-byte aligned"
    return torch.full((1,), t.data_ptr(), dtype=torch.int64, device=t.device)


def as_device_ptr(x: torch.Tensor, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Accept an int64 [1] device pointer, or a dense tensor (converted with `device_ptr`)."""
    if x.dtype == torch.int64 and x.numel() == 1:
        return x
    assert x.is_contiguous(), f"{name}: a dense tensor operand must be contiguous"
    assert dtype is None or x.dtype == dtype, f"{name}: dtype {x.dtype} != compute dtype {dtype}"
    return device_ptr(x)


@triton.jit
def load_ptr(addr_ptr, DT: tl.constexpr):
    """Typed pointer from a device pointer (int64 [1] holding a 16-byte aligned address)."""
    # NOTE: the hint must sit on the int->ptr cast: axis analysis drops hints placed on a load's
    # result. Without it, operand loads are 2-byte scalars that the pipeliner will not turn into
    # cp.async, and stores are not vectorized (checked in the sm_90 PTX).
    return tl.multiple_of(tl.load(addr_ptr).to(tl.pointer_type(DT)), 16)


@triton.jit
def grouped_tile(n_row_blocks, n_col_blocks, GROUP_R: tl.constexpr):
    """(row block, column block) of this program in the 1-D grid of `grouped_grid`, over a
    row-major [R, K] tensor: GROUP_R row blocks at a time walk every column block, the row
    block varying fastest, so that programs running together cover whole rows of a few row
    blocks. GROUP_R >= n_row_blocks is the plain row-block-fastest order of a 2-D grid. (The
    quantizers measured 1-5 % faster at GROUP_R = 1: docs/decisions.md.)"""
    pid = tl.program_id(0)
    per_group = GROUP_R * n_col_blocks
    first = (pid // per_group) * GROUP_R
    rows_here = tl.minimum(n_row_blocks - first, GROUP_R)
    within = pid % per_group
    return first + within % rows_here, within // rows_here


def grouped_grid(n_row_blocks: int, n_col_blocks: int, group_rows: int) -> tuple:
    """The 1-D launch grid of `grouped_tile` (group_rows: its GROUP_R, >= 1)."""
    assert group_rows >= 1, f"group_rows={group_rows}: row blocks per launch group, >= 1"
    return (n_row_blocks * n_col_blocks,)


def check_offsets(expert_offsets: torch.Tensor, num_experts: int, device: torch.device) -> None:
    assert expert_offsets.dtype == torch.int32, "expert_offsets must be int32 cumulative row ends"
    assert expert_offsets.is_contiguous() and expert_offsets.numel() == num_experts + 1, (
        f"expert_offsets must be contiguous [E+1] = [{num_experts + 1}], got "
        f"{tuple(expert_offsets.shape)}")
    assert expert_offsets.device == device, "expert_offsets must live on the weights' device"


def check_rows(t: torch.Tensor, name: str, max_rows: int, device: torch.device) -> None:
    assert t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous(), (
        f"{name}: must be a contiguous int64 [max_rows] table of row addresses")
    assert t.numel() >= max_rows, f"{name}: {t.numel()} entries < max_rows={max_rows}"
    assert t.device == device, f"{name}: must live on the weights' device"


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_num_programs(device: torch.device) -> int:
    """Persistent grid size: one program per SM on a GPU; 3 in the interpreter, so that each
    program walks several tiles (persistence is tested there too)."""
    if device.type == "cuda" and not interpreting():
        return num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 3


def ensure_tma_allocator() -> None:
    """Device-side TMA descriptors live in a per-launch global scratch from triton's allocator."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator
        if not isinstance(_allocator.get(), NullAllocator):
            return
    except ImportError:  # layout of triton internals changed: set ours unconditionally
        pass

    def _alloc(size: int, alignment: int, stream: Optional[int]):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(_alloc)

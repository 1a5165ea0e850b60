"""Programmatic dependent launch (PDL) for our kernels: an opt-in experiment on kernel boundaries.

With `DIST_MOE_PDL=1`, every kernel of this package is launched with the
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION attribute and starts with
`grid_dependency_wait`: `griddepcontrol.wait` (block until the previous kernel in the stream has
completed and its writes are visible) and then `griddepcontrol.launch_dependents` (the next
kernel may be scheduled once every program of this one has started). So a kernel's launch and
the scheduling of its first programs overlap the tail of the kernel before it, while no program
touches memory before its predecessor is done: correctness does not depend on what a kernel
reads. The wait comes first in every program, so a kernel can never complete before the one
before it. Kernels from torch (copies, the symmetric-memory barrier) are launched without the
attribute and serialise as usual. Supported on sm_90+; off in the CPU interpreter (inline PTX).
Off by default: on 2xH200 it was correct but made the guide fwd+bwd 0.17 ms slower, and a
graph-launched kernel boundary there costs only 1-7 us, of which PDL saves 0.3-0.4 us
(benchmarks/bench_kernel_gaps.py; docs/perf_notes.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..config import env_switch

__all__ = ["PDL", "grid_dependency_wait", "pdl_args"]

PDL = env_switch("DIST_MOE_PDL", False)


@triton.jit
def grid_dependency_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_args(device: torch.device | str) -> dict:
    """Extra arguments of a launch of one of our kernels: PDL on (the kernel's constexpr and the
    launch attribute) where DIST_MOE_PDL is set and the device is a CUDA GPU of sm_90+."""
    if not PDL or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return {}
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}

"""Which tiles a context's GEMMs launch with (shown by Context.explain): the tile tables of
config.py (bf16 FPROP / DGRAD / WGRAD, the decode tiles), fp8.py and nvfp4.py, chosen as the
launchers choose them for the context's row bound."""

from __future__ import annotations

import torch

from ..common import interpreting
from .config import select_config
from .fp8 import fp8_config
from .mega import mega_config
from .nvfp4 import launch_tiles

__all__ = ["gemm_tiles"]


def gemm_tiles(execution, max_rows: int, num_local_experts: int, hidden_dim: int,
               intermediate_dim: int, device: torch.device) -> str:
    """The tiles a CUDA-backend context's GEMMs launch with at its row bound (`execution`:
    its Execution): the tables of kernels/grouped_gemm by kernel, shape and rows per expert."""
    E, D, F = max(1, num_local_experts), hidden_dim, intermediate_dim
    per_expert = -(-max_rows // E)
    on_gpu = device.type == "cuda" and not interpreting()

    def bf16(c):
        return f"{c.block_m}x{c.block_n}x{c.block_k} {c.num_warps}w {c.num_stages}st"
    where = f"{max_rows} rows = {per_expert} per expert"
    if not on_gpu:
        where += "; the interpreter's tiles"
    if execution.precision == "fp8_block":
        c = fp8_config(device)
        return (f"{c.block_m}x{c.block_n}x128 {c.num_warps}w {c.num_stages}st, "
                f"{_per_sm(c.programs_per_sm)}, every GEMM ({where})")
    if execution.precision == "nvfp4":
        from . import nvfp4_dense
        from ...memory_plan import nvfp4_dense as takes_dense
        if takes_dense(max_rows, E):
            w13, w2 = (select_config("fwd", n=n, kd=kd, device=device, rows_per_expert=per_expert)
                       for n, kd in ((2 * F, D), (D, F)))
            return (f"{nvfp4_dense.describe()}: W13 {bf16(w13)}, W2 {bf16(w2)} ({where})")
        if execution.nvfp4_gemm == "cuda":
            from .nvfp4_wgmma import cuda_describe, cuda_variant
            return (f"CUDA GEMMs, W13 {cuda_describe(cuda_variant(max_rows, E, D))}; W2 "
                    f"{cuda_describe(cuda_variant(max_rows, E, F))} ({where})")
        t = launch_tiles(max_rows, E, device)
        return (f"{t.block_m}x{t.block_n}x{t.block_k} {t.num_warps}w {t.num_stages}st, "
                f"{_per_sm(t.programs_per_sm)} ({where})")
    if execution.pipeline == "mega":
        w13 = w2 = mega_config(2 * F, D, device, max_rows, E)
    else:
        rows = None if execution.pipeline == "staged" else per_expert
        w13 = select_config("fwd", n=2 * F, kd=D, device=device, rows_per_expert=rows)
        w2 = select_config("fwd", n=D, kd=F, device=device, rows_per_expert=per_expert)
    text = f"W13 FPROP {bf16(w13)}, W2 FPROP {bf16(w2)}"
    if not execution.inference:
        text += (f"; DGRAD {bf16(select_config('dgrad', n=F, kd=D, device=device))}, "
                 f"WGRAD {bf16(select_config('wgrad', n=D, kd=2 * F, device=device))}")
    return f"{text} ({where})"


def _per_sm(n: int) -> str:
    return f"{n} program{'s' if n > 1 else ''} per SM"

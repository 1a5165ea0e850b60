"""NVFP4 grouped GEMM at training-size row counts: the weights decoded once per call.

    out rows of expert e = S_dec(row) * S_dec(e) * (a16 rows @ dequant(W[e])^T)

the contract of nvfp4.py / nvfp4_wgmma.py with a16 in k order (the same torch twin checks it).

Why: with hundreds of rows per expert the NVFP4 GEMM is compute-bound, and a kernel that decodes
the weights in its operand path decodes each weight once per token tile (16 times per weight at
2048 rows per expert with 128-row token tiles), on the cores that also issue its MMAs: the
wgmma kernel (csrc/nvfp4_wgmma_mm.cu) runs at ~70 % of our bf16 GEMM's rate there. Here each
weight is decoded once per call, into fp16 (exact: an E2M1 value times an E4M3 block scale has
at most six significant bits and lies in fp16's normal range, the same decode as `_decode_f16`),
by a memory-bound pass that reads 4.5 bits and writes 16 per weight; then our fp16 grouped GEMM
(mm.py, the bf16 path's kernel and tiles) multiplies the fp16 a16 rows by it and applies the
two global scales in its epilogue (`nvfp4_scales`), storing bf16; W13's SwiGLU epilogue stores
h2 = act(h1) alone, so h1 never goes to memory.

Memory: the decoded weights live in a scratch of `scratch_experts` experts, bounded by
memory_plan.NVFP4_WEIGHT_SCRATCH_BYTES (one expert at least; plan_memory counts it): the experts
run in groups, one decode and one GEMM launch per group, the group's expert offsets a slice of
the call's. The nvfp4 pipeline takes this GEMM from memory_plan.NVFP4_DENSE_MIN_ROWS_PER_EXPERT
rows per expert. Nothing is read on the host; a call
is a fixed sequence of launches and can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ... import memory_plan
from ...layout import nvfp4_row_bytes
from ..common import interpreting
from ..quant_nvfp4 import _decode_f16, _decode_f16_asm
from .config import select_config
from .mm import grouped_mm_fwd

__all__ = ["decode_weights", "nvfp4_dense_mm", "scratch_experts", "scratch_numel", "describe"]

_BN = 32   # a decode program's weight rows (x 256 values, or 128 where K % 256 != 0)


@triton.jit
def _decode_weights_kernel(packed_ptr, scales_ptr, out_ptr, e0, N, K, BN: tl.constexpr,
                           BK: tl.constexpr, ASM: tl.constexpr):
    pid_k, pid_n, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = (e0 + g).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    kb = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    ks = pid_k * (BK // 16) + tl.arange(0, BK // 16)
    packed = tl.load(packed_ptr + (e * N + rows)[:, None].to(tl.int64) * (K // 2) + kb[None, :])
    s8 = tl.load(scales_ptr + (e * (N // 16) + rows // 16)[:, None].to(tl.int64) * (K // 16)
                 + ks[None, :])
    s16 = s8.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    if ASM:
        v = _decode_f16_asm(packed, s16, BN, BK)
    else:
        v = _decode_f16(packed, s16, BN, BK)
    kk = pid_k * BK + tl.arange(0, BK)
    tl.store(out_ptr + (g * N + rows)[:, None].to(tl.int64) * K + kk[None, :], v)


def _check_weight(weight) -> tuple[int, int, int]:
    E, N, K = weight.shape
    assert K % 128 == 0 and N % _BN == 0, (
        f"nvfp4_dense: weight [{E}, {N}, {K}] needs N % {_BN} == 0 and K % 128 == 0")
    assert tuple(weight.scales.shape) == (E, N // 16, K // 16), (
        f"weight scales {tuple(weight.scales.shape)}: expected 16 x 16 tiles "
        f"{(E, N // 16, K // 16)}")
    return E, N, K


def decode_weights(weight, e0: int, e1: int, out: torch.Tensor) -> None:
    """out[g] = the fp16 values of expert e0 + g of a prepared NVFP4 weight (E2M1 x its block
    scale, before the global scale; quant/nvfp4.dequantize_weight with global scale 1), for
    g < e1 - e0. out: fp16, contiguous, at least (e1 - e0) * N * K elements."""
    E, N, K = _check_weight(weight)
    assert 0 <= e0 < e1 <= E, f"experts [{e0}, {e1}) of {E}"
    assert out.dtype == torch.float16 and out.is_contiguous() and out.numel() >= (e1 - e0) * N * K, (
        f"out must be a contiguous fp16 tensor of at least {(e1 - e0) * N * K} elements")
    on_gpu = out.device.type == "cuda" and not interpreting()
    bk = 256 if K % 256 == 0 else 128
    _decode_weights_kernel[(K // bk, N // _BN, e1 - e0)](
        weight.packed, weight.scales.view(torch.uint8), out, e0, N, K, BN=_BN, BK=bk,
        ASM=on_gpu, num_warps=4)


def describe() -> str:
    return (f"dense: the weights decoded once per call into an fp16 scratch (at most "
            f"{memory_plan.NVFP4_WEIGHT_SCRATCH_BYTES / 2 ** 20:.0f} MiB, experts in groups), "
            "then the fp16 GEMM with the global scales (and W13's SwiGLU) in its epilogue")


def scratch_experts(N: int, K: int, E: int) -> int:
    """Experts decoded at once: as many [N, K] fp16 matrices as fit the plan's bound, at least
    one (memory_plan.nvfp4_dense_experts)."""
    return memory_plan.nvfp4_dense_experts(N, K, E)


def scratch_numel(shapes) -> int:
    """fp16 elements of a scratch that serves every weight of `shapes` ((E, N, K) each)."""
    return max(scratch_experts(N, K, E) * N * K for E, N, K in shapes)


def nvfp4_dense_mm(*, a, a16, weight, expert_offsets: torch.Tensor, max_rows: int,
                   scratch: torch.Tensor, epilogue: str = "store", out=None,
                   out_row_ptrs: Optional[torch.Tensor] = None, h2=None,
                   activation: str = "swiglu", swiglu_alpha: float = 1.702,
                   swiglu_limit: float = 7.0, num_programs: Optional[int] = None) -> None:
    """The NVFP4 FPROP with the weights decoded per expert group into `scratch`.

    a             the NVFP4 byte rows [R, nvfp4_row_bytes(K)] (tensor or device pointer): their
                  fp32 S_dec only
    a16           fp16 [R, K] (tensor or device pointer): the rows' values before their global
                  scales, in k order (quant_nvfp4.dequantize_rows(order="k"))
    weight        prepared.PreparedWeight [E, N, K], 16 x 16 block scales
    scratch       fp16, contiguous, at least scratch_numel([weight.shape]) elements
    epilogue      "store" (bf16 [R, N] at `out`), "scatter" (row r to out_row_ptrs[r]; 0: skip)
                  or, for W13 [E, 2F, D], "swiglu": bf16 h2 [R, F] at `h2` = act(h1) of the
                  bf16-rounded h1 = [gate | up] (`activation`, `swiglu_alpha`, `swiglu_limit`:
                  grouped_mm_fwd's), which is never stored
    """
    E, N, K = _check_weight(weight)
    G = scratch_experts(N, K, E)
    assert scratch.dtype == torch.float16 and scratch.is_contiguous() and scratch.numel() >= G * N * K, (
        f"scratch must be a contiguous fp16 tensor of at least {G * N * K} elements "
        f"(scratch_numel)")
    senc = weight.global_scale
    # the bf16 path's tiles for this row bound (a group's offsets cover fewer experts)
    config = select_config("fwd", n=N, kd=K, device=scratch.device,
                           rows_per_expert=-(-max_rows // E))
    for e0 in range(0, E, G):
        e1 = min(E, e0 + G)
        w16 = scratch[: (e1 - e0) * N * K].view(e1 - e0, N, K)
        decode_weights(weight, e0, e1, w16)
        grouped_mm_fwd(w=w16, expert_offsets=expert_offsets[e0:e1 + 1], max_rows=max_rows,
                       a=a16, epilogue=epilogue, out=out, out_row_ptrs=out_row_ptrs, h2=h2,
                       activation=activation, swiglu_alpha=swiglu_alpha,
                       swiglu_limit=swiglu_limit,
                       nvfp4_scales=(a, nvfp4_row_bytes(K), senc[e0:e1]), config=config,
                       num_programs=num_programs)

"""WGRAD persistent grouped GEMM: out[e] (+)= a_e^T @ b_e over the rows of expert e.

One launch covers every expert's output tiles: programs stride over the E x tiles(M, N) list
(`_grouped_mm_wgrad_kernel`). Each expert's full BLOCK_K row blocks are loaded through TMA
descriptors spanning every row (one per operand) or through plain pointer loads, its ragged last
block through masked loads. The output is a stacked [E, M, N] tensor or an `ExpertOutTable` of
E separate matrices (Megatron's per-expert main_grad), which accumulate=True adds into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import (TL_DTYPES, as_device_ptr, check_offsets, default_num_programs,
                      ensure_tma_allocator, interpreting, load_ptr)
from .config import GroupedGemmConfig, select_config
from .tiles import swizzle

__all__ = ["ExpertOutTable", "grouped_mm_wgrad"]


@dataclass(frozen=True)
class ExpertOutTable:
    """Per-expert output matrices anywhere in memory, for `grouped_mm_wgrad`.

    addrs  int64 [E] device tensor: expert e's row-major M x N matrix of `dtype` starts there
    m, n   each matrix's shape
    tensors the matrices (`of` keeps them, so the addresses stay valid while the table lives)
    Build it with `of(tensors)`, e.g. from Megatron's per-expert fp32 `main_grad` buffers, so the
    WGRAD accumulates into them in place (accumulate=True) instead of storing a stacked copy.
    """
    addrs: torch.Tensor
    m: int
    n: int
    dtype: torch.dtype
    tensors: tuple = ()     # the matrices themselves (kept alive while the table is)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.addrs.numel(), self.m, self.n)

    @property
    def device(self) -> torch.device:
        return self.addrs.device

    @staticmethod
    def of(tensors, name: str = "out") -> "ExpertOutTable":
        """The table of E equally shaped, contiguous, 16-byte aligned tensors on one device.
        The fills below are kernels (no host-to-device copy), so this may run during capture."""
        tensors = list(tensors)
        if not tensors:
            raise ValueError(f"{name}: expected at least one tensor")
        t0 = tensors[0]
        for i, t in enumerate(tensors):
            if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device:
                raise ValueError(f"{name}[{i}]: {tuple(t.shape)} {t.dtype} on {t.device} differs "
                                 f"from {name}[0]: {tuple(t0.shape)} {t0.dtype} on {t0.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name}[{i}]: must be contiguous")
            if t.data_ptr() % 16:
                raise ValueError(f"{name}[{i}]: address {t.data_ptr():#x} is not 16-byte aligned")
        if t0.dim() < 2:
            raise ValueError(f"{name}[0]: expected a matrix, got shape {tuple(t0.shape)}")
        addrs = torch.empty(len(tensors), dtype=torch.int64, device=t0.device)
        for i, t in enumerate(tensors):
            addrs[i].fill_(t.data_ptr())
        return ExpertOutTable(addrs, t0.numel() // t0.shape[-1], t0.shape[-1], t0.dtype,
                              tuple(tensors))


@triton.jit
def _dot_t(a, b, acc, IEEE: tl.constexpr):
    """acc += a.T @ b (a [BK, BM], b [BK, BN]); fp32 products in the interpreter (mm._dot)."""
    if IEEE:
        return tl.dot(a.T.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.T, b, acc)


@triton.jit
def _add_wgrad_part(part, row_ptrs, m_ok, cols, N, live, OUT_DT: tl.constexpr):
    """Columns `cols` of a WGRAD tile: out += part (fp32), skipped for an expert without rows."""
    ptrs = row_ptrs + cols[None, :]
    mask = m_ok[:, None] & (cols < N)[None, :] & live
    old = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (old + part).to(OUT_DT), mask=mask)


@triton.jit
def _store_wgrad_tile(acc, out_ptr, e, offs_m, col0, M, N, row_start, row_end,
                      ACCUMULATE: tl.constexpr, OUT_TABLE: tl.constexpr, OUT_DT: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """out[e][:, col0:col0+BLOCK_N] tile (+)= acc; with ACCUMULATE an empty expert leaves out[e]
    untouched. OUT_TABLE: out_ptr is an int64 [E] table of each expert's M x N matrix address."""
    if OUT_TABLE:
        base = tl.multiple_of(tl.load(out_ptr + e).to(tl.pointer_type(OUT_DT)), 16)
    else:
        base = out_ptr + e.to(tl.int64) * M * N
    row_ptrs = base + offs_m.to(tl.int64)[:, None] * N
    m_ok = offs_m < M
    if ACCUMULATE:
        # In column quarters: a 128x256 fp32 tile and the values it adds to do not fit in
        # registers side by side (ptxas: 420 B of spills). Same sums, same bits.
        Q: tl.constexpr = BLOCK_N // 4
        live = row_end > row_start
        parts = tl.reshape(acc, (acc.shape[0], 2, 2, Q))
        p_lo, p_hi = tl.split(tl.permute(parts, (0, 2, 3, 1)))
        p0, p1 = tl.split(tl.permute(p_lo, (0, 2, 1)))
        p2, p3 = tl.split(tl.permute(p_hi, (0, 2, 1)))
        c = col0 + tl.arange(0, Q)
        _add_wgrad_part(p0, row_ptrs, m_ok, c, N, live, OUT_DT)
        _add_wgrad_part(p1, row_ptrs, m_ok, c + Q, N, live, OUT_DT)
        _add_wgrad_part(p2, row_ptrs, m_ok, c + 2 * Q, N, live, OUT_DT)
        _add_wgrad_part(p3, row_ptrs, m_ok, c + 3 * Q, N, live, OUT_DT)
    else:
        offs_n = col0 + tl.arange(0, BLOCK_N)
        mask = m_ok[:, None] & (offs_n < N)[None, :]
        tl.store(row_ptrs + offs_n[None, :], acc.to(OUT_DT), mask=mask)


@triton.jit
def _grouped_mm_wgrad_kernel(
    a_addr_ptr, b_addr_ptr, offsets_ptr, out_ptr, M, N,
    E: tl.constexpr, IN_DT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, IEEE: tl.constexpr,
    OUT_TABLE: tl.constexpr, OUT_DT: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_expert = num_m * num_n
    total = E * per_expert
    a_base = load_ptr(a_addr_ptr, IN_DT)
    b_base = load_ptr(b_addr_ptr, IN_DT)
    if USE_TMA:
        # NOTE: one descriptor per operand over every row; a descriptor per expert cannot be
        # rebuilt per tile cheaply, so each expert's ragged last block uses masked loads.
        all_rows = tl.maximum(tl.load(offsets_ptr + E), 1)
        a_desc = tl.make_tensor_descriptor(a_base, shape=[all_rows, M], strides=[M, 1],
                                           block_shape=[BLOCK_K, BLOCK_M])
        b_desc = tl.make_tensor_descriptor(b_base, shape=[all_rows, N], strides=[N, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    offs_k = tl.arange(0, BLOCK_K)
    for t in tl.range(pid, total, nprog):
        e = t // per_expert
        pid_m, pid_n = swizzle(t % per_expert, num_m, num_n, GROUP_M)
        row_start = tl.load(offsets_ptr + e)
        row_end = tl.load(offsets_ptr + e + 1)
        n_full = (row_end - row_start) // BLOCK_K
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA:
            for i in tl.range(0, n_full):
                r = row_start + i * BLOCK_K
                a = a_desc.load([r, pid_m * BLOCK_M])
                b = b_desc.load([r, pid_n * BLOCK_N])
                acc = _dot_t(a, b, acc, IEEE)
        else:
            # NOTE: masks, not clamped indices, along M and N: those are the contiguous dims.
            rk = row_start + offs_k
            a_ptrs = a_base + rk.to(tl.int64)[:, None] * M + offs_m[None, :]
            b_ptrs = b_base + rk.to(tl.int64)[:, None] * N + offs_n[None, :]
            for i in tl.range(0, n_full):
                a = tl.load(a_ptrs, mask=m_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
                acc = _dot_t(a, b, acc, IEEE)
                a_ptrs += BLOCK_K * M
                b_ptrs += BLOCK_K * N
        r_tail = row_start + n_full * BLOCK_K
        if r_tail < row_end:
            rk = r_tail + offs_k
            r_ok = rk < row_end
            a = tl.load(a_base + rk.to(tl.int64)[:, None] * M + offs_m[None, :],
                        mask=r_ok[:, None] & m_ok[None, :], other=0.0)
            b = tl.load(b_base + rk.to(tl.int64)[:, None] * N + offs_n[None, :],
                        mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc = _dot_t(a, b, acc, IEEE)
        _store_wgrad_tile(acc, out_ptr, e, offs_m, pid_n * BLOCK_N, M, N, row_start, row_end,
                          ACCUMULATE, OUT_TABLE, OUT_DT, BLOCK_N)


def grouped_mm_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    expert_offsets: torch.Tensor,
    out: "torch.Tensor | ExpertOutTable",
    *,
    accumulate: bool = False,
    dtype: Optional[torch.dtype] = None,
    config: Optional[GroupedGemmConfig] = None,
    num_programs: Optional[int] = None,
) -> None:
    """WGRAD grouped GEMM: out[e] (+)= a_e.T @ b_e over the rows of expert e (fp32 accumulation).

    a               [R, M] dense (row stride M): device pointer (int64 [1]) or dense tensor.
    b               [R, N] dense (row stride N): device pointer or dense tensor.
    expert_offsets  int32 [E+1] device cumulative row ends.
    out             [E, M, N] contiguous tensor, bf16 or fp32 (fp16/fp32 also for the
                    interpreter), or an ExpertOutTable (E separate M x N matrices). Experts
                    with no rows get zeros, or stay untouched when accumulate=True (which
                    needs an fp32 out: out[e] += a_e.T @ b_e).
    dtype           dtype of a and b; default: theirs when tensors, else bfloat16.
    num_programs    persistent grid size (default: one program per SM).
    """
    table = isinstance(out, ExpertOutTable)
    if table:
        out_ptr, out_dtype = out.addrs, out.dtype
    else:
        assert out.dim() == 3 and out.is_contiguous(), "out must be a contiguous [E, M, N] tensor"
        out_ptr, out_dtype = out, out.dtype
    assert out_dtype in TL_DTYPES, f"out dtype {out_dtype} not supported"
    assert not accumulate or out_dtype == torch.float32, "accumulate=True needs an fp32 out"
    num_experts, m, n = out.shape
    check_offsets(expert_offsets, num_experts, out.device)
    if dtype is None:
        dtype = a.dtype if a.dtype != torch.int64 else torch.bfloat16
    assert dtype in TL_DTYPES, f"input dtype {dtype} not supported"
    a_addr = as_device_ptr(a, "a", dtype)
    b_addr = as_device_ptr(b, "b", dtype)
    config = config or select_config("wgrad", n=n, kd=m, device=out.device)
    if config.tma:
        size = torch.empty((), dtype=dtype).element_size()
        assert (m * size) % 16 == 0 and (n * size) % 16 == 0, "TMA needs 16-byte row strides"
        if out.device.type == "cuda":
            ensure_tma_allocator()
    tiles = num_experts * triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if tiles == 0:
        return
    progs = num_programs or default_num_programs(out.device)
    _grouped_mm_wgrad_kernel[(min(tiles, progs),)](
        a_addr_ptr=a_addr, b_addr_ptr=b_addr, offsets_ptr=expert_offsets, out_ptr=out_ptr,
        M=m, N=n, E=num_experts, IN_DT=TL_DTYPES[dtype], BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        ACCUMULATE=accumulate, USE_TMA=config.tma, IEEE=dtype == torch.float32 or interpreting(),
        OUT_TABLE=table, OUT_DT=TL_DTYPES[out_dtype], num_warps=config.num_warps,
        num_stages=config.num_stages)

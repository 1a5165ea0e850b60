"""NVFP4 grouped GEMM (FPROP, inference): out rows of expert e = A_e @ W[e]^T, both operands NVFP4.

    A   NVFP4 byte rows [R, nvfp4_row_bytes(K)] (layout.py: packed E2M1 | E4M3 scales per 16 |
        the row's fp32 S_dec), expert-major
    W   a prepared weight (prepared.PreparedWeight): packed [E, N, K/2], E4M3 scales per 16 x 16
        tile [E, N/16, K/16], fp32 S_enc [E]

Hopper has no FP4 instruction. E2M1 values (at most two significant bits) times an E4M3 scale
(at most four) are exact fp16 values in fp16's normal range, so each program decodes its A and
W tiles into fp16 in registers (bit placement plus two multiplies, _decode_f16; on the GPU in
packed PTX, about three instructions per value) and feeds the fp16 tensor cores: the products
are exactly those of the dequantized values up to the two global scales, which the epilogue
applies per row and per expert (fp32 accumulation; the twin, quant/nvfp4, multiplies the global
scale into each value first: the two differ by fp32 rounding). What the kernel reads is 4.5
bits per weight, the decode regime's cost.

Epilogues: "store" (bf16 [R, N] at a device pointer) or "scatter" (row r to out_row_ptrs[r],
skipped where 0: the owners' combine rows). Persistent over the device tile list (tiles.py).
Tiles (Nvfp4Tiles): 16- and 32-row tiles in the decode regime (mma.sync: few rows per expert,
every weight read once or twice), 128 x 256 tiles at training-size row counts (wgmma: the decoded tiles pass
through shared memory; tests/cpu/test_kernels_compile_sm90.py records the PTX). Both are
measured on the GPU by benchmarks/bench_nvfp4_gemm.py and bench_decode.py. Where the CUDA
library of nvfp4_decode.py loads (Execution.nvfp4_gemm) the CUDA backend runs its C++ kernels
instead (the decode GEMM up to 16 rows per expert, about 1.8x faster there; nvfp4_wgmma.py
above): this kernel is the fallback, and the interpreter's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ...layout import nvfp4_row_bytes
from ..quant_nvfp4 import _decode_f16, _decode_f16_asm
from ..common import as_device_ptr, check_offsets, check_rows, default_num_programs, interpreting, load_ptr
from .mm import _dot   # fp32 products in the interpreter
from .tiles import expert_segments, tile_bound, tile_coords, tile_list

__all__ = ["nvfp4_grouped_mm", "NVFP4_EPILOGUES", "Nvfp4Tiles", "DECODE_TILES", "SMALL_TILES",
           "MEDIUM_TILES", "LARGE_TILES", "default_tiles"]

NVFP4_EPILOGUES = ("store", "scatter")


@triton.jit
def _nvfp4_mm_kernel(a_addr, a16_addr, w_packed, w_scales, w_senc, offsets_ptr, out_addr,
                     out_rows_ptr,
                     N, K, A_STRIDE, E: tl.constexpr, E_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EPILOGUE: tl.constexpr, IEEE: tl.constexpr,
                     ASM: tl.constexpr, A_F16: tl.constexpr):
    pid = tl.program_id(0)
    e_idx, starts, ends, m_tiles = expert_segments(offsets_ptr, E, E_PAD, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles, cum, total = tile_list(m_tiles, num_n)
    nprog = tl.num_programs(0)
    a_base = load_ptr(a_addr, tl.uint8)
    if A_F16:
        a16_base = load_ptr(a16_addr, tl.float16)
    else:
        a16_base = a16_addr.to(tl.pointer_type(tl.float16), bitcast=True)   # never read
    kk = tl.arange(0, BLOCK_K)
    ka = tl.arange(0, BLOCK_K // 2)
    ks = tl.arange(0, BLOCK_K // 16)
    KT = K // 16                          # scale columns of a weight row block
    for t in tl.range(pid, total, nprog):
        e, row_start, row_end, m_first, pid_m, pid_n = tile_coords(
            t, e_idx, cum, tiles, starts, ends, m_tiles, num_n, GROUP_M)
        rows = row_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows_ld = tl.minimum(rows, row_end - 1).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        cols_ld = tl.minimum(cols, N - 1).to(tl.int64)
        e64 = e.to(tl.int64)
        a_rows = a_base + rows_ld[:, None] * A_STRIDE
        a16_rows = a16_base + rows_ld[:, None] * K
        w_rows = w_packed + (e64 * N + cols_ld)[:, None] * (K // 2)
        ws_rows = w_scales + (e64 * (N // 16) + cols_ld // 16)[:, None] * KT
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K):
            wp = tl.load(w_rows + k // 2 + ka[None, :])
            wsc = tl.load(ws_rows + k // 16 + ks[None, :]).to(tl.float8e4nv, bitcast=True)
            if A_F16:       # A decoded once (quant_nvfp4.dequantize_rows), not per n-tile
                a = tl.load(a16_rows + k + kk[None, :])
            else:
                ap = tl.load(a_rows + k // 2 + ka[None, :])
                asc = tl.load(a_rows + K // 2 + k // 16 + ks[None, :]).to(tl.float8e4nv,
                                                                         bitcast=True)
                if ASM:
                    a = _decode_f16_asm(ap, asc.to(tl.float16), BLOCK_M, BLOCK_K)
                else:
                    a = _decode_f16(ap, asc.to(tl.float16), BLOCK_M, BLOCK_K)
            if ASM:
                w = _decode_f16_asm(wp, wsc.to(tl.float16), BLOCK_N, BLOCK_K)
            else:
                w = _decode_f16(wp, wsc.to(tl.float16), BLOCK_N, BLOCK_K)
            acc = _dot(a, tl.trans(w), acc, IEEE)
        s_row = tl.load((a_rows + K // 2 + K // 16).to(tl.pointer_type(tl.float32)))  # [BM, 1]
        # S_dec = 1 / S_enc correctly rounded (quant/nvfp4.global_decode_scale), read from the
        # prepared weight each launch, so a graph replay sees weights updated in place
        acc = acc * s_row * tl.math.div_rn(1.0, tl.load(w_senc + e64))
        mask = row_ok[:, None] & col_ok[None, :]
        if EPILOGUE == 0:
            o = load_ptr(out_addr, tl.bfloat16)
            tl.store(o + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(tl.bfloat16),
                     mask=mask)
        else:
            o_addr = tl.load(out_rows_ptr + rows, mask=row_ok, other=0)
            o_row = tl.multiple_of(o_addr.to(tl.pointer_type(tl.bfloat16)), [16])
            tl.store(o_row[:, None] + cols[None, :], acc.to(tl.bfloat16),
                     mask=mask & (o_addr != 0)[:, None])


@dataclass(frozen=True)
class Nvfp4Tiles:
    """Tile shape and launch of the NVFP4 GEMM. block_m >= 64 lets Triton use wgmma (both
    operands pass through shared memory after the decode); block_m = 16 runs mma.sync, the
    decode regime's shape, where a few rows per expert meet every weight once."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3
    programs_per_sm: int = 1


# by rows per expert on average (max_rows / E): <= 16 / <= 64 / <= 128 / more (the best of
# bench_nvfp4_gemm --sweep on one H200 for each; 256-row tiles decode each weight tile half as
# often as 128-row ones, which pays once an expert has more than 128 rows); the interpreter
# runs small tiles
DECODE_TILES = Nvfp4Tiles(16, 64, 128, 4, 3, 4)
SMALL_TILES = Nvfp4Tiles(32, 128, 128, 4, 3, 2)
MEDIUM_TILES = Nvfp4Tiles(128, 128, 64, 8)
LARGE_TILES = Nvfp4Tiles(256, 128, 64, 8, 4)
INTERP_TILES = Nvfp4Tiles(16, 32, 128, 4)
DECODES = ("f16_asm", "f16")


def default_tiles(max_rows: int, E: int) -> Nvfp4Tiles:
    """Tiles by max_rows / E: the row capacity per expert (the context's scratch bound, which
    at EP > 1 exceeds the balanced rows by the device scratch factor), not the call's rows."""
    return (DECODE_TILES if max_rows <= 16 * E else SMALL_TILES if max_rows <= 64 * E
            else MEDIUM_TILES if max_rows <= 128 * E else LARGE_TILES)


def launch_tiles(max_rows: int, E: int, device: torch.device) -> Nvfp4Tiles:
    """The launcher's default: default_tiles on a GPU, the interpreter's small tiles on CPU."""
    on_cpu = device.type != "cuda" or interpreting()
    return INTERP_TILES if on_cpu else default_tiles(max_rows, E)


def nvfp4_grouped_mm(*, a, weight, expert_offsets: torch.Tensor, max_rows: int,
                     epilogue: str = "store", out=None, out_row_ptrs=None, a16=None,
                     tiles: Optional[Nvfp4Tiles] = None, decode: Optional[str] = None,
                     num_programs: Optional[int] = None) -> None:
    """Row r of expert e gets dequant(A[r]) @ dequant(W[e])^T, in bf16 (see the module docstring).

    a               NVFP4 byte rows [>= R, nvfp4_row_bytes(K)] (tensor or device pointer)
    a16             optional fp16 [>= R, K]: a's values before the rows' global scales
                    (quant_nvfp4.dequantize_rows), read instead of decoding a in every
                    program; each row's S_dec still comes from a, and nothing else does (the
                    pipeline's x_g and h2q rows hold only their S_dec: s_dec_only)
    weight          a prepared.PreparedWeight [E, N, K] (16 x 16 tile scales)
    expert_offsets  int32 [E+1] device, R = expert_offsets[E] (never read on the host)
    max_rows        host bound on R (the grid)
    epilogue        "store": out [R, N] bf16; "scatter": out_row_ptrs int64 [>= max_rows]
    tiles           default: default_tiles(max_rows, E)
    decode          "f16_asm" (the GPU's: packed PTX) | "f16" (the same bits in Triton ops: the
                    interpreter's)
    """
    assert epilogue in NVFP4_EPILOGUES, f"epilogue must be one of {NVFP4_EPILOGUES}"
    E, N, K = weight.shape
    assert K % 128 == 0 and N % 16 == 0, f"[N={N}, K={K}]: K % 128 and N % 16 must be 0"
    assert tuple(weight.scales.shape) == (E, N // 16, K // 16), (
        f"weight scales {tuple(weight.scales.shape)}: expected 16 x 16 tiles {(E, N // 16, K // 16)}")
    dev = weight.packed.device
    check_offsets(expert_offsets, E, dev)
    out_addr = out_rows = expert_offsets
    if epilogue == "store":
        assert out is not None, "epilogue='store' needs out"
        out_addr = as_device_ptr(out, "out", torch.bfloat16)
    else:
        assert out_row_ptrs is not None, "epilogue='scatter' needs out_row_ptrs"
        check_rows(out_row_ptrs, "out_row_ptrs", max_rows, dev)
        out_rows = out_row_ptrs
    on_cpu = dev.type != "cuda" or interpreting()
    tiles = tiles or launch_tiles(max_rows, E, dev)
    decode = decode or ("f16" if on_cpu else "f16_asm")
    assert decode in DECODES, f"decode must be one of {sorted(DECODES)}"
    assert not (interpreting() and decode == "f16_asm"), "the interpreter cannot run inline PTX"
    assert K % tiles.block_k == 0 and tiles.block_k % 16 == 0, (
        f"K={K} must be a multiple of block_k={tiles.block_k}")
    progs = num_programs or default_num_programs(dev) * tiles.programs_per_sm
    bn = tiles.block_n
    grid = (max(1, min(progs, tile_bound(max_rows, tiles.block_m, E, triton.cdiv(N, bn)))),)
    senc = weight.global_scale
    assert senc.dtype == torch.float32 and senc.is_contiguous() and senc.device == dev, (
        "weight.global_scale must be a contiguous fp32 tensor on the weights' device")
    a16_addr = as_device_ptr(a16, "a16", torch.float16) if a16 is not None else expert_offsets
    _nvfp4_mm_kernel[grid](as_device_ptr(a, "a"), a16_addr, weight.packed,
                           weight.scales.view(torch.uint8),
                           senc, expert_offsets, out_addr, out_rows, N, K, nvfp4_row_bytes(K),
                           E=E, E_PAD=max(2, triton.next_power_of_2(E)), BLOCK_M=tiles.block_m,
                           BLOCK_N=bn, BLOCK_K=tiles.block_k, GROUP_M=8,
                           EPILOGUE=NVFP4_EPILOGUES.index(epilogue), IEEE=on_cpu,
                           ASM=decode == "f16_asm", A_F16=a16 is not None,
                           num_warps=tiles.num_warps,
                           num_stages=tiles.num_stages)

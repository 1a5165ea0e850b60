"""NVFP4 grouped GEMM (FPROP, inference): out rows of expert e = A_e @ W[e]^T, both operands NVFP4.

    A   NVFP4 byte rows [R, nvfp4_row_bytes(K)] (layout.py: packed E2M1 | E4M3 scales per 16 |
        the row's fp32 S_dec), expert-major
    W   a prepared weight (prepared.PreparedWeight): packed [E, N, K/2], E4M3 scales per 16 x 16
        tile [E, N/16, K/16], fp32 S_enc [E]

Hopper has no FP4 instruction. E2M1 values (at most two significant bits) times an E4M3 scale
(at most four) are bf16 values, so each program decodes its A and W tiles into bf16 in registers
and feeds the bf16 tensor cores: the products are exactly those of the dequantized values up to
the two global scales, which the epilogue applies per row and per expert (fp32 accumulation;
the twin, quant/nvfp4, multiplies the global scale into each value first: the two differ by
fp32 rounding). What the kernel reads is 4.5 bits per weight, the decode regime's cost.

Epilogues: "store" (bf16 [R, N] at a device pointer) or "scatter" (row r to out_row_ptrs[r],
skipped where 0: the owners' combine rows). Persistent over the device tile list (tiles.py).
With both operands decoded in registers Triton emits mma.sync rather than wgmma for sm_90
(tests/cpu/test_kernels_compile_sm90.py records the PTX); at decode sizes the weight read is
the cost, at T = 2048 the MMA rate is: both are measured on the GPU (benchmarks/bench_decode.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...layout import nvfp4_row_bytes
from ..common import as_device_ptr, check_offsets, check_rows, default_num_programs, interpreting, load_ptr
from .tiles import expert_segments, tile_bound, tile_coords, tile_list

__all__ = ["nvfp4_grouped_mm", "NVFP4_EPILOGUES", "e2m1_value"]

NVFP4_EPILOGUES = ("store", "scatter")


@triton.jit
def e2m1_value(code):
    """fp32 value of int32 E2M1 codes (0..15): magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6, sign bit 8."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _decode(packed, scales16, ROWS: tl.constexpr, BK: tl.constexpr):
    """bf16 [ROWS, BK] of packed bytes [ROWS, BK/2] with one fp32 scale per 16 values
    [ROWS, BK/16] (exact: E2M1 x E4M3 fits bf16)."""
    b = packed.to(tl.int32)
    codes = tl.reshape(tl.join(b & 0xF, b >> 4), (ROWS, BK))         # element 2j: low nibble
    v = tl.reshape(e2m1_value(codes), (ROWS, BK // 16, 16)) * scales16[:, :, None]
    return tl.reshape(v, (ROWS, BK)).to(tl.bfloat16)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:   # the interpreter's bf16 dot is wrong; fp32 products of bf16 values are exact
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _nvfp4_mm_kernel(a_addr, w_packed, w_scales, w_sdec, offsets_ptr, out_addr, out_rows_ptr,
                     N, K, A_STRIDE, E: tl.constexpr, E_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EPILOGUE: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    e_idx, starts, ends, m_tiles = expert_segments(offsets_ptr, E, E_PAD, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles, cum, total = tile_list(m_tiles, num_n)
    nprog = tl.num_programs(0)
    a_base = load_ptr(a_addr, tl.uint8)
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
        w_rows = w_packed + (e64 * N + cols_ld)[:, None] * (K // 2)
        ws_rows = w_scales + (e64 * (N // 16) + cols_ld // 16)[:, None] * KT
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K):
            ap = tl.load(a_rows + k // 2 + ka[None, :])
            asc = tl.load(a_rows + K // 2 + k // 16 + ks[None, :]).to(tl.float8e4nv,
                                                                     bitcast=True)
            a = _decode(ap, asc.to(tl.float32), BLOCK_M, BLOCK_K)
            wp = tl.load(w_rows + k // 2 + ka[None, :])
            wsc = tl.load(ws_rows + k // 16 + ks[None, :]).to(tl.float8e4nv, bitcast=True)
            w = _decode(wp, wsc.to(tl.float32), BLOCK_N, BLOCK_K)
            acc = _dot(a, tl.trans(w), acc, IEEE)
        s_row = tl.load((a_rows + K // 2 + K // 16).to(tl.pointer_type(tl.float32)))  # [BM, 1]
        acc = acc * s_row * tl.load(w_sdec + e64)
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


def nvfp4_grouped_mm(*, a, weight, expert_offsets: torch.Tensor, max_rows: int,
                     epilogue: str = "store", out=None, out_row_ptrs=None,
                     block_m: Optional[int] = None, num_programs: Optional[int] = None) -> None:
    """Row r of expert e gets dequant(A[r]) @ dequant(W[e])^T, in bf16 (see the module docstring).

    a               NVFP4 byte rows [>= R, nvfp4_row_bytes(K)] (tensor or device pointer)
    weight          a prepared.PreparedWeight [E, N, K] (16 x 16 tile scales)
    expert_offsets  int32 [E+1] device, R = expert_offsets[E] (never read on the host)
    max_rows        host bound on R (the grid)
    epilogue        "store": out [R, N] bf16; "scatter": out_row_ptrs int64 [>= max_rows]
    block_m         rows per tile (default: 16 for the decode regime, max_rows <= 64 per expert
                    on average, else 64); BLOCK_N 64 and BLOCK_K 128
    """
    from ...quant.nvfp4 import global_decode_scale
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
    bm = block_m or (16 if max_rows <= 64 * E else 64)
    if on_cpu:
        bm = min(bm, 16)
    bn, bk = (32, 128) if on_cpu else (64, 128)
    progs = num_programs or default_num_programs(dev)
    grid = (max(1, min(progs, tile_bound(max_rows, bm, E, triton.cdiv(N, bn)))),)
    sdec = global_decode_scale(weight.global_scale).to(dev).contiguous()
    _nvfp4_mm_kernel[grid](as_device_ptr(a, "a"), weight.packed, weight.scales.view(torch.uint8),
                           sdec, expert_offsets, out_addr, out_rows, N, K, nvfp4_row_bytes(K),
                           E=E, E_PAD=max(2, triton.next_power_of_2(E)), BLOCK_M=bm,
                           BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                           EPILOGUE=NVFP4_EPILOGUES.index(epilogue), IEEE=on_cpu,
                           num_warps=4, num_stages=3)

"""FP8 block-scaled persistent grouped GEMMs (Triton, sm_90): the fp8_block precision's kernels.

    fp8_grouped_mm     out[r, :] = (a[r, :] @ w[e].T)  A: a row bundle [R, Kd] (1 x 128
                       scales), W: [E, N, Kd] with 128 x 128 tile scales (K-major: FPROP reads
                       W13 / W2, DGRAD their transposed copies, quant/fp8_block.Fp8Weights)
    fp8_grouped_wgrad  out[e] (+)= a_e^T b_e over each expert's padded token blocks; both
                       operands column bundles ([M, Rp] / [N, Rp] E4M3, tokens contiguous, with
                       [Rp/128, M] / [Rp/128, N] scales)

Block scaling on Hopper: the tensor cores accumulate the E4M3 products of one 128-wide K block
in fp32 (`tl.dot` from zero); the block's partial sum is then scaled by its A row scale and
the W tile scale (or, in WGRAD, the A and B column scales) and added to the fp32 accumulator
(promotion every 128 of K, DeepSeek-V3's recipe). Tiles are 64 or 128 rows x 128 x 128, so one W tile
scale covers a whole output tile.

Epilogues of fp8_grouped_mm:
    store       bf16 out [R, N] dense at a device pointer (the W13 FPROP's h1)
    scatter     bf16 row r to the address out_row_ptrs[r] (the owners' combine or dispatch rows)
    swiglu_bwd  (W2 DGRAD, N = F) the u = W2^T g3 tile never leaves the kernel: with h1 from its
                saved row bundle, grad_h1 = act'(h1) round(s u) (bf16, [R, 2F]) and h2 =
                round(s act(h1)) (bf16, the W2 WGRAD operand) are stored; with score pointers
                (s from the owner) each tile's <u, round(act(h1))> per row goes to its part slot
                as in the bf16 kernel; without, s = 1
All math is quant/fp8_block.py's and reference_math.Fp8BlockMath's. In the CPU interpreter the
fp8 operands are widened to fp32 before the dot, and bf16 rounding uses the integer twin
(quant_fp8.round_bf16): the interpreter's own conversion truncates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import (as_device_ptr, check_offsets, check_rows, default_num_programs,
                      ensure_tma_allocator, interpreting, load_ptr, HAS_TMA)
from ..quant_fp8 import round_bf16
from ..rows import swiglu_grad
from .tiles import expert_segments, swizzle, tile_bound, tile_coords, tile_list
from .wgrad import ExpertOutTable, _store_wgrad_tile

__all__ = ["fp8_grouped_mm", "fp8_grouped_wgrad", "FP8_EPILOGUES", "Fp8GemmConfig",
           "FP8_CONFIG", "FP8_INTERPRETER_CONFIG", "fp8_config"]

FP8_EPILOGUES = ("store", "scatter", "swiglu_bwd")
_F8 = torch.float8_e4m3fn


@dataclass(frozen=True, repr=False)
class Fp8GemmConfig:
    """Tile and launch parameters (block_k is the 128 of the scaling blocks). programs_per_sm
    > 1 keeps several persistent programs resident on each SM: Triton waits for each block's
    wgmma before scaling its partial sum, so one program's scaling and loads can only overlap
    another program's tensor-core work."""

    block_m: int = 128
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False
    programs_per_sm: int = 1

    def __post_init__(self):
        assert self.block_n <= 128 and 128 % self.block_n == 0 and self.block_m % 16 == 0

    def replace(self, **kw) -> "Fp8GemmConfig":
        return dataclasses.replace(self, **kw)

    def __repr__(self):
        return (f"{self.block_m}x{self.block_n}x128 g{self.group_m} w{self.num_warps} "
                f"s{self.num_stages} p{self.programs_per_sm}{' tma' if self.tma else ''}")


# 64 x 128 x 128, one warpgroup, two persistent programs per SM (175-255 registers: two fit):
# on one H200 every fp8 GEMM of the guide shape ran 11-21% faster than with 128 x 128 tiles of
# two warpgroups and one program per SM (bench_fp8_gemm --sweep; docs/decisions.md).
FP8_CONFIG = Fp8GemmConfig(64, 128, 16, 4, 3, tma=HAS_TMA, programs_per_sm=2)
FP8_INTERPRETER_CONFIG = Fp8GemmConfig(32, 32, 2, 4, 1, tma=False)


def fp8_config(device: torch.device) -> Fp8GemmConfig:
    """The table's config for a launch on `device` (the interpreter's tiny tiles on CPU)."""
    return FP8_CONFIG if device.type == "cuda" and not interpreting() else FP8_INTERPRETER_CONFIG


@triton.jit
def _dot_nt(a, b, IEEE: tl.constexpr):
    """a [BM, 128] @ b[BN, 128]^T in fp32 from zero (one scaling block of K)."""
    if IEEE:   # the interpreter: exact fp32 products of the widened E4M3 values
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b))


@triton.jit
def _to_bf16(x, HW: tl.constexpr):
    if HW:
        return x.to(tl.bfloat16)
    return round_bf16(x, HW).to(tl.bfloat16)


@triton.jit
def _halves(x, BLOCK_M: tl.constexpr, H: tl.constexpr):
    """The two H-wide column halves of a [BLOCK_M, 2H] tile."""
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, H)), (0, 2, 1)))


@triton.jit
def _swiglu_bwd_half(u, s, rows64, row_ok, col0, h1q_base, h1s_base, gh1_base, h2_base, F,
                     alpha, limit, H: tl.constexpr, CLAMPED: tl.constexpr,
                     SCORED: tl.constexpr, HW: tl.constexpr):
    """grad_h1 and h2 for columns [col0, col0 + H) of a u tile (see the module docstring);
    returns the half's <u, round(act(h1))> per row (scored)."""
    mask = row_ok[:, None]
    cols = col0 + tl.arange(0, H)
    nb = (2 * F) // 128
    gq = tl.load(h1q_base + rows64[:, None] * (2 * F) + cols[None, :], mask=mask, other=0.0)
    uq = tl.load(h1q_base + rows64[:, None] * (2 * F) + F + cols[None, :], mask=mask, other=0.0)
    cb = col0 // 128
    sg = tl.load(h1s_base + rows64 * nb + cb, mask=row_ok, other=0.0)
    su = tl.load(h1s_base + rows64 * nb + F // 128 + cb, mask=row_ok, other=0.0)
    g = gq.to(tl.float32) * sg[:, None]
    v = uq.to(tl.float32) * su[:, None]
    if SCORED:
        dh = round_bf16(s[:, None] * u, HW)
    else:
        dh = round_bf16(u, HW)
    dg, du, h2v = swiglu_grad(g, v, dh, CLAMPED, alpha, limit)
    gp = gh1_base + rows64[:, None] * (2 * F) + cols[None, :]
    tl.store(gp, _to_bf16(dg, HW), mask=mask)
    tl.store(gp + F, _to_bf16(du, HW), mask=mask)
    hp = h2_base + rows64[:, None] * F + cols[None, :]
    if SCORED:
        tl.store(hp, _to_bf16(s[:, None] * h2v, HW), mask=mask)
        return tl.sum(tl.where(mask, u * round_bf16(h2v, HW), 0.0), axis=1)
    else:
        tl.store(hp, _to_bf16(h2v, HW), mask=mask)
        return tl.sum(tl.zeros_like(u), axis=1)


@triton.jit
def _fp8_mm_kernel(a_addr, sa_addr, w_ptr, sw_ptr, offsets_ptr, out_addr, out_rows_ptr,
                   h1q_addr, h1s_addr, h2_addr, N, Kd, alpha, limit, score_grad_delta,
                   part_stride, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, EPILOGUE: tl.constexpr,
                   CLAMPED: tl.constexpr, SCORED: tl.constexpr, USE_TMA: tl.constexpr,
                   IEEE: tl.constexpr, HW: tl.constexpr):
    BK: tl.constexpr = 128
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    e_idx, starts, ends, m_tiles = expert_segments(offsets_ptr, E, E_PAD, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles, cum, total = tile_list(m_tiles, num_n)
    nkb = Kd // BK
    a_base = load_ptr(a_addr, tl.float8e4nv)
    sa_base = load_ptr(sa_addr, tl.float32)
    if USE_TMA:
        num_rows = tl.maximum(tl.load(offsets_ptr + E), 1)
        a_desc = tl.make_tensor_descriptor(a_base, shape=[num_rows, Kd], strides=[Kd, 1],
                                           block_shape=[BLOCK_M, BK])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * N, Kd], strides=[Kd, 1],
                                           block_shape=[BLOCK_N, BK])
    offs_k = tl.arange(0, BK)
    for t in tl.range(pid, total, nprog):
        e, row_start, row_end, _m_first, pid_m, pid_n = tile_coords(
            t, e_idx, cum, tiles, starts, ends, m_tiles, num_n, GROUP_M)
        row0 = row_start + pid_m * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        rows_ld = tl.minimum(rows, row_end - 1).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nb = (pid_n * BLOCK_N) // 128
        sw_e = sw_ptr + e.to(tl.int64) * (N // 128) * nkb + nb * nkb
        if not USE_TMA:
            a_ptrs = a_base + rows_ld[:, None] * Kd + offs_k[None, :]
            w_ptrs = (w_ptr + (e.to(tl.int64) * N + cols[:, None].to(tl.int64)) * Kd
                      + offs_k[None, :])
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in tl.range(0, nkb):
            if USE_TMA:
                a = a_desc.load([row0, kb * BK])
                b = w_desc.load([e * N + pid_n * BLOCK_N, kb * BK])
            else:
                a = tl.load(a_ptrs)
                b = tl.load(w_ptrs)
                a_ptrs += BK
                w_ptrs += BK
            part = _dot_nt(a, b, IEEE)
            sa = tl.load(sa_base + rows_ld * nkb + kb)
            sw = tl.load(sw_e + kb)
            acc += part * (sa * sw)[:, None]
        if EPILOGUE == 0:      # dense bf16 store, row stride N
            out_base = load_ptr(out_addr, tl.bfloat16)
            tl.store(out_base + rows64[:, None] * N + cols[None, :], _to_bf16(acc, HW),
                     mask=row_ok[:, None])
        elif EPILOGUE == 1:    # scatter: row i to address out_rows[i], skipped when 0
            o_addr = tl.load(out_rows_ptr + rows, mask=row_ok, other=0)
            o_row = tl.multiple_of(o_addr.to(tl.pointer_type(tl.bfloat16)), [16])
            tl.store(o_row[:, None] + cols[None, :], _to_bf16(acc, HW),
                     mask=(o_addr != 0)[:, None])
        else:                  # W2 DGRAD + SwiGLU backward (N = F), in column halves
            H: tl.constexpr = BLOCK_N // 2
            if SCORED:
                s_addr = tl.load(out_rows_ptr + rows, mask=row_ok, other=0)
                s_ok = row_ok & (s_addr != 0)
                s = tl.load(s_addr.to(tl.pointer_type(tl.float32)), mask=s_ok, other=0.0)
            else:
                s = tl.zeros((BLOCK_M,), dtype=tl.float32)
            u0, u1 = _halves(acc, BLOCK_M, H)
            h1q_base = load_ptr(h1q_addr, tl.float8e4nv)
            h1s_base = load_ptr(h1s_addr, tl.float32)
            gh1_base = load_ptr(out_addr, tl.bfloat16)
            h2_base = load_ptr(h2_addr, tl.bfloat16)
            c0 = pid_n * BLOCK_N
            part = _swiglu_bwd_half(u0, s, rows64, row_ok, c0, h1q_base, h1s_base, gh1_base,
                                    h2_base, N, alpha, limit, H, CLAMPED, SCORED, HW)
            part += _swiglu_bwd_half(u1, s, rows64, row_ok, c0 + H, h1q_base, h1s_base,
                                     gh1_base, h2_base, N, alpha, limit, H, CLAMPED, SCORED, HW)
            if SCORED:
                p_addr = (s_addr + (score_grad_delta + pid_n.to(tl.int64) * part_stride)).to(
                    tl.pointer_type(tl.float32))
                if HW:   # an exchange, as in the bf16 kernel (mm.py: fewer spills)
                    tl.atomic_xchg(p_addr, part, mask=s_ok, sem="relaxed")
                else:
                    tl.store(p_addr, part, mask=s_ok)


def _bundle(pair, name):
    assert isinstance(pair, (tuple, list)) and len(pair) == 2, (
        f"{name}: an fp8 bundle is (data, scales), device pointers or tensors")
    return as_device_ptr(pair[0], name), as_device_ptr(pair[1], name + " scales")


def fp8_grouped_mm(*, a, w: torch.Tensor, w_scales: torch.Tensor, expert_offsets: torch.Tensor,
                   max_rows: int, epilogue: str, out=None, out_row_ptrs=None, h1q=None,
                   h2=None, score_ptrs=None, score_grad_delta: int = 0, part_stride: int = 0,
                   activation: str = "swiglu", swiglu_alpha: float = 1.702,
                   swiglu_limit: float = 7.0, config: Optional[Fp8GemmConfig] = None,
                   num_programs: Optional[int] = None) -> None:
    """out[r] = a[r] @ w[e]^T with block scales (see the module docstring).

    a         (q [R, Kd] e4m3, s [R, Kd/128] fp32): the A row bundle (tensors or device ptrs)
    w         [E, N, Kd] e4m3 contiguous, w_scales [E, N/128, Kd/128] fp32
    epilogue  "store" (out: bf16 [R, N]) | "scatter" (out_row_ptrs int64 [>= R]) |
              "swiglu_bwd" (N = F; out: grad_h1 bf16 [R, 2F]; h1q: the h1 row bundle; h2:
              bf16 [R, F]; score_ptrs: expert-side score gradients, as grouped_mm_dgrad)
    """
    assert w.dtype == _F8 and w.dim() == 3 and w.is_contiguous(), "w: contiguous [E, N, Kd] e4m3"
    E, N, Kd = w.shape
    dev = w.device
    assert N % 128 == 0 and Kd % 128 == 0, f"N={N}, Kd={Kd}: multiples of 128"
    assert w_scales.shape == (E, N // 128, Kd // 128) and w_scales.dtype == torch.float32
    assert w_scales.is_contiguous() and w_scales.device == dev
    check_offsets(expert_offsets, E, dev)
    assert epilogue in FP8_EPILOGUES, f"epilogue must be one of {FP8_EPILOGUES}"
    qa, sa = _bundle(a, "a")
    dummy = expert_offsets
    out_addr = out_rows = h1q_a = h1s_a = h2_a = dummy
    if epilogue == "store":
        out_addr = as_device_ptr(out, "out", torch.bfloat16)
    elif epilogue == "scatter":
        check_rows(out_row_ptrs, "out_row_ptrs", max_rows, dev)
        out_rows = out_row_ptrs
    else:
        out_addr = as_device_ptr(out, "out (grad_h1)", torch.bfloat16)
        h1q_a, h1s_a = _bundle(h1q, "h1q")
        h2_a = as_device_ptr(h2, "h2", torch.bfloat16)
        if score_ptrs is not None:
            check_rows(score_ptrs, "score_ptrs", max_rows, dev)
            out_rows = score_ptrs
    assert score_ptrs is None or epilogue == "swiglu_bwd"
    config = config or fp8_config(dev)
    hw = dev.type == "cuda" and not interpreting()
    if config.tma and hw:
        ensure_tma_allocator()
    num_n = triton.cdiv(N, config.block_n)
    progs = num_programs or default_num_programs(dev) * config.programs_per_sm
    grid = (max(1, min(progs, tile_bound(max_rows, config.block_m, E, num_n))),)
    _fp8_mm_kernel[grid](
        qa, sa, w, w_scales, expert_offsets, out_addr, out_rows, h1q_a, h1s_a, h2_a, N, Kd,
        float(swiglu_alpha), float(swiglu_limit), int(score_grad_delta), int(part_stride),
        E=E, E_PAD=max(2, triton.next_power_of_2(E)), BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, GROUP_M=config.group_m, EPILOGUE=FP8_EPILOGUES.index(epilogue),
        CLAMPED=activation == "swiglu_clamped", SCORED=score_ptrs is not None,
        USE_TMA=config.tma and hw, IEEE=not hw, HW=hw, num_warps=config.num_warps,
        num_stages=config.num_stages)


@triton.jit
def _fp8_wgrad_kernel(a_addr, sa_addr, b_addr, sb_addr, offsets_ptr, out_ptr, M, N,
                      E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, ACCUMULATE: tl.constexpr,
                      OUT_TABLE: tl.constexpr, OUT_DT: tl.constexpr, USE_TMA: tl.constexpr,
                      IEEE: tl.constexpr):
    BK: tl.constexpr = 128
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_expert = num_m * num_n
    e_idx = tl.arange(0, E_PAD)
    lens = (tl.load(offsets_ptr + e_idx + 1, mask=e_idx < E, other=0)
            - tl.load(offsets_ptr + e_idx, mask=e_idx < E, other=0))
    plen = (lens + 127) // 128 * 128
    pstarts = tl.cumsum(plen, 0) - plen
    # the column bundles' row stride: layout.padded_rows(R, E) of this call's R
    Rp = (tl.load(offsets_ptr + E).to(tl.int64) + 127 * E + 127) // 128 * 128
    a_base = load_ptr(a_addr, tl.float8e4nv)
    b_base = load_ptr(b_addr, tl.float8e4nv)
    sa_base = load_ptr(sa_addr, tl.float32)
    sb_base = load_ptr(sb_addr, tl.float32)
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(a_base, shape=[M, Rp], strides=[Rp, 1],
                                           block_shape=[BLOCK_M, BK])
        b_desc = tl.make_tensor_descriptor(b_base, shape=[N, Rp], strides=[Rp, 1],
                                           block_shape=[BLOCK_N, BK])
    offs_k = tl.arange(0, BK)
    for t in tl.range(pid, E * per_expert, nprog):
        e = t // per_expert
        pid_m, pid_n = swizzle(t % per_expert, num_m, num_n, GROUP_M)
        sel = e_idx == e
        p0 = tl.sum(tl.where(sel, pstarts, 0), 0)
        nblk = tl.sum(tl.where(sel, plen, 0), 0) // BK
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ld = tl.minimum(offs_m, M - 1).to(tl.int64)
        n_ld = tl.minimum(offs_n, N - 1).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in tl.range(0, nblk):
            r = p0 + i * BK
            if USE_TMA:
                a = a_desc.load([pid_m * BLOCK_M, r])
                b = b_desc.load([pid_n * BLOCK_N, r])
            else:
                a = tl.load(a_base + m_ld[:, None] * Rp + r + offs_k[None, :])
                b = tl.load(b_base + n_ld[:, None] * Rp + r + offs_k[None, :])
            part = _dot_nt(a, b, IEEE)
            blk = (r // BK).to(tl.int64)
            sa = tl.load(sa_base + blk * M + m_ld)
            sb = tl.load(sb_base + blk * N + n_ld)
            acc += part * sa[:, None] * sb[None, :]
        # row_start / row_end: 0 / rows of the expert, so an empty expert is skipped when
        # accumulating and stores exact zeros otherwise
        _store_wgrad_tile(acc, out_ptr, e, offs_m, pid_n * BLOCK_N, M, N, p0 * 0,
                          nblk, ACCUMULATE, OUT_TABLE, OUT_DT, BLOCK_N)


def fp8_grouped_wgrad(a, b, expert_offsets: torch.Tensor, out, *, accumulate: bool = False,
                      config: Optional[Fp8GemmConfig] = None,
                      num_programs: Optional[int] = None) -> None:
    """out[e] (+)= a_e^T b_e over expert e's padded token blocks (module docstring).

    a, b  (q_t [M, Rp] / [N, Rp] e4m3, s_t [Rp/128, M] / [Rp/128, N] fp32) column bundles,
          Rp = layout.padded_rows(R, E) for the R = expert_offsets[-1] on the device
    out   [E, M, N] bf16 / fp32 tensor, or an ExpertOutTable (accumulate=True: fp32 +=)
    """
    table = isinstance(out, ExpertOutTable)
    if table:
        out_ptr, out_dtype = out.addrs, out.dtype
    else:
        assert out.dim() == 3 and out.is_contiguous()
        out_ptr, out_dtype = out, out.dtype
    assert out_dtype in (torch.bfloat16, torch.float32)
    assert not accumulate or out_dtype == torch.float32, "accumulate=True needs an fp32 out"
    E, M, N = out.shape
    dev = out.device
    check_offsets(expert_offsets, E, dev)
    assert M % 128 == 0 and N % 128 == 0
    qa, sa = _bundle(a, "a")
    qb, sb = _bundle(b, "b")
    config = config or fp8_config(dev)
    hw = dev.type == "cuda" and not interpreting()
    if config.tma and hw:
        ensure_tma_allocator()
    tiles = E * triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    progs = num_programs or default_num_programs(dev) * config.programs_per_sm
    out_dt = tl.float32 if out_dtype == torch.float32 else tl.bfloat16
    _fp8_wgrad_kernel[(min(tiles, progs),)](
        qa, sa, qb, sb, expert_offsets, out_ptr, M, N, E=E,
        E_PAD=max(2, triton.next_power_of_2(E)), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        GROUP_M=config.group_m, ACCUMULATE=accumulate, OUT_TABLE=table, OUT_DT=out_dt,
        USE_TMA=config.tma and hw, IEEE=not hw, num_warps=config.num_warps,
        num_stages=config.num_stages)

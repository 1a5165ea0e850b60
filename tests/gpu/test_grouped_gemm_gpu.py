"""Grouped GEMM kernels on a Hopper GPU in bf16, against an fp64 oracle.

Error bound. Outputs are bf16 (unit roundoff u = 2^-8), accumulation fp32 over K <= 7168
(worst case K * 2^-24 ~ 4e-4, typically ~sqrt(K) * 2^-24). So the norm-wise relative error
||out - ref|| / ||ref|| of a correct kernel is ~u / sqrt(3) ~ 2.3e-3 (round-to-nearest errors
are roughly uniform in +-u/2 ulp terms), including h2, which both sides compute from the
bf16-rounded h1 (a rare 1-ulp flip of h1 stays inside the same bound). We require
  err <= 1e-2                         (4x margin; any wrong tile, row or expert gives O(1)), and
  err <= 2 * err_torch + 1e-3         where err_torch is the error of the same computation done
                                      by torch in fp32 and rounded to bf16 at the same points,
so the kernel is held to what same-precision torch gets (STYLE.md: tolerances from precision).
Outputs are poisoned with NaN before each call: rows that must be written must hold no NaN,
and rows that must not be written (past R, skipped scatter rows) must still be NaN.

    pytest -m gpu tests/gpu/test_grouped_gemm_gpu.py -v
    pytest -m gpu tests/gpu/test_grouped_gemm_gpu.py -v -k claim     # claim mode only

Claim mode (each m-tile's rows copied once, in column slices, by the programs that reach it,
under atomic counters) is checked exactly (a_copy_out bit-equal to the gathered rows), over
many consecutive launches
with changing segments and grid sizes (races show up as wrong or NaN rows), inside a CUDA graph,
and, with two GPUs, reading the rows from the peer GPU (a subprocess, so that a peer-access
failure cannot poison this process's CUDA context).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a CUDA GPU with sm_90 or newer", allow_module_level=True)

from megatron_dist_moe.kernels.grouped_gemm import (  # noqa: E402
    CONFIG_TABLE, ClaimFlags, device_ptr, grouped_mm_dgrad, grouped_mm_fwd, grouped_mm_wgrad)
from megatron_dist_moe.kernels.grouped_gemm_ref import (  # noqa: E402
    gather_rows_ref, grouped_mm_dgrad_ref, grouped_mm_fwd_ref, grouped_mm_fwd_swiglu_ref,
    grouped_mm_wgrad_ref, swiglu_ref)

DEV = torch.device("cuda")
BF16, F64, F32 = torch.bfloat16, torch.float64, torch.float32
NAN = float("nan")

# (lens per expert, D, F): realistic small shapes with empty and ragged segments, and one at the
# production width with a few hundred rows per expert.
SHAPES = [
    pytest.param([0, 133, 517, 64, 1, 250], 512, 256, id="E6-D512-F256"),
    pytest.param([300, 0, 257, 411], 7168, 3072, id="E4-D7168-F3072"),
]
TMA = [pytest.param(False, id="ptr"), pytest.param(True, id="tma")]


def _cfg(kind, tma):
    return replace(CONFIG_TABLE[(kind, "large")], tma=tma)


def _offsets(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


def _rel(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def _check(name, got, ref64, ref32):
    """got: kernel output; ref64: fp64 oracle; ref32: torch fp32 math rounded like the kernel."""
    assert not torch.isnan(got).any(), f"{name}: {int(torch.isnan(got).sum())} elements not written"
    err, err_torch = _rel(got, ref64), _rel(ref32, ref64)
    assert err <= 1e-2, f"{name}: relative error {err:.2e} > 1e-2"
    assert err <= 2 * err_torch + 1e-3, f"{name}: error {err:.2e} vs same-precision torch {err_torch:.2e}"


def _swiglu_refs(x, w13, offs, **kw):
    """(h1 oracle, h1 torch-fp32, h2 oracle, h2 torch-fp32). The h2 oracle is fp64 math on the
    bf16-rounded h1, i.e. at the kernel's rounding point, and is itself not rounded."""
    r1_64 = grouped_mm_fwd_ref(x, w13, offs, compute_dtype=F64, out_dtype=F64)
    r2_64 = swiglu_ref(r1_64.to(BF16).to(F64), **kw)
    r1_32, r2_32 = grouped_mm_fwd_swiglu_ref(x, w13, offs, compute_dtype=F32, out_dtype=BF16, **kw)
    return r1_64, r1_32, r2_64, r2_32


def _poisoned(*shape, dtype=BF16):
    return torch.full(shape, NAN, dtype=dtype, device=DEV)


def _row_ptrs(base, idx):
    row_bytes = base.stride(0) * base.element_size()
    addr = base.data_ptr() + idx.to(torch.int64) * row_bytes
    return torch.where(idx >= 0, addr, torch.zeros_like(addr))


def _weights(e, rows, cols, scale):
    return (torch.randn(e, rows, cols, device=DEV) * scale).to(BF16)


@pytest.mark.parametrize("tma", TMA)
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_clamped"])
@pytest.mark.parametrize("lens,d,f", SHAPES)
def test_fwd_swiglu_dense(lens, d, f, activation, tma):
    torch.manual_seed(1)
    e, r, max_rows, offs = len(lens), sum(lens), sum(lens) + 100, _offsets(lens)
    x = torch.randn(max_rows, d, device=DEV).to(BF16)
    w13 = _weights(e, 2 * f, d, d ** -0.5 * 2)
    h1, h2 = _poisoned(max_rows, 2 * f), _poisoned(max_rows, f)
    kw = dict(activation=activation, swiglu_alpha=1.702, swiglu_limit=3.0)
    grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=max_rows, a=device_ptr(x), epilogue="swiglu",
                   h1=device_ptr(h1), h2=device_ptr(h2), config=_cfg("fwd", tma), **kw)
    r1_64, r1_32, r2_64, r2_32 = _swiglu_refs(x[:r], w13, offs, **kw)
    _check("h1", h1[:r], r1_64, r1_32)
    _check("h2", h2[:r], r2_64, r2_32)
    assert torch.isnan(h1[r:]).all() and torch.isnan(h2[r:]).all(), "rows past R were written"


# decode-regime rows (<= DECODE_ROWS per expert): the FPROP's decode tiles
DECODE_SHAPES = [
    pytest.param([0, 7, 64, 1, 33, 16], 7168, 3072, id="E6-D7168-F3072"),
    pytest.param([5, 0, 2, 64], 512, 256, id="E4-D512-F256"),
]


@pytest.mark.parametrize("tma", TMA)
@pytest.mark.parametrize("lens,d,f", DECODE_SHAPES)
def test_fwd_decode_tiles(lens, d, f, tma):
    """SwiGLU and scatter FPROPs on the decode tiles, against the oracle; with max_rows / E
    <= DECODE_ROWS the launcher's own choice is those tiles (the same bits)."""
    from megatron_dist_moe.kernels.grouped_gemm.config import DECODE_ROWS
    torch.manual_seed(5)
    e, r, offs = len(lens), sum(lens), _offsets(lens)
    max_rows = e * DECODE_ROWS
    cfg = replace(CONFIG_TABLE[("fwd", "decode")], tma=tma)
    x = torch.randn(max_rows, d, device=DEV).to(BF16)
    w13 = _weights(e, 2 * f, d, d ** -0.5 * 2)
    w2 = _weights(e, d, f, f ** -0.5)
    h1, h2 = _poisoned(max_rows, 2 * f), _poisoned(max_rows, f)
    grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=max_rows, a=x, epilogue="swiglu",
                   h1=h1, h2=h2, config=cfg)
    r1_64, r1_32, r2_64, r2_32 = _swiglu_refs(x[:r], w13, offs)
    _check("h1 (decode tiles)", h1[:r], r1_64, r1_32)
    _check("h2 (decode tiles)", h2[:r], r2_64, r2_32)
    assert torch.isnan(h1[r:]).all() and torch.isnan(h2[r:]).all(), "rows past R were written"
    if tma:
        h1d, h2d = _poisoned(max_rows, 2 * f), _poisoned(max_rows, f)
        grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=max_rows, a=x, epilogue="swiglu",
                       h1=h1d, h2=h2d)
        assert torch.equal(h1d[:r], h1[:r]) and torch.equal(h2d[:r], h2[:r]), (
            "the launcher's default at this row bound is not the decode tiles")
    out = _poisoned(max_rows + 9, d)
    dst_idx = torch.randperm(max_rows + 9, device=DEV)[:max_rows]
    dst_idx[torch.randperm(r, device=DEV)[:3]] = -1
    grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=max_rows, a=h2, epilogue="scatter",
                   out_row_ptrs=_row_ptrs(out, dst_idx), config=cfg)
    ok = dst_idx[:r] >= 0
    ref64 = grouped_mm_fwd_ref(h2[:r], w2, offs, compute_dtype=F64, out_dtype=F64)[ok]
    ref32 = grouped_mm_fwd_ref(h2[:r], w2, offs, compute_dtype=F32, out_dtype=BF16)[ok]
    _check("scatter (decode tiles)", out[dst_idx[:r][ok]], ref64, ref32)
    untouched = torch.ones(max_rows + 9, dtype=torch.bool, device=DEV)
    untouched[dst_idx[:r][ok]] = False
    assert torch.isnan(out[untouched]).all(), "scatter wrote rows it must skip"


@pytest.mark.parametrize("tma", TMA)
@pytest.mark.parametrize("lens,d,f", SHAPES)
def test_fwd_claimed_rows_and_scatter(lens, d, f, tma):
    """Forward as the staged pipeline runs it: rows claimed by address into x_g, SwiGLU, W2
    scatter to the owners' rows."""
    torch.manual_seed(2)
    e, r, max_rows, offs = len(lens), sum(lens), sum(lens) + 64, _offsets(lens)
    tokens = max_rows + 37
    src = torch.randn(tokens, d, device=DEV).to(BF16)  # the token owner's rows (a peer, in prod)
    src_idx = torch.randperm(tokens, device=DEV)[:max_rows]
    src_idx[torch.randperm(r, device=DEV)[:5]] = -1  # rows with address 0 -> zero rows
    w13 = _weights(e, 2 * f, d, d ** -0.5 * 2)
    w2 = _weights(e, d, f, f ** -0.5)
    x_saved = _poisoned(max_rows, d)
    h1, h2 = _poisoned(max_rows, 2 * f), _poisoned(max_rows, f)
    grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=max_rows, a_row_ptrs=_row_ptrs(src, src_idx),
                   a_copy_out=device_ptr(x_saved), claim_flags=ClaimFlags(max_rows, None, e, DEV),
                   epilogue="swiglu", h1=h1, h2=h2, config=_cfg("fwd", tma))
    x = gather_rows_ref(src, src_idx[:r])
    assert torch.equal(x_saved[:r], x), "a_copy_out must hold exactly the gathered rows"
    assert torch.isnan(x_saved[r:]).all(), "a_copy_out rows past R were written"
    r1_64, r1_32, r2_64, r2_32 = _swiglu_refs(x, w13, offs)
    _check("h1 (gathered)", h1[:r], r1_64, r1_32)
    _check("h2 (gathered)", h2[:r], r2_64, r2_32)

    out = _poisoned(tokens, d)  # the token owner's output buffer
    dst_idx = torch.randperm(tokens, device=DEV)[:max_rows]
    dst_idx[torch.randperm(r, device=DEV)[:7]] = -1  # skipped rows
    grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=max_rows, a=h2, epilogue="scatter",
                   out_row_ptrs=_row_ptrs(out, dst_idx), config=_cfg("fwd", tma))
    ok = dst_idx[:r] >= 0
    ref64 = grouped_mm_fwd_ref(h2[:r], w2, offs, compute_dtype=F64, out_dtype=F64)[ok]
    ref32 = grouped_mm_fwd_ref(h2[:r], w2, offs, compute_dtype=F32, out_dtype=BF16)[ok]
    _check("scatter", out[dst_idx[:r][ok]], ref64, ref32)
    untouched = torch.ones(tokens, dtype=torch.bool, device=DEV)
    untouched[dst_idx[:r][ok]] = False
    assert torch.isnan(out[untouched]).all(), "scatter wrote rows it must skip"


@pytest.mark.parametrize("tma", TMA)
@pytest.mark.parametrize("lens,d,f", SHAPES)
def test_dgrad(lens, d, f, tma):
    torch.manual_seed(3)
    e, r, offs = len(lens), sum(lens), _offsets(lens)
    w2 = _weights(e, d, f, f ** -0.5)
    w13 = _weights(e, 2 * f, d, d ** -0.5)
    g3 = torch.randn(r, d, device=DEV).to(BF16)
    g1 = torch.randn(r, 2 * f, device=DEV).to(BF16)
    g2 = _poisoned(r + 16, f)
    grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=r, a=g3, out=device_ptr(g2), config=_cfg("dgrad", tma))
    _check("W2 dgrad", g2[:r], grouped_mm_dgrad_ref(g3, w2, offs, compute_dtype=F64, out_dtype=F64),
           grouped_mm_dgrad_ref(g3, w2, offs, compute_dtype=F32, out_dtype=BF16))
    assert torch.isnan(g2[r:]).all()
    gx = _poisoned(r, d)
    grouped_mm_dgrad(w=w13, expert_offsets=offs, max_rows=r, a=g1, out=gx, config=_cfg("dgrad", tma))
    _check("W13 dgrad", gx, grouped_mm_dgrad_ref(g1, w13, offs, compute_dtype=F64, out_dtype=F64),
           grouped_mm_dgrad_ref(g1, w13, offs, compute_dtype=F32, out_dtype=BF16))


@pytest.mark.parametrize("claim_slice_k", [None, 128, 512])
@pytest.mark.parametrize("clamped", [False, True])
@pytest.mark.parametrize("tma", TMA)
@pytest.mark.parametrize("lens,d,f", SHAPES)
def test_dgrad_swiglu_bwd_epilogue_matches_unfused(lens, d, f, tma, clamped, claim_slice_k):
    """W2 DGRAD with the SwiGLU backward in its epilogue (grad_h1 over h1 in place) gives the
    same bits as DGRAD -> bf16 grad_h2 -> rows.swiglu_bwd."""
    from megatron_dist_moe.kernels import rows as K_rows
    torch.manual_seed(12)
    e, r = len(lens), sum(lens)
    max_rows = r + 16
    offs = _offsets(lens)
    w2 = _weights(e, d, f, f ** -0.5)
    g3 = torch.randn(max_rows, d, device=DEV).to(BF16)
    h1 = (torch.randn(max_rows, 2 * f, device=DEV) * 2).to(BF16)
    act = "swiglu_clamped" if clamped else "swiglu"
    cfg = replace(CONFIG_TABLE[("dgrad", "large")], tma=tma)
    gh2 = _poisoned(max_rows, f)
    grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows, a=g3, out=gh2, config=cfg)
    gh1_ref = _poisoned(max_rows, 2 * f)
    nrows = offs[-1:].clone()
    K_rows.swiglu_bwd(device_ptr(h1), device_ptr(gh2), device_ptr(gh1_ref), nrows, f, max_rows,
                      clamped, 1.702, 7.0)
    h2_ref = _poisoned(max_rows, f)
    K_rows.swiglu_fwd(device_ptr(h1), device_ptr(h2_ref), nrows, f, max_rows, clamped, 1.702, 7.0)
    h1_fused = h1.clone()
    h1_fused[r:] = float("nan")
    h2 = _poisoned(max_rows, f)
    if claim_slice_k is None:   # dense A
        a_kw = dict(a=g3)
    else:                       # A rows gathered by claims (column slices of this width)
        cfg = replace(cfg, claim_slice_k=claim_slice_k)
        idx = torch.arange(max_rows, device=DEV)
        a_kw = dict(a_row_ptrs=_row_ptrs(g3, idx), a_copy_out=_poisoned(max_rows, d),
                    claim_flags=ClaimFlags(max_rows, None, e, DEV))
    grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows, epilogue="swiglu_bwd",
                     h1=device_ptr(h1_fused), h2=device_ptr(h2), activation=act,
                     swiglu_alpha=1.702, swiglu_limit=7.0, config=cfg, **a_kw)
    assert torch.equal(h2[:r], h2_ref[:r]), "rebuilt h2 differs from rows.swiglu_fwd"
    assert torch.isnan(h2[r:]).all(), "h2 rows past R written"
    assert torch.equal(h1_fused[:r], gh1_ref[:r]), (
        f"fused grad_h1 differs from the unfused path in "
        f"{int((h1_fused[:r] != gh1_ref[:r]).sum())} of {r * 2 * f} values")
    assert torch.isnan(h1_fused[r:]).all(), "rows past R written"


@pytest.mark.parametrize("tma", TMA)
@pytest.mark.parametrize("lens,d,f", SHAPES)
def test_dgrad_score_grads_epilogue_matches_row_kernel(lens, d, f, tma):
    """Expert-side score gradients (save_route_outputs=False): the fused W2 DGRAD epilogue
    against DGRAD -> rows.swiglu_fwd -> rows.score_grad_rows -> rows.swiglu_bwd. grad_h1 and
    s*h2 must match to one bf16 rounding of s*u (the fused path rounds s*u once, the unfused
    path rounds u first); the score gradients (per-tile parts summed by rows.sum_score_parts vs
    one row sum) to fp32 summation order. Twice on the same inputs: the same bits (the parts
    are written once each and summed in a fixed order)."""
    from megatron_dist_moe.kernels import rows as K_rows
    torch.manual_seed(13)
    e, r = len(lens), sum(lens)
    max_rows = r + 16
    offs = _offsets(lens)
    w2 = _weights(e, d, f, f ** -0.5)
    gy = torch.randn(max_rows, d, device=DEV).to(BF16)
    h1 = (torch.randn(max_rows, 2 * f, device=DEV) * 2).to(BF16)
    cfg = replace(CONFIG_TABLE[("dgrad", "large")], tma=tma)
    nrows = offs[-1:].clone()
    from megatron_dist_moe.kernels.grouped_gemm import score_parts_count
    n_parts = score_parts_count(f, cfg)
    buf = torch.zeros((1 + n_parts) * max_rows, dtype=F32, device=DEV)   # scores | parts
    buf[:max_rows] = torch.rand(max_rows, device=DEV) + 0.25
    sptr = buf.data_ptr() + torch.arange(max_rows, device=DEV, dtype=torch.int64) * 4
    # unfused reference path
    u = _poisoned(max_rows, f)
    grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows, a=gy, out=u, config=cfg)
    h2_ref = _poisoned(max_rows, f)
    K_rows.swiglu_fwd(device_ptr(h1), device_ptr(h2_ref), nrows, f, max_rows, False, 1.702, 7.0)
    K_rows.score_grad_rows(device_ptr(u), device_ptr(h2_ref), sptr, nrows, f, 4 * max_rows,
                           max_rows)
    gs_ref = buf[max_rows:max_rows + r].clone()
    gh1_ref = _poisoned(max_rows, 2 * f)
    K_rows.swiglu_bwd(device_ptr(h1), device_ptr(u), device_ptr(gh1_ref), nrows, f, max_rows,
                      False, 1.702, 7.0)
    # fused, twice
    ids = torch.zeros(max_rows, 1, dtype=torch.int32, device=DEV)
    runs = []
    for _ in range(2):
        buf[max_rows:] = NAN
        h1_fused, h2 = h1.clone(), _poisoned(max_rows, f)
        grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows, a=gy, epilogue="swiglu_bwd",
                         h1=device_ptr(h1_fused), h2=device_ptr(h2), config=cfg, score_ptrs=sptr,
                         score_grad_delta=4 * max_rows, part_stride=4 * max_rows)
        parts = buf[max_rows:].view(n_parts, max_rows)
        gs_all = torch.empty(max_rows, 1, dtype=F32, device=DEV)
        K_rows.sum_score_parts(parts, n_parts, ids, gs_all)
        torch.cuda.synchronize()
        assert not torch.isnan(parts[:, :r]).any(), "a score-gradient part was not written"
        assert torch.isnan(parts[:, r:]).all(), "score-gradient parts past R written"
        runs.append(gs_all[:r, 0].clone())
    gs = runs[0]
    assert torch.equal(runs[0], runs[1]), "score gradients differ between two identical runs"
    # u enters the unfused sum rounded to bf16 (relative 2^-9 per element): ~2e-3 norm-wise
    assert _rel(gs, gs_ref) < 1e-2, f"score gradients differ: {_rel(gs, gs_ref):.2e}"
    assert _rel(h2[:r], h2_ref[:r]) < 1e-2, f"s*h2 differs: {_rel(h2[:r], h2_ref[:r]):.2e}"
    assert _rel(h1_fused[:r], gh1_ref[:r]) < 1e-2, (
        f"grad_h1 differs: {_rel(h1_fused[:r], gh1_ref[:r]):.2e}")


@pytest.mark.parametrize("tma", TMA)
@pytest.mark.parametrize("lens,d,f", SHAPES)
def test_wgrad_into_expert_table_equals_stacked_accumulate(lens, d, f, tma):
    """routed_experts(wgrad_into=...): accumulating into E separate fp32 matrices (reverse order,
    gaps between them, as in Megatron's grad buffer) gives the bits of accumulating into one
    stacked fp32 tensor; empty experts and the gaps stay untouched."""
    from megatron_dist_moe.kernels.grouped_gemm import ExpertOutTable
    torch.manual_seed(17)
    e, offs, r = len(lens), _offsets(lens), sum(lens)
    a = torch.randn(r, 2 * f, device=DEV).to(BF16)
    b = torch.randn(r, d, device=DEV).to(BF16)
    cfg = replace(CONFIG_TABLE[("wgrad", "large")], tma=tma)
    prev = torch.randn(e, 2 * f, d, device=DEV)
    stacked = prev.clone()
    grouped_mm_wgrad(a, b, offs, stacked, accumulate=True, config=cfg)
    size = 2 * f * d + 64
    buf = torch.full((e * size,), NAN, device=DEV)
    mats = [buf[(e - 1 - i) * size:(e - 1 - i) * size + 2 * f * d].view(2 * f, d) for i in range(e)]
    for i in range(e):
        mats[i].copy_(prev[i])
    grouped_mm_wgrad(a, b, offs, ExpertOutTable.of(mats), accumulate=True, config=cfg)
    for i in range(e):
        assert torch.equal(mats[i], stacked[i]), f"expert {i} (rows {lens[i]}) differs"
    gaps = torch.ones(e * size, dtype=torch.bool, device=DEV)
    for i in range(e):
        gaps[i * size:i * size + 2 * f * d] = False
    assert torch.isnan(buf[gaps]).all(), "memory between the matrices was written"


@pytest.mark.parametrize("tma", TMA)
@pytest.mark.parametrize("lens,d,f", SHAPES)
def test_wgrad_bf16_store_equals_rounded_fp32_store(lens, d, f, tma):
    """The layer stores bf16 weight gradients even for Config.wgrad_dtype="fp32"
    (experts.wgrad_store_dtype): the epilogue rounds the fp32 sums once, exactly as rounding an
    fp32 store afterwards would, so the two give the same bits."""
    torch.manual_seed(16)
    e, offs, r = len(lens), _offsets(lens), sum(lens)
    a = torch.randn(r, 2 * f, device=DEV).to(BF16)
    b = torch.randn(r, d, device=DEV).to(BF16)
    cfg = replace(CONFIG_TABLE[("wgrad", "large")], tma=tma)
    outs = {}
    for out_dtype in (BF16, F32):
        outs[out_dtype] = torch.full((e, 2 * f, d), NAN, dtype=out_dtype, device=DEV)
        grouped_mm_wgrad(a, b, offs, outs[out_dtype], config=cfg)
    rounded = outs[F32].to(BF16)
    assert torch.equal(outs[BF16], rounded), (
        f"bf16 store differs from the rounded fp32 store in {int((outs[BF16] != rounded).sum())} "
        f"of {rounded.numel()} values")


@pytest.mark.parametrize("tma", TMA)
@pytest.mark.parametrize("lens,d,f", SHAPES)
def test_wgrad(lens, d, f, tma):
    torch.manual_seed(4)
    e, r, offs = len(lens), sum(lens), _offsets(lens)
    x = torch.randn(r, d, device=DEV).to(BF16)
    g1 = torch.randn(r, 2 * f, device=DEV).to(BF16)
    full = torch.tensor([n > 0 for n in lens], device=DEV)
    # W13 wgrad, bf16 out: out[e] = g1_e^T @ x_e; empty experts must be zeros
    out = _poisoned(e, 2 * f, d)
    grouped_mm_wgrad(device_ptr(g1), device_ptr(x), offs, out, dtype=BF16, config=_cfg("wgrad", tma))
    _check("W13 wgrad bf16", out[full], grouped_mm_wgrad_ref(g1, x, offs, compute_dtype=F64, out_dtype=F64)[full],
           grouped_mm_wgrad_ref(g1, x, offs, compute_dtype=F32, out_dtype=BF16)[full])
    assert (out[~full] == 0).all(), "empty experts must get zero wgrad"
    # fp32 accumulate: empty experts untouched
    prev = torch.randn(e, 2 * f, d, device=DEV)
    prev[~full] = NAN
    acc = prev.clone()
    grouped_mm_wgrad(g1, x, offs, acc, accumulate=True, config=_cfg("wgrad", tma))
    ref64 = grouped_mm_wgrad_ref(g1, x, offs, out=prev, accumulate=True, compute_dtype=F64)
    ref32 = grouped_mm_wgrad_ref(g1, x, offs, out=prev, accumulate=True, compute_dtype=F32)
    _check("W13 wgrad fp32 accumulate", acc[full], ref64[full], ref32[full])
    assert torch.isnan(acc[~full]).all(), "accumulate must leave empty experts untouched"


@pytest.mark.parametrize("tma", TMA)
def test_cuda_graph_capture_and_replay(tma):
    """All launchers in one graph; new inputs and new segment lengths copied in place replay right."""
    torch.manual_seed(5)
    d, f, e, max_rows = 512, 256, 4, 1024
    w13, w2 = _weights(e, 2 * f, d, d ** -0.5 * 2), _weights(e, d, f, f ** -0.5)
    tokens = max_rows + 10
    src = torch.randn(tokens, d, device=DEV).to(BF16)
    src_idx = torch.randperm(tokens, device=DEV)[:max_rows]
    offs = _offsets([100, 0, 300, 200])
    x_saved, h1, h2 = _poisoned(max_rows, d), _poisoned(max_rows, 2 * f), _poisoned(max_rows, f)
    out = _poisoned(tokens, d)
    dst_idx = torch.randperm(tokens, device=DEV)[:max_rows]
    a_ptrs, o_ptrs = _row_ptrs(src, src_idx), _row_ptrs(out, dst_idx)
    g3 = torch.randn(max_rows, d, device=DEV).to(BF16)
    g2 = _poisoned(max_rows, f)
    wg = _poisoned(e, d, f)
    ptr = {name: device_ptr(t) for name, t in dict(x_saved=x_saved, h1=h1, h2=h2, g3=g3, g2=g2).items()}
    flags = ClaimFlags(max_rows, None, e, DEV)

    def step():
        grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=max_rows, a_row_ptrs=a_ptrs,
                       a_copy_out=ptr["x_saved"], claim_flags=flags, epilogue="swiglu",
                       h1=ptr["h1"], h2=ptr["h2"], config=_cfg("fwd", tma))
        grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=max_rows, a=ptr["h2"], epilogue="scatter",
                       out_row_ptrs=o_ptrs, config=_cfg("fwd", tma))
        grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows, a=ptr["g3"], out=ptr["g2"],
                         config=_cfg("dgrad", tma))
        grouped_mm_wgrad(ptr["g3"], ptr["h2"], offs, wg, dtype=BF16, config=_cfg("wgrad", tma))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # new inputs in place, including different segment lengths (R = 900 <= max_rows)
    lens = [0, 517, 83, 300]
    offs.copy_(_offsets(lens))
    src.copy_(torch.randn(tokens, d, device=DEV).to(BF16))
    g3.copy_(torch.randn(max_rows, d, device=DEV).to(BF16))
    for t in (x_saved, h1, h2, out, g2, wg):
        t.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()

    r = sum(lens)
    x = gather_rows_ref(src, src_idx[:r])
    assert torch.equal(x_saved[:r], x) and torch.isnan(x_saved[r:]).all(), "replayed a_copy_out"
    r1_64, r1_32, r2_64, r2_32 = _swiglu_refs(x, w13, offs)
    _check("replayed h1", h1[:r], r1_64, r1_32)
    _check("replayed h2", h2[:r], r2_64, r2_32)
    _check("replayed scatter", out[dst_idx[:r]],
           grouped_mm_fwd_ref(h2[:r], w2, offs, compute_dtype=F64, out_dtype=F64),
           grouped_mm_fwd_ref(h2[:r], w2, offs, compute_dtype=F32, out_dtype=BF16))
    _check("replayed dgrad", g2[:r], grouped_mm_dgrad_ref(g3[:r], w2, offs, compute_dtype=F64, out_dtype=F64),
           grouped_mm_dgrad_ref(g3[:r], w2, offs, compute_dtype=F32, out_dtype=BF16))
    assert torch.isnan(g2[r:]).all(), "replayed dgrad wrote rows past R"
    full = torch.tensor([n > 0 for n in lens], device=DEV)
    _check("replayed wgrad", wg[full],
           grouped_mm_wgrad_ref(g3[:r], h2[:r], offs, compute_dtype=F64, out_dtype=F64)[full],
           grouped_mm_wgrad_ref(g3[:r], h2[:r], offs, compute_dtype=F32, out_dtype=BF16)[full])
    assert (wg[~full] == 0).all(), "replayed wgrad: empty expert must be zeros"


# ----------------------------------------------------------------------------- claim mode
def _claim_cfg(kind, tma, ahead=1, slice_k=None):
    return replace(CONFIG_TABLE[(kind, "large")], tma=tma, claim_ahead=ahead, claim_slice_k=slice_k)


def _claim_fwd_once(flags, src, src_idx, w13, lens, max_rows, cfg, num_programs=None, full_check=True):
    """One claim-mode W13+SwiGLU launch on poisoned outputs; returns nothing, asserts."""
    d, f = w13.shape[2], w13.shape[1] // 2
    offs, r = _offsets(lens), sum(lens)
    x_saved, h1, h2 = _poisoned(max_rows, d), _poisoned(max_rows, 2 * f), _poisoned(max_rows, f)
    grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=max_rows, a_row_ptrs=_row_ptrs(src, src_idx),
                   a_copy_out=device_ptr(x_saved), claim_flags=flags, epilogue="swiglu", h1=h1,
                   h2=h2, config=cfg, num_programs=num_programs)
    x = gather_rows_ref(src, src_idx[:r].to(src.device)).to(DEV)  # src may live on a peer GPU
    tag = (f"lens={lens} progs={num_programs} ahead={cfg.claim_ahead} tma={cfg.tma} "
           f"slice_k={cfg.slice_k}")
    assert torch.equal(x_saved[:r], x), f"{tag}: a_copy_out must hold exactly the gathered rows"
    assert torch.isnan(x_saved[r:]).all(), f"{tag}: a_copy_out rows past R were written"
    assert torch.isnan(h1[r:]).all() and torch.isnan(h2[r:]).all(), f"{tag}: rows past R written"
    if full_check:
        r1_64, r1_32, r2_64, r2_32 = _swiglu_refs(x, w13, offs)
        _check(f"{tag} h1", h1[:r], r1_64, r1_32)
        _check(f"{tag} h2", h2[:r], r2_64, r2_32)
    else:  # cheap: same-precision torch, same tolerance rule
        r1_32 = grouped_mm_fwd_ref(x, w13, offs, compute_dtype=F32, out_dtype=BF16)
        assert not torch.isnan(h1[:r]).any(), f"{tag}: h1 rows not written"
        assert _rel(h1[:r], r1_32) <= 1e-2, f"{tag}: h1 relative difference {_rel(h1[:r], r1_32):.2e}"


@pytest.mark.parametrize("slice_k", [None, 128])
@pytest.mark.parametrize("ahead", [0, 1, 2])
@pytest.mark.parametrize("tma", TMA)
@pytest.mark.parametrize("lens,d,f", SHAPES)
def test_fwd_swiglu_claim(lens, d, f, tma, ahead, slice_k):
    """W13 + SwiGLU, rows claimed and copied once per m-tile; two calls on the same flags."""
    torch.manual_seed(6)
    e, r, max_rows = len(lens), sum(lens), sum(lens) + 64
    tokens = max_rows + 37
    w13 = _weights(e, 2 * f, d, d ** -0.5 * 2)
    flags = ClaimFlags(max_rows, None, e, DEV)
    for call in range(2):  # the second call runs on counters left by the first
        src = torch.randn(tokens, d, device=DEV).to(BF16)
        src_idx = torch.randperm(tokens, device=DEV)[:max_rows]
        src_idx[torch.randperm(r, device=DEV)[:5]] = -1
        _claim_fwd_once(flags, src, src_idx, w13, lens, max_rows,
                        _claim_cfg("fwd", tma, ahead, slice_k))
    assert int(flags.epoch) == 2


@pytest.mark.parametrize("slice_k", [None, 256])
@pytest.mark.parametrize("tma", TMA)
@pytest.mark.parametrize("lens,d,f", SHAPES)
def test_dgrad_w2_claim(lens, d, f, tma, slice_k):
    """W2 DGRAD with grad_h3 rows gathered by claim into the saved copy (WGRAD's operand)."""
    torch.manual_seed(7)
    e, r, max_rows = len(lens), sum(lens), sum(lens) + 32
    tokens = max_rows + 11
    w2 = _weights(e, d, f, f ** -0.5)
    offs = _offsets(lens)
    flags = ClaimFlags(max_rows, None, e, DEV)
    for call in range(2):
        src = torch.randn(tokens, d, device=DEV).to(BF16)
        src_idx = torch.randperm(tokens, device=DEV)[:max_rows]
        src_idx[torch.randperm(r, device=DEV)[:3]] = -1
        g3, g2 = _poisoned(max_rows, d), _poisoned(max_rows, f)
        grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows,
                         a_row_ptrs=_row_ptrs(src, src_idx), a_copy_out=device_ptr(g3),
                         claim_flags=flags, out=device_ptr(g2),
                         config=_claim_cfg("dgrad", tma, slice_k=slice_k))
        x = gather_rows_ref(src, src_idx[:r])
        assert torch.equal(g3[:r], x), "saved grad_h3 must hold exactly the gathered rows"
        assert torch.isnan(g3[r:]).all() and torch.isnan(g2[r:]).all(), "rows past R were written"
        _check("W2 dgrad (claim)", g2[:r], grouped_mm_dgrad_ref(x, w2, offs, compute_dtype=F64, out_dtype=F64),
               grouped_mm_dgrad_ref(x, w2, offs, compute_dtype=F32, out_dtype=BF16))


@pytest.mark.parametrize("tma", TMA)
def test_claim_many_launches(tma):
    """40 consecutive launches on one ClaimFlags: changing segments (incl. R = 0 and R =
    max_rows), grids from 1 program to the SM count, look-ahead 0-2, fwd and dgrad mixed.
    A broken claim/publish/acquire shows up as NaN or stale rows in a_copy_out."""
    g = torch.Generator().manual_seed(8)
    e, d, f, max_rows = 6, 512, 256, 3000
    tokens = max_rows + 100
    w13, w2 = _weights(e, 2 * f, d, d ** -0.5 * 2), _weights(e, d, f, f ** -0.5)
    flags = ClaimFlags(max_rows, None, e, DEV)
    grids = [1, 2, 7, 33, None]
    for it in range(40):
        if it == 3:
            lens = [0] * e
        elif it == 4:
            lens = [max_rows - 5 * 7] + [7] * (e - 1)
        else:
            cuts = torch.randint(0, max_rows + 1, (e - 1,), generator=g).sort().values.tolist()
            lens = [b - a for a, b in zip([0] + cuts, cuts + [max_rows])]
            lens[int(torch.randint(0, e, (1,), generator=g))] = 0
        src = torch.randn(tokens, d, device=DEV).to(BF16)
        src_idx = torch.randperm(tokens, device=DEV)[:max_rows]
        src_idx[torch.randperm(max_rows, device=DEV)[:9]] = -1
        progs, ahead = grids[it % len(grids)], it % 3
        sk = (64, 128, 512, 1024)[it % 4]  # slice widths mixed on the same counters
        if it % 2 == 0:
            _claim_fwd_once(flags, src, src_idx, w13, lens, max_rows,
                            _claim_cfg("fwd", tma, ahead, sk), num_programs=progs,
                            full_check=False)
        else:
            r, offs = sum(lens), _offsets(lens)
            g3, g2 = _poisoned(max_rows, d), _poisoned(max_rows, f)
            grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows,
                             a_row_ptrs=_row_ptrs(src, src_idx), a_copy_out=g3, claim_flags=flags,
                             out=g2, config=_claim_cfg("dgrad", tma, ahead, sk),
                             num_programs=progs)
            x = gather_rows_ref(src, src_idx[:r])
            assert torch.equal(g3[:r], x), f"launch {it}: saved grad_h3 rows wrong (lens={lens})"
            assert torch.isnan(g3[r:]).all(), f"launch {it}: rows past R written"
            ref = grouped_mm_dgrad_ref(x, w2, offs, compute_dtype=F32, out_dtype=BF16)
            assert not torch.isnan(g2[:r]).any(), f"launch {it}: dgrad rows not written"
            assert _rel(g2[:r], ref) <= 1e-2, f"launch {it}: dgrad output wrong"
    assert int(flags.epoch) == 40
    assert flags.status.tolist() == [0, 0, 0, 0]


def test_claim_wait_traps_naming_the_tile():
    """A slice counter that never completes (pre-set to "all claimed" for this launch, as if
    its copier had died): the waiting programs give up after the timeout and trap with
    CHECK_WAIT_TIMEOUT's message naming the m-tile and the rank (in a subprocess: a trap ends
    the CUDA context)."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, __file__, "stuck_claim"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=repo)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"the stuck wait did not end the process:\n{text[-3000:]}"
    assert "dist_moe TRAP: a device wait timed out" in text, text[-4000:]
    assert "NO TRAP" not in text, text[-3000:]


def _stuck_claim() -> None:
    lens, d, f = [300, 0, 257], 512, 256
    e, r = len(lens), sum(lens)
    w13 = _weights(e, 2 * f, d, d ** -0.5)
    src = torch.randn(r, d, device=DEV).to(BF16)
    flags = ClaimFlags(r, None, e, DEV)
    flags.claimed[1] = (1 << flags.SLICE_SHIFT) + 1000     # epoch 1, m-tile 1: all "claimed"
    x_saved, h2 = _poisoned(r, d), _poisoned(r, f)
    grouped_mm_fwd(w=w13, expert_offsets=_offsets(lens), max_rows=r,
                   a_row_ptrs=_row_ptrs(src, torch.arange(r, device=DEV)),
                   a_copy_out=device_ptr(x_saved), claim_flags=flags, epilogue="swiglu", h2=h2,
                   timeout_s=0.5, rank=3)
    torch.cuda.synchronize()
    print("NO TRAP", flags.status.tolist())


@pytest.mark.parametrize("tma", TMA)
def test_claim_cuda_graph_replay(tma):
    """Claim-mode fwd and dgrad captured in one graph sharing one ClaimFlags: every replay
    advances the epoch on the device, so replays with new rows and segments stay exact."""
    torch.manual_seed(9)
    d, f, e, max_rows = 512, 256, 4, 1024
    tokens = max_rows + 10
    w13, w2 = _weights(e, 2 * f, d, d ** -0.5 * 2), _weights(e, d, f, f ** -0.5)
    src, gsrc = torch.randn(tokens, d, device=DEV).to(BF16), torch.randn(tokens, d, device=DEV).to(BF16)
    src_idx = torch.randperm(tokens, device=DEV)[:max_rows]
    g_idx = torch.randperm(tokens, device=DEV)[:max_rows]
    a_ptrs, g_ptrs = _row_ptrs(src, src_idx), _row_ptrs(gsrc, g_idx)
    offs = _offsets([100, 0, 300, 200])
    x_saved, h1, h2 = _poisoned(max_rows, d), _poisoned(max_rows, 2 * f), _poisoned(max_rows, f)
    g3, g2 = _poisoned(max_rows, d), _poisoned(max_rows, f)
    ptr = {k: device_ptr(t) for k, t in dict(x_saved=x_saved, h1=h1, h2=h2, g3=g3, g2=g2).items()}
    flags = ClaimFlags(max_rows, None, e, DEV)

    def step():
        grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=max_rows, a_row_ptrs=a_ptrs,
                       a_copy_out=ptr["x_saved"], claim_flags=flags, epilogue="swiglu",
                       h1=ptr["h1"], h2=ptr["h2"], config=_claim_cfg("fwd", tma))
        grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows, a_row_ptrs=g_ptrs,
                         a_copy_out=ptr["g3"], claim_flags=flags, out=ptr["g2"],
                         config=_claim_cfg("dgrad", tma))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    epoch0 = int(flags.epoch)
    for rep, lens in enumerate(([0, 517, 83, 300], [1000, 0, 0, 24], [250, 250, 250, 250])):
        offs.copy_(_offsets(lens))
        src.copy_(torch.randn(tokens, d, device=DEV).to(BF16))
        gsrc.copy_(torch.randn(tokens, d, device=DEV).to(BF16))
        for t in (x_saved, h1, h2, g3, g2):
            t.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert int(flags.epoch) == epoch0 + 2 * (rep + 1), "each replay advances the epoch twice"
        r = sum(lens)
        x = gather_rows_ref(src, src_idx[:r])
        assert torch.equal(x_saved[:r], x) and torch.isnan(x_saved[r:]).all(), f"replay {rep}: x_saved"
        r1_64, r1_32, r2_64, r2_32 = _swiglu_refs(x, w13, offs)
        _check(f"replay {rep} h1", h1[:r], r1_64, r1_32)
        _check(f"replay {rep} h2", h2[:r], r2_64, r2_32)
        gx = gather_rows_ref(gsrc, g_idx[:r])
        assert torch.equal(g3[:r], gx) and torch.isnan(g3[r:]).all(), f"replay {rep}: saved grad_h3"
        _check(f"replay {rep} dgrad", g2[:r], grouped_mm_dgrad_ref(gx, w2, offs, compute_dtype=F64, out_dtype=F64),
               grouped_mm_dgrad_ref(gx, w2, offs, compute_dtype=F32, out_dtype=BF16))


def enable_peer_access(a: int, b: int) -> None:
    """Peer access both ways between GPUs a and b (torch enables it on a cross-GPU copy:
    src -> dst copies turn on src's access to dst's memory)."""
    for s_dev, d_dev in ((a, b), (b, a)):
        torch.empty(16, device=f"cuda:{d_dev}").copy_(torch.ones(16, device=f"cuda:{s_dev}"))
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)


def _peer_claim_check() -> None:
    """Rows on GPU 1, claim-mode W13 and W2 DGRAD on GPU 0 (both look-aheads, both A paths)."""
    enable_peer_access(0, 1)
    torch.manual_seed(10)
    lens, d, f = [300, 0, 257, 411], 7168, 3072
    e, r, max_rows = len(lens), sum(lens), sum(lens) + 64
    tokens = max_rows + 37
    w13 = _weights(e, 2 * f, d, d ** -0.5 * 2)
    w2 = _weights(e, d, f, f ** -0.5)
    flags = ClaimFlags(max_rows, None, e, DEV)
    peer = torch.device("cuda:1")
    for tma in (False, True):
        for ahead in (0, 1):
            src = torch.randn(tokens, d, device=peer).to(BF16)
            src_idx = torch.randperm(tokens, device=DEV)[:max_rows]
            src_idx[torch.randperm(r, device=DEV)[:5]] = -1
            _claim_fwd_once(flags, src, src_idx, w13, lens, max_rows, _claim_cfg("fwd", tma, ahead))
            offs = _offsets(lens)
            g3, g2 = _poisoned(max_rows, d), _poisoned(max_rows, f)
            grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows,
                             a_row_ptrs=_row_ptrs(src, src_idx), a_copy_out=g3, claim_flags=flags,
                             out=g2, config=_claim_cfg("dgrad", tma, ahead))
            x = gather_rows_ref(src, src_idx[:r].to(peer)).to(DEV)
            assert torch.equal(g3[:r], x) and torch.isnan(g3[r:]).all(), "peer dgrad: saved rows"
            _check("peer dgrad", g2[:r], grouped_mm_dgrad_ref(x, w2, offs, compute_dtype=F64, out_dtype=F64),
                   grouped_mm_dgrad_ref(x, w2, offs, compute_dtype=F32, out_dtype=BF16))
    torch.cuda.synchronize()
    print("PEER CLAIM OK")


def test_claim_peer_source():
    if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("needs two GPUs with peer access")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, __file__, "peer"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=repo)
    assert proc.returncode == 0 and "PEER CLAIM OK" in proc.stdout, (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


if __name__ == "__main__" and sys.argv[1:] == ["peer"]:
    _peer_claim_check()
if __name__ == "__main__" and sys.argv[1:] == ["stuck_claim"]:
    _stuck_claim()

"""Grouped GEMM kernels under Triton's CPU interpreter, against the fp64 torch reference.

`triton.jit` decides at decoration time whether to interpret, so the checks run in one child
process started with TRITON_INTERPRET=1 (this file run as a script); each pytest test reports one
check of that run. Operands are fp32/fp16 (bf16 runs too, widened to fp32 in the interpreter; see
tests/cpu/test_cuda_backend_cpu_interp.py for the bf16 end-to-end run).

Tolerances: with fp32 operands and fp32 accumulation over Kd <= 128, |error| <~ 1e-6 x max|ref|,
so 1e-5 catches any wrong row, column or expert; fp16 outputs round at 2^-11 relative, so 2e-3;
bf16 outputs (wgrad) at 2^-9, so 8e-3. Unwritten outputs are poisoned (NaN) and checked.

    python tests/cpu/test_kernels_grouped_gemm_interp.py [check ...]   # runs the checks directly
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from megatron_dist_moe import testing as tt

REPO = Path(__file__).resolve().parents[2]
NAN = float("nan")
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 8e-3}


# ----------------------------------------------------------------------------- helpers (child)
def _offsets(lens):
    import torch
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _close(name, got, ref, dtype):
    import torch
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    got64, ref64 = got.double(), ref.double()
    assert not torch.isnan(got64).any(), f"{name}: {int(torch.isnan(got64).sum())} unwritten (NaN) values"
    scale = ref64.abs().max().clamp(min=1e-30)
    err = ((got64 - ref64).abs().max() / scale).item()
    tol = TOL[str(dtype).split(".")[-1]]
    assert err <= tol, f"{name}: max error {err:.3e} x max|ref| > {tol:.1e}"


def _untouched(name, t):
    import torch
    assert torch.isnan(t).all(), f"{name}: {int((~torch.isnan(t)).sum())} values written that must not be"


def _row_ptrs(base, idx, row_elems):
    """int64 row addresses of base rows idx (idx < 0 -> 0, i.e. no row)."""
    import torch
    addr = base.data_ptr() + idx.to(torch.int64) * row_elems * base.element_size()
    return torch.where(idx >= 0, addr, torch.zeros_like(addr))


def _cfg(**kw):
    from megatron_dist_moe.kernels.grouped_gemm import INTERPRETER_CONFIG
    from dataclasses import replace
    return replace(INTERPRETER_CONFIG, **kw)


# ----------------------------------------------------------------------------- checks (child)
def check_fwd_store_dense():
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_fwd, device_ptr
    from megatron_dist_moe.kernels.grouped_gemm_ref import grouped_mm_fwd_ref
    for lens, n, progs in (([0, 5, 37], 64, None), ([3, 0, 17, 1, 0], 80, 2)):  # 80: ragged N
        e, kd, dt, max_rows = len(lens), 64, torch.float32, sum(lens) + 9
        offs, r = _offsets(lens), sum(lens)
        x = torch.randn(max_rows, kd, dtype=dt)
        w = torch.randn(e, n, kd, dtype=dt)
        out = torch.full((max_rows, n), NAN, dtype=dt)
        grouped_mm_fwd(w=w, expert_offsets=offs, max_rows=max_rows, a=device_ptr(x),
                       out=device_ptr(out), num_programs=progs)
        ref = grouped_mm_fwd_ref(x[:r], w, offs, compute_dtype=torch.float64)
        _close(f"out lens={lens}", out[:r], ref, dt)
        _untouched("rows past R", out[r:])


def _check_swiglu(dt, activation, gather, tma):
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import ClaimFlags, grouped_mm_fwd, device_ptr
    from megatron_dist_moe.kernels.grouped_gemm_ref import grouped_mm_fwd_swiglu_ref, gather_rows_ref
    lens, d, f = [0, 5, 37], 64, 64
    e, offs, r, max_rows = len(lens), _offsets(lens), sum(lens), sum(lens) + 4
    w13 = (torch.randn(e, 2 * f, d) / 4).to(dt)
    if gather:  # rows come from a "peer" buffer in shuffled order, some rows absent (address 0)
        src = torch.randn(50, d).to(dt)
        idx = torch.randint(0, 50, (max_rows,))
        idx[[0, 7, 30]] = -1
        x = gather_rows_ref(src, idx[:r])
        copy = torch.full((max_rows, d), NAN).to(dt)
        a_kw = dict(a_row_ptrs=_row_ptrs(src, idx, d), a_copy_out=device_ptr(copy),
                    claim_flags=ClaimFlags(max_rows, None, e, "cpu"))
    else:
        x = torch.randn(r, d).to(dt)
        a_kw = dict(a=x)
    h1 = torch.full((max_rows, 2 * f), NAN).to(dt)
    h2 = torch.full((max_rows, f), NAN).to(dt)
    grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=max_rows, epilogue="swiglu",
                   h1=device_ptr(h1), h2=device_ptr(h2), activation=activation, swiglu_alpha=1.702,
                   swiglu_limit=1.5, config=_cfg(tma=tma), **a_kw)
    r1, r2 = grouped_mm_fwd_swiglu_ref(x, w13, offs, activation=activation, swiglu_alpha=1.702,
                                       swiglu_limit=1.5, compute_dtype=torch.float64)
    _close("h1", h1[:r], r1, dt)
    _close("h2", h2[:r], r2, dt)
    _untouched("h1 rows past R", h1[r:])
    _untouched("h2 rows past R", h2[r:])
    if gather:
        assert torch.equal(copy[:r], x), "a_copy_out must hold the gathered rows (zeros for address 0)"
        _untouched("a_copy_out rows past R", copy[r:])


def check_fwd_swiglu_dense_fp32():
    import torch
    _check_swiglu(torch.float32, "swiglu", gather=False, tma=False)


def check_fwd_swiglu_clamped_claimed_fp16():
    import torch
    _check_swiglu(torch.float16, "swiglu_clamped", gather=True, tma=False)


def check_fwd_swiglu_tma():
    import torch
    _check_swiglu(torch.float32, "swiglu_clamped", gather=False, tma=True)


def check_fwd_swiglu_no_h1():
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_fwd
    from megatron_dist_moe.kernels.grouped_gemm_ref import grouped_mm_fwd_swiglu_ref
    lens, d, f, dt = [9, 0, 20], 64, 64, torch.float32
    offs, r = _offsets(lens), sum(lens)
    x, w13 = torch.randn(r, d), torch.randn(3, 2 * f, d) / 4
    h2 = torch.full((r, f), NAN)
    grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=r, a=x, epilogue="swiglu", h2=h2)
    _close("h2", h2, grouped_mm_fwd_swiglu_ref(x, w13, offs, compute_dtype=torch.float64)[1], dt)


def _check_scatter(dgrad, tma):
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_fwd, grouped_mm_dgrad
    from megatron_dist_moe.kernels.grouped_gemm_ref import (
        gather_rows_ref, grouped_mm_dgrad_ref, grouped_mm_fwd_ref)
    lens, d, f, dt = [6, 0, 21, 13], 64, 128, torch.float32
    e, offs, r, max_rows = len(lens), _offsets(lens), sum(lens), sum(lens) + 3
    src = torch.randn(60, f)
    a_idx = torch.randperm(60)[:max_rows]
    a_idx[[2, 25]] = -1
    w = torch.randn(e, d, f) / 4  # fprop: W2 [E, D, F] as [E, N, Kd]; dgrad: as [E, Kd, N]
    a_in = src if not dgrad else torch.randn(60, d)
    n = d if not dgrad else f
    t_rows = 70  # the token owner's buffer
    dst = torch.full((t_rows, n), NAN)
    dst_idx = torch.randperm(t_rows)[:max_rows]
    dst_idx[[0, 10, r - 1]] = -1  # skipped rows
    x = gather_rows_ref(a_in, a_idx[:r])
    kw = dict(w=w, expert_offsets=offs, max_rows=max_rows, a=x.contiguous(),
              epilogue="scatter", out_row_ptrs=_row_ptrs(dst, dst_idx, n), config=_cfg(tma=tma))
    (grouped_mm_dgrad if dgrad else grouped_mm_fwd)(**kw)
    ref_fn = grouped_mm_dgrad_ref if dgrad else grouped_mm_fwd_ref
    ref = ref_fn(x, w, offs, compute_dtype=torch.float64)
    written = dst_idx[:r][dst_idx[:r] >= 0]
    _close("scattered rows", dst[written], ref[dst_idx[:r] >= 0], dt)
    untouched = torch.ones(t_rows, dtype=torch.bool)
    untouched[written] = False
    _untouched("rows not scattered to (skipped or absent)", dst[untouched])


def check_fwd_scatter():
    _check_scatter(dgrad=False, tma=False)


def check_dgrad_scatter_tma():
    _check_scatter(dgrad=True, tma=True)


def check_dgrad_store():
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_dgrad, device_ptr
    from megatron_dist_moe.kernels.grouped_gemm_ref import grouped_mm_dgrad_ref
    lens, d, f = [0, 5, 37], 64, 64
    e, offs, r = len(lens), _offsets(lens), sum(lens)
    for dt, tma in ((torch.float32, False), (torch.float16, False), (torch.float32, True)):
        # W2 DGRAD: grad_h2 [R, F] = grad_h3 [R, D] @ W2[e], W2 [E, D, F]
        w2, g3 = (torch.randn(e, d, f) / 4).to(dt), torch.randn(r, d).to(dt)
        out = torch.full((r, f), NAN).to(dt)
        grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=r, a=g3, out=device_ptr(out),
                         config=_cfg(tma=tma))
        _close(f"W2 dgrad {dt} tma={tma}", out, grouped_mm_dgrad_ref(g3, w2, offs, compute_dtype=torch.float64), dt)
        # W13 DGRAD: grad_x [R, D] = grad_h1 [R, 2F] @ W13[e], W13 [E, 2F, D]
        w13, g1 = (torch.randn(e, 2 * f, d) / 4).to(dt), torch.randn(r, 2 * f).to(dt)
        out = torch.full((r, d), NAN).to(dt)
        grouped_mm_dgrad(w=w13, expert_offsets=offs, max_rows=r, a=g1, out=out,
                         config=_cfg(tma=tma), num_programs=1)
        _close(f"W13 dgrad {dt} tma={tma}", out, grouped_mm_dgrad_ref(g1, w13, offs, compute_dtype=torch.float64), dt)
    # ragged N (80 = 2.5 tiles of 32) in the DGRAD orientation
    w, a = torch.randn(3, 64, 80), torch.randn(r, 64)
    out = torch.full((r, 80), NAN)
    grouped_mm_dgrad(w=w, expert_offsets=offs, max_rows=r, a=a, out=out)
    _close("ragged N dgrad", out, grouped_mm_dgrad_ref(a, w, offs, compute_dtype=torch.float64), torch.float32)


def check_wgrad_persistent_grids():
    """The persistent WGRAD (TMA descriptors or pointer loads over all rows, ragged tails by
    masked loads): every expert's tiles whatever the grid, empty experts zero (or untouched when
    accumulating)."""
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_wgrad
    from megatron_dist_moe.kernels.grouped_gemm_ref import grouped_mm_wgrad_ref
    for lens, m, n, progs, tma in (([0, 5, 37], 128, 64, 1, True), ([40, 0, 3, 0, 16], 64, 80, 3, True),
                                   ([33, 64, 1], 64, 64, 7, False)):
        e, offs, r = len(lens), _offsets(lens), sum(lens)
        a, b = torch.randn(r, m), torch.randn(r, n)
        out = torch.full((e, m, n), NAN)
        grouped_mm_wgrad(a, b, offs, out, config=_cfg(tma=tma), num_programs=progs)
        ref = grouped_mm_wgrad_ref(a, b, offs, compute_dtype=torch.float64)
        _close(f"persistent wgrad lens={lens} progs={progs}", out, ref, torch.float32)
        prev = torch.randn(e, m, n)
        full = torch.tensor([ln > 0 for ln in lens])
        prev[~full] = NAN
        acc = prev.clone()
        grouped_mm_wgrad(a, b, offs, acc, accumulate=True, config=_cfg(tma=tma),
                         num_programs=progs)
        ref = grouped_mm_wgrad_ref(a, b, offs, out=prev, accumulate=True,
                                   compute_dtype=torch.float64)
        _close("persistent wgrad accumulate", acc[full], ref[full], torch.float32)
        _untouched("persistent wgrad accumulate, empty experts", acc[~full])


def check_wgrad_into_expert_table():
    """WGRAD accumulating into E separate fp32 matrices (ExpertOutTable: Megatron's per-expert
    main_grad), TMA or not: out[e] += a_e^T b_e; empty experts and the memory between the
    matrices stay untouched."""
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import ExpertOutTable, grouped_mm_wgrad
    from megatron_dist_moe.kernels.grouped_gemm_ref import grouped_mm_wgrad_ref
    lens, m, n = [9, 0, 37, 4], 64, 80
    e, offs, r = len(lens), _offsets(lens), sum(lens)
    a, b = torch.randn(r, m), torch.randn(r, n)
    for tma, progs in ((False, None), (True, None), (True, 3)):
        # one buffer, the experts' matrices in reverse order with gaps (as in a grad buffer)
        buf = torch.full((e * (m * n + 8),), NAN)
        mats = [buf[(e - 1 - i) * (m * n + 8):(e - 1 - i) * (m * n + 8) + m * n].view(m, n)
                for i in range(e)]
        prev = torch.randn(e, m, n)
        for i, ln in enumerate(lens):
            if ln:
                mats[i].copy_(prev[i])
        grouped_mm_wgrad(a, b, offs, ExpertOutTable.of(mats), accumulate=True,
                         config=_cfg(tma=tma), num_programs=progs)
        ref = grouped_mm_wgrad_ref(a, b, offs, out=prev, accumulate=True,
                                   compute_dtype=torch.float64)
        tag = f"wgrad into table tma={tma} progs={progs}"
        for i, ln in enumerate(lens):
            if ln:
                _close(f"{tag} expert {i}", mats[i], ref[i], torch.float32)
            else:
                _untouched(f"{tag}: empty expert {i}", mats[i])
        gaps = torch.ones_like(buf, dtype=torch.bool)
        for i in range(e):
            gaps[i * (m * n + 8):i * (m * n + 8) + m * n] = False
        _untouched(f"{tag}: memory between the matrices", buf[gaps])


def check_wgrad():
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_wgrad, device_ptr
    from megatron_dist_moe.kernels.grouped_gemm_ref import grouped_mm_wgrad_ref
    for lens, m, n, tma in (([0, 5, 37], 128, 64, False), ([40, 0, 3, 0], 64, 80, True)):
        e, offs, r = len(lens), _offsets(lens), sum(lens)
        a, b = torch.randn(r, m), torch.randn(r, n)
        out = torch.full((e, m, n), NAN)
        grouped_mm_wgrad(device_ptr(a), device_ptr(b), offs, out, dtype=torch.float32,
                         config=_cfg(tma=tma))
        ref = grouped_mm_wgrad_ref(a, b, offs, compute_dtype=torch.float64)
        _close(f"wgrad lens={lens} tma={tma}", out, ref, torch.float32)
        # accumulate: empty experts untouched (poison stays), others get += a_e^T b_e
        prev = torch.randn(e, m, n)
        for i, ln in enumerate(lens):
            if ln == 0:
                prev[i] = NAN
        acc = prev.clone()
        grouped_mm_wgrad(a, b, offs, acc, accumulate=True, config=_cfg(tma=tma))
        ref = grouped_mm_wgrad_ref(a, b, offs, out=prev, accumulate=True, compute_dtype=torch.float64)
        full = torch.tensor([ln > 0 for ln in lens])
        _close("wgrad accumulate", acc[full], ref[full], torch.float32)
        _untouched("wgrad accumulate, empty experts", acc[~full])
    # fp16 inputs, bf16 output
    lens = [7, 0, 30]
    offs, r = _offsets(lens), sum(lens)
    a, b = torch.randn(r, 64).half(), torch.randn(r, 64).half()
    out = torch.full((3, 64, 64), NAN, dtype=torch.bfloat16)
    grouped_mm_wgrad(a, b, offs, out)
    _close("wgrad bf16 out", out, grouped_mm_wgrad_ref(a, b, offs, compute_dtype=torch.float64), torch.bfloat16)
    assert (out[1] == 0).all(), "an empty expert's wgrad must be zeros"


def check_empty_and_persistent():
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_fwd, grouped_mm_wgrad
    from megatron_dist_moe.kernels.grouped_gemm_ref import grouped_mm_fwd_ref
    w = torch.randn(2, 64, 64)
    out = torch.full((16, 64), NAN)
    grouped_mm_fwd(w=w, expert_offsets=_offsets([0, 0]), max_rows=16, a=torch.randn(16, 64), out=out)
    _untouched("R=0: nothing written", out)
    wg = torch.full((2, 64, 64), NAN)
    grouped_mm_wgrad(torch.randn(16, 64), torch.randn(16, 64), _offsets([0, 0]), wg)
    assert (wg == 0).all(), "R=0 wgrad must write zeros"
    # max_rows far larger than R and a single program walking every tile
    lens = [33, 17]
    offs, r = _offsets(lens), sum(lens)
    x = torch.randn(r, 64)
    for progs in (1, 7):
        out = torch.full((r, 64), NAN)
        grouped_mm_fwd(w=w, expert_offsets=offs, max_rows=4096, a=x, out=out, num_programs=progs)
        _close(f"num_programs={progs}", out, grouped_mm_fwd_ref(x, w, offs, compute_dtype=torch.float64), torch.float32)


# ----------------------------------------------------------------------------- claim mode
def _claim_case(flags, *, lens, d, f, dt, progs, tma, ahead, seed_rows, n_src=50, x_poison=None,
                slice_k=None, ahead_slices=2):
    """One claim-mode W13+SwiGLU call; checks h1, h2, a_copy_out and the counters afterwards.

    x_poison: rows of a_copy_out to pre-fill with these values (a dict m-tile -> (row0, rows))
    and whose m-tiles are pre-published as fully copied in this launch's epoch (the no-copy
    path). slice_k: the slice width (None: the config's default), lowered to a divisor of d."""
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_fwd, device_ptr
    from megatron_dist_moe.kernels.grouped_gemm_ref import grouped_mm_fwd_swiglu_ref, gather_rows_ref
    g = torch.Generator().manual_seed(seed_rows)
    e, offs, r = len(lens), _offsets(lens), sum(lens)
    max_rows = r + 5
    w13 = (torch.randn(e, 2 * f, d, generator=g) / 4).to(dt)
    src = torch.randn(n_src, d, generator=g).to(dt)  # a "peer's" rows
    idx = torch.randint(0, n_src, (max_rows,), generator=g)
    idx[torch.randperm(max_rows, generator=g)[:4]] = -1  # address 0 -> zero rows
    x = gather_rows_ref(src, idx[:r])
    copy = torch.full((max_rows, d), NAN).to(dt)
    h1, h2 = torch.full((max_rows, 2 * f), NAN).to(dt), torch.full((max_rows, f), NAN).to(dt)
    cfg = _cfg(tma=tma, claim_ahead=ahead, claim_ahead_slices=ahead_slices,
               **({} if slice_k is None else dict(claim_slice_k=slice_k)))
    ep = int(flags.epoch) + 1  # the epoch this launch will run in
    eff_k = min(cfg.slice_k, d)  # the launcher's slice width: lowered to a divisor of d
    while d % eff_k:
        eff_k //= 2
    base, n_slices = ep << flags.SLICE_SHIFT, d // eff_k
    if x_poison is not None:
        for flag_idx, (row0, rows) in x_poison.items():
            copy[row0:row0 + rows.shape[0]] = rows
            flags.claimed[flag_idx] = base + n_slices
            flags.copied[flag_idx] = base + n_slices
        x = x.clone()
        for flag_idx, (row0, rows) in x_poison.items():
            x[row0:row0 + rows.shape[0]] = rows[: max(0, min(rows.shape[0], r - row0))]
    before = [t.clone() for t in (flags.claimed, flags.copied)]
    grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=max_rows, a_row_ptrs=_row_ptrs(src, idx, d),
                   a_copy_out=device_ptr(copy), claim_flags=flags, epilogue="swiglu",
                   h1=device_ptr(h1), h2=device_ptr(h2), activation="swiglu_clamped",
                   swiglu_alpha=1.702, swiglu_limit=1.5, config=cfg, num_programs=progs)
    tag = f"lens={lens} progs={progs} tma={tma} ahead={ahead} slice_k={eff_k} {dt}"
    assert int(flags.epoch) == ep, f"{tag}: the launcher must advance the epoch once"
    assert flags.status.tolist() == [0, 0, 0, 0], f"{tag}: a wait timed out: {flags.status}"
    assert torch.equal(copy[:r], x), f"{tag}: a_copy_out must hold the gathered rows"
    _untouched(f"{tag}: a_copy_out rows past R", copy[r:])
    r1, r2 = grouped_mm_fwd_swiglu_ref(x, w13, offs, activation="swiglu_clamped", swiglu_alpha=1.702,
                                       swiglu_limit=1.5, compute_dtype=torch.float64)
    _close(f"{tag}: h1", h1[:r], r1, dt)
    _close(f"{tag}: h2", h2[:r], r2, dt)
    _untouched(f"{tag}: h1 rows past R", h1[r:])
    _untouched(f"{tag}: h2 rows past R", h2[r:])
    # every slice of every m-tile of the launch handed out and counted copied exactly once; no
    # other counter is touched
    bm = cfg.block_m
    n_mt = sum((ln + bm - 1) // bm for ln in lens)
    assert (flags.copied[:n_mt] == base + n_slices).all(), (
        f"{tag}: copied counters {(flags.copied[:n_mt] - base).tolist()} != {n_slices}")
    assert (flags.claimed[:n_mt] >= base + n_slices).all(), f"{tag}: claimed counters short"
    for now, then in ((flags.claimed[n_mt:], before[0][n_mt:]), (flags.copied[n_mt:], before[1][n_mt:])):
        assert torch.equal(now, then), f"{tag}: counters outside the launch's m-tiles changed"


def check_claim_fwd_swiglu_grids():
    """Slice widths 16 and 32 of d=64 (4 and 2 slices per m-tile, copy_k lowered to the slice),
    a slice width above d (one slice), grids 1/2/3/7, look-ahead 0/1/2, consecutive calls on the
    same counters (the epoch advances, counters are never reset), segment lengths that change
    between calls, TMA loads of the copy."""
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import ClaimFlags
    flags = ClaimFlags(64, None, 3, "cpu")
    seed = 200
    for progs, ahead, sk, tma, n_ahead in ((1, 1, 16, False, 2), (2, 0, 32, False, 2),
                                           (3, 1, 16, True, 1), (7, 2, 16, False, 3),
                                           (7, 1, 128, False, 2), (3, 2, 32, True, 1),
                                           (1, 0, None, False, 2)):
        for lens in ([0, 5, 37], [16, 0, 17]):  # the second call remaps every m-tile's counter
            seed += 1
            _claim_case(flags, lens=lens, d=64, f=64, dt=torch.float32, progs=progs, tma=tma,
                        ahead=ahead, seed_rows=seed, slice_k=sk, ahead_slices=n_ahead)


def check_claim_stale_and_prepublished():
    """Counters of an old epoch (any count, garbage) are stale; an m-tile already fully copied
    in this epoch is trusted (its rows are not copied again)."""
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import ClaimFlags
    flags = ClaimFlags(64, None, 3, "cpu")
    flags.epoch.fill_(41)
    old = 41 << flags.SLICE_SHIFT
    junk = torch.tensor([old + 3, old + 1, old - 5, -7, 0, 5, old + 99, 1, 3])[: flags.capacity]
    flags.claimed.copy_(junk)
    flags.copied.copy_(junk.flip(0))
    _claim_case(flags, lens=[0, 5, 37], d=64, f=64, dt=torch.float32, progs=3, tma=False, ahead=1,
                seed_rows=17, slice_k=16)
    pre = torch.randn(16, 64)
    _claim_case(flags, lens=[0, 5, 37], d=64, f=64, dt=torch.float32, progs=2, tma=False, ahead=1,
                seed_rows=18, x_poison={2: (21, pre)}, slice_k=32)


def check_claim_fwd_swiglu_tma_fp16():
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import ClaimFlags
    flags = ClaimFlags(64, 16, 4, "cpu")
    for i, (dt, tma, progs) in enumerate(((torch.float16, False, 3), (torch.float32, True, 2),
                                          (torch.float16, True, 1))):
        _claim_case(flags, lens=[3, 0, 40, 1], d=64, f=32, dt=dt, progs=progs, tma=tma, ahead=1,
                    seed_rows=100 + i)


def _dead_copier_launch(timeout_s: float, verdict: int = 0):
    """One claimed W13 launch whose m-tile 1 is never counted as copied (its slice counter
    pre-set to "all claimed" in this launch's epoch, as if the copier died); `verdict`: a
    status code already recorded by another wait. Returns the flags' status and the seconds."""
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import ClaimFlags, device_ptr, grouped_mm_fwd
    lens, d, f = [20, 12], 64, 32
    offs, r = _offsets(lens), sum(lens)
    flags = ClaimFlags(r, None, 2, "cpu")
    ep = int(flags.epoch) + 1
    flags.claimed[1] = (ep << flags.SLICE_SHIFT) + 100    # m-tile 1: every slice "claimed"
    flags.status[0] = verdict
    src = torch.randn(r, d)
    copy, h2 = torch.zeros(r, d), torch.zeros(r, f)
    t0 = time.time()
    grouped_mm_fwd(w=torch.randn(2, 2 * f, d), expert_offsets=offs, max_rows=r,
                   a_row_ptrs=_row_ptrs(src, torch.arange(r), d), a_copy_out=device_ptr(copy),
                   claim_flags=flags, epilogue="swiglu", h2=h2, num_programs=2,
                   timeout_s=timeout_s, rank=5)
    return flags.status.tolist(), time.time() - t0


def check_claim_wait_gives_up():
    """The programs that wait for a dead copier's slice give up after the timeout and, where
    they cannot trap (the interpreter), record (CHECK_WAIT_TIMEOUT, what, rank) in the flags'
    status word instead of spinning for ever."""
    from megatron_dist_moe.kernels.checks import CHECK_WAIT_TIMEOUT, WAIT_CLAIM_SLICES
    status, seconds = _dead_copier_launch(0.002)
    code, what, rank, polls = status
    assert code == CHECK_WAIT_TIMEOUT, f"status {status}: the wait did not give up"
    assert what == (WAIT_CLAIM_SLICES << 32) + 1 and rank == 5, status
    assert polls >= 256, status
    assert seconds < 120, "the wait took far longer than its timeout"


def check_claim_wait_gives_up_once_another_has():
    """The status word already holds a verdict (another wait of this launch gave up): a wait
    stops after its busy polls instead of spinning for its own (here an hour's) poll budget,
    so one dead copier costs one timeout, not one per waiting tile."""
    from megatron_dist_moe.kernels.checks import CHECK_WAIT_TIMEOUT, max_polls
    status, seconds = _dead_copier_launch(3600.0, verdict=CHECK_WAIT_TIMEOUT)
    code, what, rank, polls = status
    assert code == CHECK_WAIT_TIMEOUT and rank == 5, status
    assert polls == max_polls(3600.0), f"polls {polls}: the wait did not stop on the verdict"
    assert seconds < 120, "the wait spun on its own budget"


def check_claim_dgrad_and_scatter():
    """W2 DGRAD (store) and an FPROP scatter epilogue in claim mode, one flag object shared."""
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import (
        ClaimFlags, device_ptr, grouped_mm_dgrad, grouped_mm_fwd)
    from megatron_dist_moe.kernels.grouped_gemm_ref import (
        gather_rows_ref, grouped_mm_dgrad_ref, grouped_mm_fwd_ref)
    lens, d, f, dt = [6, 0, 21, 13], 64, 96, torch.float32
    e, offs, r, max_rows = len(lens), _offsets(lens), sum(lens), sum(lens) + 3
    flags = ClaimFlags(max_rows, None, e, "cpu")
    g3_src = torch.randn(60, d)  # grad_h3 rows at their owners
    idx = torch.randperm(60)[:max_rows]
    idx[[2, 25]] = -1
    w2 = torch.randn(e, d, f) / 4
    for progs, tma, ahead, sk in ((1, False, 1, None), (3, True, 0, None), (7, False, 2, 64),
                                  (3, False, 1, 16), (7, True, 2, 32)):
        g3 = torch.full((max_rows, d), NAN)
        g2 = torch.full((max_rows, f), NAN)
        grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows,
                         a_row_ptrs=_row_ptrs(g3_src, idx, d), a_copy_out=device_ptr(g3),
                         claim_flags=flags, out=device_ptr(g2), num_programs=progs,
                         config=_cfg(tma=tma, claim_ahead=ahead,
                                     **({} if sk is None else dict(claim_slice_k=sk))))
        x = gather_rows_ref(g3_src, idx[:r])
        tag = f"dgrad progs={progs} tma={tma} ahead={ahead} slice_k={sk}"
        assert torch.equal(g3[:r], x), f"{tag}: saved grad_h3 rows"
        _untouched(f"{tag}: saved rows past R", g3[r:])
        _close(tag, g2[:r], grouped_mm_dgrad_ref(x, w2, offs, compute_dtype=torch.float64), dt)
        _untouched(f"{tag}: rows past R", g2[r:])
    # FPROP W2 with the scatter epilogue, same flags (epochs keep advancing)
    src = torch.randn(60, f)
    a_idx = torch.randperm(60)[:max_rows]
    a_idx[[0, 30]] = -1
    dst = torch.full((70, d), NAN)
    dst_idx = torch.randperm(70)[:max_rows]
    dst_idx[[1, 10]] = -1
    saved = torch.full((max_rows, f), NAN)
    grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=max_rows, a_row_ptrs=_row_ptrs(src, a_idx, f),
                   a_copy_out=saved, claim_flags=flags, epilogue="scatter",
                   out_row_ptrs=_row_ptrs(dst, dst_idx, d), num_programs=2)
    x = gather_rows_ref(src, a_idx[:r])
    assert torch.equal(saved[:r], x), "scatter: saved rows"
    ok = dst_idx[:r] >= 0
    _close("claim scatter", dst[dst_idx[:r][ok]],
           grouped_mm_fwd_ref(x, w2, offs, compute_dtype=torch.float64)[ok], dt)
    assert int(flags.epoch) == 6


def check_dgrad_swiglu_bwd_epilogue():
    """W2 DGRAD whose epilogue turns grad_h2 into grad_h1 over h1 in place (dense A, gathered A
    by claim, TMA or not, both activations); rows past R of h1 stay untouched."""
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import ClaimFlags, device_ptr, grouped_mm_dgrad
    from megatron_dist_moe.kernels.grouped_gemm_ref import gather_rows_ref, grouped_mm_dgrad_ref
    from megatron_dist_moe.kernels.rows_ref import act_bwd_ref, act_ref
    lens, d, f = [6, 0, 21, 13], 64, 48
    e, offs, r, max_rows = len(lens), _offsets(lens), sum(lens), sum(lens) + 3
    w2 = torch.randn(e, d, f) / 4
    src = torch.randn(60, d)
    idx = torch.randperm(60)[:max_rows]
    idx[[2, 25]] = -1
    flags = ClaimFlags(max_rows, None, e, "cpu")
    for progs, tma, clamped, claim in ((1, False, False, False), (3, True, True, False),
                                       (7, False, True, True), (2, True, False, True)):
        act = "swiglu_clamped" if clamped else "swiglu"
        h1 = torch.randn(max_rows, 2 * f) * 2
        h1[r:] = NAN
        h1_in = h1.clone()
        x = gather_rows_ref(src, idx[:r])
        kw = dict(a_row_ptrs=_row_ptrs(src, idx, d), a_copy_out=torch.full((max_rows, d), NAN),
                  claim_flags=flags) if claim else dict(a=x)
        h2 = torch.full((max_rows, f), NAN) if progs != 1 else None
        grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows, epilogue="swiglu_bwd",
                         h1=device_ptr(h1), h2=h2, activation=act, swiglu_alpha=1.702,
                         swiglu_limit=1.5, num_programs=progs, config=_cfg(tma=tma), **kw)
        gh2 = grouped_mm_dgrad_ref(x, w2, offs, compute_dtype=torch.float64)
        ref = act_bwd_ref(h1_in[:r].double(), gh2, f, clamped, 1.702, 1.5)
        tag = f"swiglu_bwd progs={progs} tma={tma} {act} claim={claim}"
        _close(tag, h1[:r], ref, torch.float32)
        _untouched(f"{tag}: h1 rows past R", h1[r:])
        if h2 is not None:  # rebuilt h2 = act(h1) from the same tile
            _close(f"{tag}: h2", h2[:r], act_ref(h1_in[:r].double(), f, clamped, 1.702, 1.5),
                   torch.float32)
            _untouched(f"{tag}: h2 rows past R", h2[r:])


def check_dgrad_swiglu_bwd_score_grads():
    """The same epilogue with expert-side score gradients (save_route_outputs=False): A rows are
    unscaled grad_y; per row with score s (read through score_ptrs) N tile j stores its part of
    <u, h2> (u = grad_y @ W2) at score + 4*M + j*4*M bytes (the owner's part slots), which
    `rows.sum_score_parts` sums in a fixed order; the kernel runs the SwiGLU backward on s*u and
    stores s*h2. A row whose score address is 0 gets no score gradient (its slots stay)."""
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import (
        ClaimFlags, device_ptr, grouped_mm_dgrad, score_parts_count)
    from megatron_dist_moe.kernels.rows import sum_score_parts
    from megatron_dist_moe.kernels.grouped_gemm_ref import gather_rows_ref, grouped_mm_dgrad_ref
    from megatron_dist_moe.kernels.rows_ref import act_bwd_ref, act_ref
    lens, d, f = [6, 0, 21, 13], 64, 48
    e, offs, r, max_rows = len(lens), _offsets(lens), sum(lens), sum(lens) + 3
    w2 = torch.randn(e, d, f) / 4
    src = torch.randn(60, d)
    idx = torch.randperm(60)[:max_rows]
    flags = ClaimFlags(max_rows, None, e, "cpu")
    for progs, tma, clamped, claim in ((1, False, False, False), (3, True, True, False),
                                       (5, False, False, True)):
        act = "swiglu_clamped" if clamped else "swiglu"
        h1 = torch.randn(max_rows, 2 * f) * 2
        h1[r:] = NAN
        h1_in = h1.clone()
        x = gather_rows_ref(src, idx[:r])
        scores = torch.rand(max_rows) + 0.25
        n_parts = score_parts_count(f, _cfg())                  # 48 / 32 -> 2
        both = torch.cat([scores, torch.full((3 * max_rows,), NAN)])   # scores | 3 part slices
        sptr = both.data_ptr() + torch.arange(max_rows, dtype=torch.int64) * 4
        sptr[9] = 0                                            # a row with no score address
        kw = dict(a_row_ptrs=_row_ptrs(src, idx, d), a_copy_out=torch.full((max_rows, d), NAN),
                  claim_flags=flags) if claim else dict(a=x)
        h2 = torch.full((max_rows, f), NAN)
        grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=max_rows, epilogue="swiglu_bwd",
                         h1=device_ptr(h1), h2=h2, activation=act, swiglu_alpha=1.702,
                         swiglu_limit=1.5, num_programs=progs, config=_cfg(tma=tma),
                         score_ptrs=sptr, score_grad_delta=4 * max_rows,
                         part_stride=4 * max_rows, **kw)
        parts = both[max_rows:].view(3, max_rows)
        assert torch.isnan(parts[n_parts:]).all(), "parts past the n-tiles written"
        assert torch.isnan(parts[:, 9]).all(), "a row without score address was written"
        ids = torch.zeros(max_rows, 1, dtype=torch.int32)
        ids[9] = -1                                             # the owner skips that route
        gs = torch.full((max_rows, 1), NAN)
        sum_score_parts(parts, n_parts, ids, gs)
        u = grouped_mm_dgrad_ref(x, w2, offs, compute_dtype=torch.float64)
        s = scores[:r].double().clone()
        s[9] = 0.0
        h2_ref = act_ref(h1_in[:r].double(), f, clamped, 1.702, 1.5)
        tag = f"score_grads progs={progs} tma={tma} {act} claim={claim}"
        g_ref = (u * h2_ref).sum(-1)
        keep = torch.arange(r) != 9
        _close(f"{tag}: grad_s", gs[:r, 0][keep], g_ref[keep], torch.float32)
        assert gs[9, 0] == 0, f"{tag}: an inactive route must get a zero score gradient"
        assert torch.isnan(parts[:n_parts, r:]).all(), f"{tag}: score gradients past R written"
        _close(tag, h1[:r], act_bwd_ref(h1_in[:r].double(), s[:, None] * u, f, clamped, 1.702,
                                        1.5), torch.float32)
        _close(f"{tag}: s h2", h2[:r], s[:, None] * h2_ref, torch.float32)
        _untouched(f"{tag}: h1 rows past R", h1[r:])
        _untouched(f"{tag}: h2 rows past R", h2[r:])


def check_claim_argument_errors():
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import ClaimFlags, grouped_mm_fwd
    w = torch.randn(2, 64, 64)
    offs, rows = _offsets([20, 20]), torch.zeros(40, dtype=torch.int64)
    copy = torch.zeros(40, 64)
    for kw, what in ((dict(a_row_ptrs=rows, claim_flags=ClaimFlags(40, None, 2, "cpu")), "no a_copy_out"),
                     (dict(a_row_ptrs=rows, a_copy_out=copy, claim_flags=ClaimFlags(8, 16, 2, "cpu")),
                      "flags too small for max_rows")):
        try:
            grouped_mm_fwd(w=w, expert_offsets=offs, max_rows=40, out=torch.zeros(40, 64), **kw)
        except AssertionError:
            continue
        raise AssertionError(f"claim mode accepted bad arguments ({what})")


CHECKS = {name[len("check_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")}


def _main(names):
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.path.insert(0, str(REPO))
    import torch
    import signal

    def _timeout(signum, frame):  # e.g. a claim-mode spin that never ends: fail, don't hang
        raise TimeoutError("check ran over 240 s")

    signal.signal(signal.SIGALRM, _timeout)
    for name in names or CHECKS:
        torch.manual_seed(0)
        t0 = time.time()
        signal.alarm(240)
        try:
            CHECKS[name]()
            res = {"name": name, "ok": True}
        except Exception as ex:  # reported to the parent test, which fails with the message
            import traceback
            res = {"name": name, "ok": False, "error": f"{type(ex).__name__}: {ex}",
                   "trace": traceback.format_exc()[-3000:]}
        signal.alarm(0)
        res["seconds"] = round(time.time() - t0, 2)
        print("RESULT " + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- pytest (parent)
@pytest.fixture(scope="module")
def interp_results():
    pytest.importorskip("triton")
    return tt.run_child_checks([__file__])[0]


@pytest.mark.parametrize("name", list(CHECKS))
def test_grouped_gemm_interpreter(interp_results, name):
    tt.assert_child_check(interp_results, name)


if __name__ == "__main__":
    _main(sys.argv[1:])


def test_tile_choice_by_rows_per_expert(monkeypatch):
    """The GPU tile tables by rows per expert (device=cuda picks the GPU tables without a GPU):
    bf16 FPROP decode tiles up to DECODE_ROWS rows per expert where K allows them (never for
    DGRAD/WGRAD); nvfp4 tiers at 16 / 64 / 128 rows per expert."""
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import config as C
    from megatron_dist_moe.kernels.grouped_gemm.config import (CONFIG_TABLE, DECODE_ROWS,
                                                               INTERPRETER_CONFIG, select_config)
    from megatron_dist_moe.kernels.grouped_gemm import nvfp4 as GN
    cuda = torch.device("cuda")
    monkeypatch.setattr(C, "interpreting", lambda: False)   # also under TRITON_INTERPRET=1
    decode = CONFIG_TABLE[("fwd", "decode")]
    assert select_config("fwd", n=6144, kd=7168, device=cuda, rows_per_expert=8) == decode
    assert select_config("fwd", n=6144, kd=7168, device=cuda,
                         rows_per_expert=DECODE_ROWS) == decode
    assert select_config("fwd", n=6144, kd=7168, device=cuda,
                         rows_per_expert=DECODE_ROWS + 1) == CONFIG_TABLE[("fwd", "large")]
    assert select_config("fwd", n=6144, kd=7168, device=cuda) == CONFIG_TABLE[("fwd", "large")]
    # K = 192 is no multiple of the decode tiles' 128: the training tiles (64) take it
    assert select_config("fwd", n=256, kd=192, device=cuda,
                         rows_per_expert=8) == CONFIG_TABLE[("fwd", "small")]
    assert select_config("dgrad", n=3072, kd=7168, device=cuda,
                         rows_per_expert=8) == CONFIG_TABLE[("dgrad", "large")]
    # CPU tensors (the interpreter) keep its tiny tiles
    assert select_config("fwd", n=6144, kd=7168, device=torch.device("cpu"),
                         rows_per_expert=8) == INTERPRETER_CONFIG
    E = 6
    assert GN.default_tiles(16 * E, E) == GN.DECODE_TILES
    assert GN.default_tiles(16 * E + 1, E) == GN.SMALL_TILES
    assert GN.default_tiles(64 * E + 1, E) == GN.MEDIUM_TILES
    assert GN.default_tiles(128 * E + 1, E) == GN.LARGE_TILES


def test_fprop_passes_rows_per_expert_outside_claim_mode(monkeypatch):
    """grouped_mm_fwd asks for tiles with ceil(max_rows / E) rows per expert, and with none in
    claim mode (the staged pipeline keeps the tiles its claim schedule was measured with)."""
    import torch
    from megatron_dist_moe.kernels.grouped_gemm import (INTERPRETER_CONFIG, ClaimFlags,
                                                        grouped_mm_fwd)
    from megatron_dist_moe.kernels.grouped_gemm import mm
    seen = []

    def record(kind, **kw):
        seen.append((kind, kw.get("rows_per_expert")))
        return INTERPRETER_CONFIG

    monkeypatch.setattr(mm, "select_config", record)
    monkeypatch.setattr(mm, "_launch_mm", lambda *a, **k: None)
    E, D, F, R = 3, 32, 16, 40
    w13 = torch.zeros(E, 2 * F, D)
    offs = torch.tensor([0, 10, 25, 40], dtype=torch.int32)
    x, h1, h2 = torch.zeros(R, D), torch.zeros(R, 2 * F), torch.zeros(R, F)
    grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=R, a=x, epilogue="swiglu", h1=h1, h2=h2)
    rows = torch.zeros(R, dtype=torch.int64)
    grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=R, a_row_ptrs=rows, a_copy_out=x,
                   claim_flags=ClaimFlags(R, None, E, "cpu"), epilogue="swiglu", h1=h1, h2=h2)
    assert seen == [("fwd", 14), ("fwd", None)], seen

"""Checks of the Mega kernels against the standard pipeline's launches, on any device:
- the forward (kernels/grouped_gemm/mega.py) against grouped_mm_fwd with the SwiGLU epilogue,
  then with the scatter: h2, h1 and the scattered rows agree to the summation order (the same
  tiles, one bf16 rounding each);
- the backward's two launches (mega_bwd.py) against grouped_mm_dgrad (SwiGLU backward, with and
  without score gradients; scatter) and grouped_mm_wgrad: grad_h1, h2, the score-gradient parts,
  the scattered grad_x rows and both weight gradients (stored bf16 / fp32, or added into an
  ExpertOutTable), with empty experts and a second launch on the same flags.
Run by tests/cpu/test_kernel_checks_interp.py and tests/gpu/test_kernel_checks_gpu.py.
"""

from __future__ import annotations

import torch
from kernel_checks import close as _close  # noqa: E402  (tests/ on sys.path)


BF = torch.bfloat16


def _problem(device, big, lens):
    E = len(lens)
    D, F = (7168, 3072) if big else (128, 96)
    g = torch.Generator().manual_seed(sum(lens))
    R = sum(lens)
    dt = BF
    x = torch.randn(R, D, generator=g).to(dt).to(device)
    w13 = (torch.randn(E, 2 * F, D, generator=g) / D ** 0.5).to(dt).to(device)
    w2 = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(dt).to(device)
    offs = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)
    return E, D, F, R, x, w13, w2, offs




def check_mega_matches_two_launches(device, big=False):
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_fwd
    from megatron_dist_moe.kernels.grouped_gemm.mega import MegaFlags, mega_config, mega_fwd
    cases = ([[8, 0, 1, 13, 5, 7], [900, 0, 2048, 1, 1800, 77]] if big
             else [[20, 0, 3, 37], [1, 1, 0, 0], [0, 0, 0, 0]])
    for lens in cases:
        for act in ("swiglu", "swiglu_clamped"):
            E, D, F, R, x, w13, w2, offs = _problem(device, big, lens)
            mega_cfg = mega_config(2 * F, D, x.device, R + 5, E)   # mega_fwd's default
            flags = MegaFlags(R + 5, E, device)
            kw = dict(activation=act, swiglu_alpha=1.702, swiglu_limit=1.5)
            h1r = torch.full((max(R, 1), 2 * F), float("nan"), dtype=BF, device=device)
            h2r = torch.full((max(R, 1), F), float("nan"), dtype=BF, device=device)
            # the reference launches run the Mega kernel's tiles (its default config), so h1
            # and h2 must match bit for bit
            grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=R + 5, a=x, epilogue="swiglu",
                           h1=h1r, h2=h2r, config=mega_cfg, **kw)
            dst_r = torch.full((R + 2, D), float("nan"), dtype=BF, device=device)
            perm = torch.randperm(R + 2, generator=torch.Generator().manual_seed(3))[:R].to(device)
            ptrs = (dst_r.data_ptr() + perm.long() * D * 2) if R else torch.zeros(
                1, dtype=torch.int64, device=device)
            if R > 3:
                ptrs[3] = 0
            grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=R + 5, a=h2r, config=mega_cfg,
                           epilogue="scatter", out_row_ptrs=torch.cat(
                               [ptrs, torch.zeros(5, dtype=torch.int64, device=device)]))
            h1 = torch.full_like(h1r, float("nan"))
            h2 = torch.full_like(h2r, float("nan"))
            dst = torch.full_like(dst_r, float("nan"))
            ptrs_m = (dst.data_ptr() + perm.long() * D * 2) if R else ptrs.clone()
            if R > 3:
                ptrs_m[3] = 0
            for _ in range(2):      # a second launch: the epoch-based counters need no reset
                mega_fwd(xg=x, w13=w13, w2=w2, expert_offsets=offs, max_rows=R + 5, h2=h2,
                         h1=h1, out_row_ptrs=torch.cat(
                             [ptrs_m, torch.zeros(5, dtype=torch.int64, device=device)]),
                         flags=flags, **kw)
            tag = f"lens={lens} {act}"
            assert flags.status.tolist() == [0, 0, 0, 0], f"{tag}: a wait gave up {flags.status}"
            if R == 0:
                continue
            _close(f"{tag} h1", h1[:R].float(), h1r[:R].float(), 0.0)
            _close(f"{tag} h2", h2[:R].float(), h2r[:R].float(), 0.0)
            keep = torch.arange(R, device=device) != 3
            _close(f"{tag} h3", dst[perm][keep].float(), dst_r[perm][keep].float(), 8e-3)
            if R > 3:
                assert torch.isnan(dst[perm[3]].float()).all(), f"{tag}: address 0 written"


def _scatter_ptrs(dst, R, device, skip=3):
    """Row addresses of a shuffled dst [>= R, width] (row `skip` 0: not written), 5 spare 0s."""
    perm = torch.randperm(dst.shape[0], generator=torch.Generator().manual_seed(5))[:R]
    perm = perm.to(device)
    ptrs = dst.data_ptr() + perm.long() * dst.shape[1] * dst.element_size()
    if R > skip:
        ptrs[skip] = 0
    return perm, torch.cat([ptrs, torch.zeros(5, dtype=torch.int64, device=device)])


def check_mega_bwd_matches_standard(device, big=False):
    from megatron_dist_moe.kernels.grouped_gemm import (ExpertOutTable, grouped_mm_dgrad,
                                                        grouped_mm_wgrad)
    from megatron_dist_moe.kernels.grouped_gemm.mega import MegaFlags
    from megatron_dist_moe.kernels.grouped_gemm.mega_bwd import mega_bwd_w13, mega_bwd_w2
    cases = ([[900, 0, 2048, 1, 1800, 77]] if big else [[20, 0, 3, 37], [0, 0, 0, 0]])
    # (activation, score gradients, WGRAD output, list order of the W2 / W13 launch)
    variants = [("swiglu", False, "bf16", (1, 0)), ("swiglu_clamped", True, "fp32", (0, 9)),
                ("swiglu", False, "table", (9, 1))]
    for lens in cases:
        for act, scored, wg, (lag2, lag13) in variants:
            E, D, F, R, x, w13, w2, offs = _problem(device, big, lens)
            tag = f"lens={lens} {act} scored={scored} wgrad={wg} lags={lag2},{lag13}"
            g = torch.Generator().manual_seed(11)
            Rp = max(R, 1)
            g3 = torch.randn(Rp, D, generator=g).to(BF).to(device)
            h1_0 = (torch.randn(Rp, 2 * F, generator=g) * 2).to(BF).to(device)
            kw = dict(activation=act, swiglu_alpha=1.702, swiglu_limit=1.5)
            scores = torch.rand(Rp, generator=g) + 0.5
            base13 = torch.randn(E, 2 * F, D, generator=g).to(device)
            base2 = torch.randn(E, D, F, generator=g).to(device)
            flags = MegaFlags(R + 5, E, device)
            runs = {}
            for which in ("standard", "mega"):
                h1 = h1_0.clone()
                h2 = torch.full((Rp, F), float("nan"), dtype=BF, device=device)
                sc = {}
                if scored:   # each row's score in a buffer with room for its parts after it
                    parts = -(-F // 16)
                    sbuf = torch.zeros(Rp, 1 + parts, dtype=torch.float32, device=device)
                    sbuf[:, 0] = scores.to(device)
                    sptr = sbuf.data_ptr() + torch.arange(Rp, device=device) * sbuf.stride(0) * 4
                    sc = dict(score_ptrs=torch.cat([sptr, torch.zeros(5, dtype=torch.int64,
                                                                      device=device)]),
                              score_grad_delta=4, part_stride=4)
                if wg == "table":
                    o13 = ExpertOutTable.of(list(base13.clone()))
                    o2 = ExpertOutTable.of(list(base2.clone()))
                else:
                    dt = BF if wg == "bf16" else torch.float32
                    o13 = torch.full((E, 2 * F, D), float("nan"), dtype=dt, device=device)
                    o2 = torch.full((E, D, F), float("nan"), dtype=dt, device=device)
                dx = torch.full((R + 2, D), float("nan"), dtype=BF, device=device)
                perm, xptrs = _scatter_ptrs(dx, R, device)
                if which == "standard":
                    grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=R + 5, a=g3,
                                     epilogue="swiglu_bwd", h1=h1, h2=h2, **sc, **kw)
                    grouped_mm_wgrad(g3, h2, offs, o2, accumulate=wg == "table", dtype=BF)
                    grouped_mm_dgrad(w=w13, expert_offsets=offs, max_rows=R + 5, a=h1,
                                     epilogue="scatter", out_row_ptrs=xptrs)
                    grouped_mm_wgrad(h1, x, offs, o13, accumulate=wg == "table", dtype=BF)
                else:
                    # a second launch on the same flags: the epochs need no reset
                    for _ in range(2 if wg == "bf16" else 1):
                        h1.copy_(h1_0)
                        mega_bwd_w2(g3=g3, w2=w2, h1=h1, h2=h2, expert_offsets=offs,
                                    max_rows=R + 5, grad_w2=o2, flags=flags, lag=lag2, **sc,
                                    **kw)
                        mega_bwd_w13(grad_h1=h1, w13=w13, x_g=x, expert_offsets=offs,
                                     max_rows=R + 5, grad_x_row_ptrs=xptrs, grad_w13=o13,
                                     flags=flags, lag=lag13)
                    assert flags.status.tolist() == [0, 0, 0, 0], (
                        f"{tag}: a wait gave up {flags.status}")
                w13g = torch.stack(list(o13.tensors)) if wg == "table" else o13
                w2g = torch.stack(list(o2.tensors)) if wg == "table" else o2
                runs[which] = (h1, h2, sbuf if scored else None, dx, perm, w13g, w2g)
            (h1s, h2s, ss, dxs, perm, w13s, w2s), (h1m, h2m, sm, dxm, _, w13m, w2m) = (
                runs["standard"], runs["mega"])
            _close(f"{tag} grad_w2", w2m.float(), w2s.float(), 0.0)
            _close(f"{tag} grad_w13", w13m.float(), w13s.float(), 0.0)
            if R == 0:
                continue
            _close(f"{tag} grad_h1", h1m[:R].float(), h1s[:R].float(), 0.0)
            _close(f"{tag} h2", h2m[:R].float(), h2s[:R].float(), 0.0)
            if scored:
                _close(f"{tag} score parts", sm[:R], ss[:R], 0.0)
            keep = torch.arange(R, device=device) != 3
            _close(f"{tag} grad_x", dxm[perm][keep].float(), dxs[perm][keep].float(), 0.0)
            if R > 3:
                assert torch.isnan(dxm[perm[3]].float()).all(), f"{tag}: address 0 written"


CHECKS = {f.__name__[len("check_"):]: f for f in (check_mega_matches_two_launches,
                                                  check_mega_bwd_matches_standard)}

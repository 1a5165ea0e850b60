"""Checks of the Mega forward kernel (kernels/grouped_gemm/mega.py) against the standard
pipeline's two launches (grouped_mm_fwd with the SwiGLU epilogue, then with the scatter), on any
device: h2, h1 and the scattered rows agree to the summation order (the same tiles, one bf16
rounding each). Run by tests/cpu/test_kernel_checks_interp.py and tests/gpu/test_kernel_checks_gpu.py.
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


CHECKS = {f.__name__[len("check_"):]: f for f in (check_mega_matches_two_launches,)}

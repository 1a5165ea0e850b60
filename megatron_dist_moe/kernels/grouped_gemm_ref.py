"""Plain-torch twins of the grouped GEMM launchers in `grouped_gemm.py`.

Same math, same rounding points, no Triton: inputs are upcast to `compute_dtype` (fp32 by
default; tests pass fp64 as the oracle), products accumulate there, and results are rounded to
`out_dtype` where the kernels store them. For the "swiglu" epilogue h1 is rounded to `out_dtype`
before the activation, exactly as the kernel does.

The twins take dense tensors where the launchers take device pointers or row-address tables:
a gathered A is passed already gathered (zero rows where the address was 0), and a scattered
result is returned dense [R, N]; `scatter_rows_ref` applies the row-address semantics with
indices. They read `expert_offsets` on the host (one sync), which is fine for a reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..activation import Activation

__all__ = [
    "expert_ranges",
    "swiglu_ref",
    "grouped_mm_fwd_ref",
    "grouped_mm_fwd_swiglu_ref",
    "grouped_mm_dgrad_ref",
    "grouped_mm_wgrad_ref",
    "gather_rows_ref",
    "scatter_rows_ref",
]


def expert_ranges(expert_offsets: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] per expert from int32 [E+1] cumulative row ends (host sync)."""
    psum = expert_offsets.tolist()
    return [(psum[e], psum[e + 1]) for e in range(len(psum) - 1)]


def _grouped(a_RK: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor, *,
             transpose_w: bool, compute_dtype: torch.dtype) -> torch.Tensor:
    n = w.shape[1] if transpose_w else w.shape[2]
    out = torch.zeros(a_RK.shape[0], n, dtype=compute_dtype, device=a_RK.device)
    for e, (s, t) in enumerate(expert_ranges(expert_offsets)):
        if t > s:
            w_e = w[e].to(compute_dtype)
            out[s:t] = a_RK[s:t].to(compute_dtype) @ (w_e.T if transpose_w else w_e)
    return out


def grouped_mm_fwd_ref(a_RK: torch.Tensor, w_ENK: torch.Tensor, expert_offsets: torch.Tensor, *,
                       out_dtype: Optional[torch.dtype] = None,
                       compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out [R, N] = a[r] @ w[e].T per expert segment, rounded to out_dtype (default w.dtype).

    Rows past expert_offsets[-1] are left zero.
    """
    out = _grouped(a_RK, w_ENK, expert_offsets, transpose_w=True, compute_dtype=compute_dtype)
    return out.to(out_dtype or w_ENK.dtype)


def grouped_mm_dgrad_ref(a_RK: torch.Tensor, w_EKN: torch.Tensor, expert_offsets: torch.Tensor, *,
                         out_dtype: Optional[torch.dtype] = None,
                         compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out [R, N] = a[r] @ w[e] per expert segment, rounded to out_dtype (default w.dtype)."""
    out = _grouped(a_RK, w_EKN, expert_offsets, transpose_w=False, compute_dtype=compute_dtype)
    return out.to(out_dtype or w_EKN.dtype)


def swiglu_ref(h1_R2F: torch.Tensor, *, activation: str = "swiglu", swiglu_alpha: float = 1.702,
               swiglu_limit: float = 7.0) -> torch.Tensor:
    """h2 [R, F] from h1 = [gate | up], computed in h1's dtype (pass an upcast h1)."""
    return Activation(activation, swiglu_alpha, swiglu_limit).forward(h1_R2F)


def grouped_mm_fwd_swiglu_ref(a_RD: torch.Tensor, w13_E2FD: torch.Tensor,
                              expert_offsets: torch.Tensor, *, activation: str = "swiglu",
                              swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                              out_dtype: Optional[torch.dtype] = None,
                              compute_dtype: torch.dtype = torch.float32,
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h1 [R, 2F], h2 [R, F]) of the "swiglu" epilogue, both in out_dtype (default w dtype).

    h1 is rounded to out_dtype first; h2 is computed in compute_dtype from that rounded h1.
    Rows past expert_offsets[-1] hold act(0) = 0 (the kernel does not write them).
    """
    out_dtype = out_dtype or w13_E2FD.dtype
    h1 = grouped_mm_fwd_ref(a_RD, w13_E2FD, expert_offsets, out_dtype=out_dtype,
                            compute_dtype=compute_dtype)
    h2 = swiglu_ref(h1.to(compute_dtype), activation=activation, swiglu_alpha=swiglu_alpha,
                    swiglu_limit=swiglu_limit)
    return h1, h2.to(out_dtype)


def grouped_mm_wgrad_ref(a_RM: torch.Tensor, b_RN: torch.Tensor, expert_offsets: torch.Tensor, *,
                         out: Optional[torch.Tensor] = None, accumulate: bool = False,
                         out_dtype: torch.dtype = torch.float32,
                         compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out [E, M, N]: out[e] = a_e.T @ b_e (zeros for empty experts), or out[e] += ... when
    accumulate (empty experts untouched). Returns a new tensor; `out` is only read."""
    num_experts = expert_offsets.numel() - 1
    m, n = a_RM.shape[1], b_RN.shape[1]
    if accumulate:
        assert out is not None, "accumulate=True needs the previous out"
        res = out.to(compute_dtype).clone()
        out_dtype = out.dtype
    else:
        res = torch.zeros(num_experts, m, n, dtype=compute_dtype, device=a_RM.device)
    for e, (s, t) in enumerate(expert_ranges(expert_offsets)):
        if t > s:
            res[e] += a_RM[s:t].to(compute_dtype).T @ b_RN[s:t].to(compute_dtype)
    return res.to(out_dtype)


def gather_rows_ref(src_SK: torch.Tensor, src_idx_R: torch.Tensor) -> torch.Tensor:
    """A [R, K] with row r = src[src_idx[r]], or zeros where src_idx[r] < 0 (address 0)."""
    out = torch.zeros(src_idx_R.numel(), src_SK.shape[1], dtype=src_SK.dtype, device=src_SK.device)
    ok = src_idx_R >= 0
    out[ok] = src_SK[src_idx_R[ok]]
    return out


def scatter_rows_ref(dst_TN: torch.Tensor, rows_RN: torch.Tensor, dst_idx_R: torch.Tensor) -> torch.Tensor:
    """Copy of dst with dst[dst_idx[r]] = rows[r] for dst_idx[r] >= 0 (negative: skipped)."""
    out = dst_TN.clone()
    ok = dst_idx_R >= 0
    out[dst_idx_R[ok]] = rows_RN[ok].to(dst_TN.dtype)
    return out

"""The expert MLP on received rows: gather -> W13 -> SwiGLU -> W2 -> scatter, and its backward.

x_g and h1 are written to (forward) and read from (backward) device-chosen addresses: the
activation slot when the planner keeps full state, the shared scratch otherwise. Every other
intermediate lives in the plan's scratch region at host-known offsets (`ScratchLayout`).

GEMM engines behind one interface:
    "triton"  our persistent grouped GEMMs (kernels/grouped_gemm.py); SwiGLU fused into the W13
              epilogue; W2 stores rows straight into the token owners' combine buffers.
              pipeline "standard": gather kernel, then W13, then W2 (3 launches);
              pipeline "staged":   W13 reads the peer rows itself (gather fused into its A
                                   loads, saved through a_copy_out), then W2 (2 launches).
    "torch"   torch._grouped_mm (first step and baseline) with separate gather / SwiGLU /
              scatter kernels; its outputs are copied to the chosen addresses.
Device predicates (replay or not) zero the expert offsets and row counts, so the launch sequence
is the same either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ...config import Config
from ...kernels import rows as K_rows
from ...memory_plan import align128
from .routing import RoutingTables

__all__ = ["ExpertPipeline", "ScratchLayout", "default_gemm_engine"]


def default_gemm_engine() -> str:
    return os.environ.get("DIST_MOE_GEMM", "triton")


@dataclass(frozen=True)
class ScratchLayout:
    """Byte offsets (from the activation buffer base) of the scratch tensors, for R_max rows.

    Backward reuse (guide §04): grad_h1 overwrites h2 and g3 after both were read.
    """

    xg: int
    h1: int
    h2: int
    g3: int
    grad_h1: int
    grad_h2: int
    end: int

    @classmethod
    def build(cls, base: int, R: int, D: int, F: int) -> "ScratchLayout":
        xg = base
        h1 = xg + align128(R * D * 2)
        h2 = h1 + align128(R * 2 * F * 2)
        g3 = h2 + align128(R * F * 2)
        top = max(align128(R * F * 2) + align128(R * D * 2), align128(R * 2 * F * 2))
        grad_h2 = h2 + top
        return cls(xg=xg, h1=h1, h2=h2, g3=g3, grad_h1=h2, grad_h2=grad_h2,
                   end=grad_h2 + align128(R * F * 2))


def _predicated(tabs: RoutingTables, predicate: torch.Tensor | None):
    if predicate is None:
        return tabs.expert_offsets, tabs.num_rows
    offs = torch.where(predicate, tabs.expert_offsets, torch.zeros_like(tabs.expert_offsets))
    return offs, offs[-1:]


class ExpertPipeline:
    def __init__(self, cfg: Config, num_local_experts: int, max_rows: int,
                 act_buffer: torch.Tensor, scratch_offset: int, pipeline: str = "standard",
                 gemm: str | None = None):
        self.cfg = cfg
        self.E = num_local_experts
        self.max_rows = max_rows
        self.device = act_buffer.device
        self.pipeline = pipeline
        self.gemm = gemm or default_gemm_engine()
        if self.gemm not in ("triton", "torch"):
            raise ValueError(f"DIST_MOE_GEMM={self.gemm!r}: expected 'triton' or 'torch'")
        self.clamped = cfg.activation == "swiglu_clamped"
        D, F = cfg.hidden_dim, cfg.intermediate_dim
        self.lay = ScratchLayout.build(act_buffer.data_ptr() + scratch_offset, max_rows, D, F)
        if self.lay.end > act_buffer.data_ptr() + act_buffer.numel():
            raise RuntimeError("scratch layout exceeds the planned activation buffer "
                               f"({self.lay.end - act_buffer.data_ptr()} > {act_buffer.numel()} B)")

        def ptr(addr: int) -> torch.Tensor:
            return torch.tensor([addr], dtype=torch.int64, device=self.device)

        self.p_xg, self.p_h1, self.p_h2 = ptr(self.lay.xg), ptr(self.lay.h1), ptr(self.lay.h2)
        self.p_g3, self.p_gh1, self.p_gh2 = ptr(self.lay.g3), ptr(self.lay.grad_h1), ptr(self.lay.grad_h2)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, tabs: RoutingTables, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor,
                scatter_ptrs: torch.Tensor, xg_addr: torch.Tensor, h1_addr: torch.Tensor,
                predicate: torch.Tensor | None = None) -> None:
        """Expert MLP of the received rows; x_g and h1 land at xg_addr / h1_addr (device ptrs),
        route outputs h3 at scatter_ptrs (peer combine rows)."""
        cfg = self.cfg
        D, F = cfg.hidden_dim, cfg.intermediate_dim
        Rm = self.max_rows
        offs, nrows = _predicated(tabs, predicate)
        if self.gemm == "torch":
            xg = torch.empty(Rm, D, dtype=torch.bfloat16, device=self.device)
            K_rows.gather_rows(tabs.fwd_gather_ptrs, K_rows.device_ptr(xg), nrows, D,
                               torch.bfloat16, Rm)
            h1 = torch._grouped_mm(xg, w13_E2FD.transpose(1, 2), offs=offs[1:])
            h2 = torch.empty(Rm, F, dtype=torch.bfloat16, device=self.device)
            K_rows.swiglu_fwd(K_rows.device_ptr(h1), K_rows.device_ptr(h2), nrows, F, Rm,
                              self.clamped, cfg.swiglu_alpha, cfg.swiglu_limit)
            h3 = torch._grouped_mm(h2, w2_EDF.transpose(1, 2), offs=offs[1:])
            K_rows.scatter_rows(K_rows.device_ptr(h3), scatter_ptrs, nrows, D, torch.bfloat16, Rm)
            K_rows.copy_rows(K_rows.device_ptr(xg), xg_addr, nrows, D, Rm)
            K_rows.copy_rows(K_rows.device_ptr(h1), h1_addr, nrows, 2 * F, Rm)
            return
        from ...kernels.grouped_gemm import grouped_mm_fwd
        act = dict(activation=cfg.activation, swiglu_alpha=cfg.swiglu_alpha,
                   swiglu_limit=cfg.swiglu_limit)
        if self.pipeline == "staged":
            grouped_mm_fwd(w=w13_E2FD, expert_offsets=offs, max_rows=Rm,
                           a_row_ptrs=tabs.fwd_gather_ptrs, a_copy_out=xg_addr,
                           epilogue="swiglu", h1=h1_addr, h2=self.p_h2, **act)
        else:
            K_rows.gather_rows(tabs.fwd_gather_ptrs, xg_addr, nrows, D, torch.bfloat16, Rm)
            grouped_mm_fwd(w=w13_E2FD, expert_offsets=offs, max_rows=Rm, a=xg_addr,
                           epilogue="swiglu", h1=h1_addr, h2=self.p_h2, **act)
        grouped_mm_fwd(w=w2_EDF, expert_offsets=offs, max_rows=Rm, a=self.p_h2,
                       epilogue="scatter", out_row_ptrs=scatter_ptrs)

    # -- backward ----------------------------------------------------------------------------
    def backward(self, tabs: RoutingTables, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor,
                 gather_ptrs: torch.Tensor, scatter_ptrs: torch.Tensor, xg_addr: torch.Tensor,
                 h1_addr: torch.Tensor, wgrad_dtype: str):
        """Returns (grad_w13 [E,2F,D], grad_w2 [E,D,F]); route input gradients are stored at
        scatter_ptrs (owners' dispatch rows). grad_h3 rows are read from gather_ptrs."""
        cfg = self.cfg
        D, F = cfg.hidden_dim, cfg.intermediate_dim
        Rm = self.max_rows
        offs, nrows = tabs.expert_offsets, tabs.num_rows
        out_dtype = torch.float32 if wgrad_dtype == "fp32" else torch.bfloat16
        act = (F, Rm, self.clamped, cfg.swiglu_alpha, cfg.swiglu_limit)
        if self.gemm == "torch":
            return self._backward_torch(tabs, w13_E2FD, w2_EDF, gather_ptrs, scatter_ptrs,
                                        xg_addr, h1_addr, out_dtype)
        from ...kernels.grouped_gemm import grouped_mm_dgrad, grouped_mm_wgrad
        # h2 is rebuilt from h1 (BF16 full-save keeps h1, not h2).
        K_rows.swiglu_fwd(h1_addr, self.p_h2, nrows, *act)
        if self.pipeline == "staged":
            grouped_mm_dgrad(w=w2_EDF, expert_offsets=offs, max_rows=Rm, a_row_ptrs=gather_ptrs,
                             a_copy_out=self.p_g3, epilogue="store", out=self.p_gh2)
        else:
            K_rows.gather_rows(gather_ptrs, self.p_g3, nrows, D, torch.bfloat16, Rm)
            grouped_mm_dgrad(w=w2_EDF, expert_offsets=offs, max_rows=Rm, a=self.p_g3,
                             epilogue="store", out=self.p_gh2)
        grad_w2 = torch.empty(self.E, D, F, dtype=out_dtype, device=self.device)
        grouped_mm_wgrad(self.p_g3, self.p_h2, offs, grad_w2, dtype=torch.bfloat16)
        K_rows.swiglu_bwd(h1_addr, self.p_gh2, self.p_gh1, nrows, *act)
        grouped_mm_dgrad(w=w13_E2FD, expert_offsets=offs, max_rows=Rm, a=self.p_gh1,
                         epilogue="scatter", out_row_ptrs=scatter_ptrs)
        grad_w13 = torch.empty(self.E, 2 * F, D, dtype=out_dtype, device=self.device)
        grouped_mm_wgrad(self.p_gh1, xg_addr, offs, grad_w13, dtype=torch.bfloat16)
        return grad_w13, grad_w2

    def _backward_torch(self, tabs, w13_E2FD, w2_EDF, gather_ptrs, scatter_ptrs, xg_addr,
                        h1_addr, out_dtype):
        cfg = self.cfg
        D, F = cfg.hidden_dim, cfg.intermediate_dim
        Rm = self.max_rows
        offs, nrows = tabs.expert_offsets, tabs.num_rows
        bf = dict(dtype=torch.bfloat16, device=self.device)
        xg = torch.empty(Rm, D, **bf)
        h1 = torch.empty(Rm, 2 * F, **bf)
        K_rows.copy_rows(xg_addr, K_rows.device_ptr(xg), nrows, D, Rm)
        K_rows.copy_rows(h1_addr, K_rows.device_ptr(h1), nrows, 2 * F, Rm)
        g3 = torch.empty(Rm, D, **bf)
        K_rows.gather_rows(gather_ptrs, K_rows.device_ptr(g3), nrows, D, torch.bfloat16, Rm)
        grad_h2 = torch._grouped_mm(g3, w2_EDF, offs=offs[1:])
        h2 = torch.empty(Rm, F, **bf)
        K_rows.swiglu_fwd(K_rows.device_ptr(h1), K_rows.device_ptr(h2), nrows, F, Rm,
                          self.clamped, cfg.swiglu_alpha, cfg.swiglu_limit)
        # torch._grouped_mm stores in the operand dtype only (fp32 accumulation inside), so an
        # fp32 wgrad_dtype is an upcast of bf16-rounded sums on this engine.
        grad_w2 = torch._grouped_mm(g3.t(), h2, offs=offs[1:]).to(out_dtype)
        grad_h1 = torch.empty(Rm, 2 * F, **bf)
        K_rows.swiglu_bwd(K_rows.device_ptr(h1), K_rows.device_ptr(grad_h2),
                          K_rows.device_ptr(grad_h1), nrows, F, Rm, self.clamped,
                          cfg.swiglu_alpha, cfg.swiglu_limit)
        grad_xg = torch._grouped_mm(grad_h1, w13_E2FD, offs=offs[1:])
        K_rows.scatter_rows(K_rows.device_ptr(grad_xg), scatter_ptrs, nrows, D, torch.bfloat16, Rm)
        grad_w13 = torch._grouped_mm(grad_h1.t(), xg, offs=offs[1:]).to(out_dtype)
        return grad_w13, grad_w2

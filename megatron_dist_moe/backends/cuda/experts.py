"""The expert MLP on received rows: gather -> W13 -> SwiGLU -> W2 -> scatter, and its backward.

x_g and h1 are written to (forward) and read from (backward) device-chosen addresses: the
activation slot when the planner keeps full state, the shared scratch otherwise. Every other
intermediate lives in the scratch region, laid out per call for the received rows
(`ScratchPointers`).

GEMM engines behind one interface:
    "triton"  our persistent grouped GEMMs (kernels/grouped_gemm.py); SwiGLU fused into the W13
              epilogue; W2 stores rows straight into the token owners' combine buffers.
              pipeline "standard": gather kernel, then W13, then W2 (3 launches);
              pipeline "staged":   W13 gathers its own A rows (2 launches): the first program
                                   to reach an m-tile claims it, copies the peer rows into x_g
                                   and publishes a readiness flag; the n-tile programs of that
                                   m-tile wait on the flag, then read x_g (grouped_gemm
                                   A_CLAIM); W2 DGRAD gathers grad_h3 the same way.
    "torch"   torch._grouped_mm (first step and baseline) with separate gather / SwiGLU /
              scatter kernels; its outputs are copied to the chosen addresses.
DIST_MOE_W13_CUTLASS=coop|pingpong (opt-in, standard pipeline of the "triton" engine): the W13
FPROP runs on CUTLASS's Hopper warp-specialized grouped GEMM (kernels/grouped_gemm_sm90.py,
csrc/), storing h1 at its chosen address, and SwiGLU runs as a row kernel after it.
DIST_MOE_WGRAD_CUTLASS=coop (opt-in, "triton" engine, either pipeline): both WGRADs run on CUTLASS's
grouped GEMM with the ragged row count as K (GroupedWgradSm90). Measured even with our Triton
WGRAD on 2xH200 (docs/perf_notes.md), so it stays opt-in.
The WGRADs store the weights' dtype (`wgrad_store_dtype`): the op returns weight gradients in it,
and rounding an fp32 store afterwards gives the same bits at three times the bytes.
Device predicates (replay or not) zero the expert offsets and row counts, so the launch sequence
is the same either way.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from ...config import Config, env_switch
from ...kernels import rows as K_rows
from ...memory_plan import align128
from .routing import RoutingTables

__all__ = ["ExpertPipeline", "ScratchPointers", "default_gemm_engine"]


def wgrad_store_dtype(wgrad_dtype: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the WGRAD GEMMs store: Config.wgrad_dtype, but never wider than the weights.

    The op returns weight gradients in the weights' dtype (autograd's rule, library.py). The
    kernels sum in fp32 and round once in their epilogue, so storing fp32 and rounding to bf16
    afterwards gives the same bits as storing bf16 directly (GPU tests
    `test_wgrad_bf16_store_equals_rounded_fp32_store`, Triton and CUTLASS). On bf16 weights the
    fp32 store only costs bytes: at the guide load 1.6 GB of fp32 written, read back and 0.8 GB
    of bf16 written per backward, ~1 ms of a 9.6 ms fwd+bwd on 2xH200."""
    if wgrad_dtype not in ("bf16", "fp32"):
        raise ValueError(f"wgrad_dtype {wgrad_dtype!r}: expected 'bf16' or 'fp32'")
    if wgrad_dtype == "fp32" and weight_dtype in (torch.float32, torch.float64):
        return torch.float32
    return torch.bfloat16


def default_gemm_engine() -> str:
    return os.environ.get("DIST_MOE_GEMM", "triton")


@dataclass
class ScratchPointers:
    """Device pointers (int64 [1]) of one call's scratch tensors, for its actual row count R.

    The layout is anchored at the arena's END and sized for R (guide §03: scratch grows down
    from the high end), so a call whose rows fit the device scratch bound stays in device pages
    even when a VMM arena backs lower addresses with host memory. Backward reuse (guide §04):
    grad_h1 overwrites h2 and g3 after both were read; grad_h2 stays disjoint.
        [x_g R*D | h1 R*2F | h2 R*F, g3 R*D (grad_h1 R*2F reuses) | grad_h2 R*F] -> end
    With DIST_MOE_FUSE_SWIGLU_BWD the W2 DGRAD epilogue writes grad_h1 over h1 itself (slot or
    scratch) and grad_h2 is never stored: the grad_h1 / grad_h2 regions stay unused. A layer's
    saved state is consumed by its one backward (a second backward call raises), so
    overwriting h1 there is safe.
    """

    xg: torch.Tensor
    h1: torch.Tensor
    h2: torch.Tensor
    g3: torch.Tensor
    grad_h1: torch.Tensor
    grad_h2: torch.Tensor

    @classmethod
    def for_rows(cls, end: torch.Tensor, R: torch.Tensor, D: int, F: int) -> "ScratchPointers":
        R = R.to(torch.int64)
        sx = align128(R * D * 2)
        s1 = align128(R * 2 * F * 2)
        s2 = align128(R * F * 2)
        top = torch.maximum(s2 + sx, s1)
        xg = end - (sx + s1 + top + s2)
        h1 = xg + sx
        h2 = h1 + s1
        return cls(xg=xg, h1=h1, h2=h2, g3=h2 + s2, grad_h1=h2, grad_h2=h2 + top)


class ExpertPipeline:
    def __init__(self, cfg: Config, num_local_experts: int, max_rows: int,
                 arena_end: int, device: torch.device, pipeline: str = "standard",
                 gemm: str | None = None):
        self.cfg = cfg
        self.E = num_local_experts
        self.max_rows = max_rows
        self.device = device
        self.pipeline = pipeline
        self.gemm = gemm or default_gemm_engine()
        if self.gemm not in ("triton", "torch"):
            raise ValueError(f"DIST_MOE_GEMM={self.gemm!r}: expected 'triton' or 'torch'")
        self.clamped = cfg.activation == "swiglu_clamped"
        self.arena_end = torch.tensor([arena_end], dtype=torch.int64, device=device)
        # W13 WGRAD on a side stream, overlapping the final barrier and the owner-side route
        # reduction; joined by `join_side_work`. Opt-in: on 2xH200 it measured +0.16 ms alone
        # and within run-to-run noise (+-0.2 ms) next to the other defaults.
        self.wgrad_stream = None
        if (env_switch("DIST_MOE_WGRAD_OVERLAP", False) and self.gemm == "triton"
                and torch.device(device).type == "cuda"):
            self.wgrad_stream = torch.cuda.Stream(device=device)
        # SwiGLU backward fused into the W2 DGRAD epilogue (grad_h2 never stored; grad_h1
        # written over h1 in place); the default since it ran on 2xH200 (-0.26 ms fwd+bwd).
        self.fuse_swiglu_bwd = env_switch("DIST_MOE_FUSE_SWIGLU_BWD", True)
        # Fan-out gathers (DIST_MOE_GATHER_FANOUT): read each token row once over NVLink and
        # write it into all of its rows here (`rows.fanout_rows`), instead of one peer read per
        # route; for the x gather (forward and replay) and, without saved route outputs, the
        # grad_y gather. Not for the staged pipeline, whose GEMM claims its own rows. The
        # default since it ran on 2xH200 (interleaved A/B: fwd -0.13 ms, fwd+bwd -0.21 ms).
        self.fanout = (env_switch("DIST_MOE_GATHER_FANOUT", True)
                       and (pipeline != "staged" or self.gemm == "torch"))
        # W13 FPROP on CUTLASS's warp-specialized grouped GEMM (opt-in; see the module doc)
        self.w13_cutlass = None
        w13_cutlass = os.environ.get("DIST_MOE_W13_CUTLASS", "")
        if w13_cutlass not in ("", "0"):
            from ...kernels.grouped_gemm_sm90 import CONFIGS, GroupedFpropSm90
            if w13_cutlass not in CONFIGS:
                raise ValueError(f"DIST_MOE_W13_CUTLASS={w13_cutlass!r}: expected one of "
                                 f"{CONFIGS} (or unset)")
            if pipeline == "standard" and self.gemm == "triton":
                self.w13_cutlass = GroupedFpropSm90(num_local_experts, device, w13_cutlass)
            else:
                warnings.warn(f"DIST_MOE_W13_CUTLASS={w13_cutlass} applies to the standard "
                              f"pipeline of the triton GEMM engine only; this context "
                              f"(pipeline={pipeline!r}, gemm={self.gemm!r}) runs without it",
                              stacklevel=2)
        # Both WGRADs on CUTLASS's warp-specialized grouped GEMM (opt-in): the producer warp
        # loads the next tile while the consumers store this one. On 2xH200 it ran even with
        # our Triton WGRAD (94% of the dense mm, settled; layer A/B +0.005 ms fwd+bwd).
        self.wgrad_cutlass = os.environ.get("DIST_MOE_WGRAD_CUTLASS", "")
        self._wgrad_sm90 = {}
        if self.wgrad_cutlass in ("", "0"):
            self.wgrad_cutlass = None
        else:
            from ...kernels.grouped_gemm_sm90 import WGRAD_CONFIGS
            if self.wgrad_cutlass not in WGRAD_CONFIGS:
                raise ValueError(f"DIST_MOE_WGRAD_CUTLASS={self.wgrad_cutlass!r}: expected one "
                                 f"of {WGRAD_CONFIGS} (or unset)")
            if self.gemm != "triton":
                warnings.warn(f"DIST_MOE_WGRAD_CUTLASS={self.wgrad_cutlass} applies to the "
                              f"triton GEMM engine only; this context (gemm={self.gemm!r}) runs "
                              "without it", stacklevel=2)
                self.wgrad_cutlass = None
        self.claim = None
        if pipeline == "staged" and self.gemm == "triton":
            from ...kernels.grouped_gemm import ClaimFlags
            # one set of flags: every claimed launch of this context runs on one stream
            self.claim = ClaimFlags(max_rows, None, num_local_experts, device)

    def _gather(self, tabs: RoutingTables, row_ptrs: torch.Tensor, dst_addr: torch.Tensor,
                nrows: torch.Tensor, token_rows_at: str | None) -> None:
        """Rows i < nrows of dst = the rows at row_ptrs[i]; with fan-out gathers and a source
        laid out one row per token ('dispatch': x, 'combine': grad_y published per token), the
        same rows from one read per token (`rows.fanout_rows`)."""
        D = self.cfg.hidden_dim
        fan = tabs.fanout if self.fanout else None
        if fan is not None and token_rows_at is not None:
            base = fan.dispatch_base_EP if token_rows_at == "dispatch" else fan.combine_base_EP
            K_rows.fanout_rows(base, D * 2, fan.dest_rows, fan.T, fan.K, dst_addr, nrows, D,
                               torch.bfloat16)
        else:
            K_rows.gather_rows(row_ptrs, dst_addr, nrows, D, torch.bfloat16, self.max_rows)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, tabs: RoutingTables, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor,
                scatter_ptrs: torch.Tensor | None, xg_addr: torch.Tensor, h1_addr: torch.Tensor,
                sp: ScratchPointers,
                rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Expert MLP of the received rows; x_g and h1 land at xg_addr / h1_addr (device ptrs),
        route outputs h3 at scatter_ptrs (peer combine rows; None: stop after W13 + SwiGLU, as a
        backward replay without saved route outputs does). A replay passes its predicated
        (expert offsets, row count) as `rows`: zeros when nothing is replayed."""
        cfg = self.cfg
        D, F = cfg.hidden_dim, cfg.intermediate_dim
        Rm = self.max_rows
        offs, nrows = rows if rows is not None else (tabs.expert_offsets, tabs.num_rows)
        if self.gemm == "torch":
            xg = torch.empty(Rm, D, dtype=torch.bfloat16, device=self.device)
            self._gather(tabs, tabs.fwd_gather_ptrs, K_rows.device_ptr(xg), nrows, "dispatch")
            h1 = torch._grouped_mm(xg, w13_E2FD.transpose(1, 2), offs=offs[1:])
            h2 = torch.empty(Rm, F, dtype=torch.bfloat16, device=self.device)
            K_rows.swiglu_fwd(K_rows.device_ptr(h1), K_rows.device_ptr(h2), nrows, F, Rm,
                              self.clamped, cfg.swiglu_alpha, cfg.swiglu_limit)
            if scatter_ptrs is not None:
                h3 = torch._grouped_mm(h2, w2_EDF.transpose(1, 2), offs=offs[1:])
                K_rows.scatter_rows(K_rows.device_ptr(h3), scatter_ptrs, nrows, D,
                                    torch.bfloat16, Rm)
            K_rows.copy_rows(K_rows.device_ptr(xg), xg_addr, nrows, D, Rm)
            K_rows.copy_rows(K_rows.device_ptr(h1), h1_addr, nrows, 2 * F, Rm)
            return
        from ...kernels.grouped_gemm import grouped_mm_fwd
        act = dict(activation=cfg.activation, swiglu_alpha=cfg.swiglu_alpha,
                   swiglu_limit=cfg.swiglu_limit)
        if self.pipeline == "staged":
            grouped_mm_fwd(w=w13_E2FD, expert_offsets=offs, max_rows=Rm,
                           a_row_ptrs=tabs.fwd_gather_ptrs, a_copy_out=xg_addr,
                           claim_flags=self.claim, epilogue="swiglu", h1=h1_addr, h2=sp.h2, **act)
        else:
            self._gather(tabs, tabs.fwd_gather_ptrs, xg_addr, nrows, "dispatch")
            if self.w13_cutlass is not None:
                self.w13_cutlass(w13_E2FD, offs, xg_addr, h1_addr)
                K_rows.swiglu_fwd(h1_addr, sp.h2, nrows, F, Rm, self.clamped, cfg.swiglu_alpha,
                                  cfg.swiglu_limit)
            else:
                grouped_mm_fwd(w=w13_E2FD, expert_offsets=offs, max_rows=Rm, a=xg_addr,
                               epilogue="swiglu", h1=h1_addr, h2=sp.h2, **act)
        if scatter_ptrs is not None:
            grouped_mm_fwd(w=w2_EDF, expert_offsets=offs, max_rows=Rm, a=sp.h2,
                           epilogue="scatter", out_row_ptrs=scatter_ptrs)

    # -- backward ----------------------------------------------------------------------------
    def backward(self, tabs: RoutingTables, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor,
                 gather_ptrs: torch.Tensor, scatter_ptrs: torch.Tensor, xg_addr: torch.Tensor,
                 h1_addr: torch.Tensor, sp: ScratchPointers, wgrad_dtype: str,
                 score_ptrs: torch.Tensor | None = None, score_grad_delta: int = 0,
                 wgrad_into=None):
        """Returns (grad_w13 [E,2F,D], grad_w2 [E,D,F]); route input gradients are stored at
        scatter_ptrs (owners' dispatch rows). grad_h3 rows are read from gather_ptrs.
        wgrad_into: (w13, w2) ExpertOutTable of fp32 matrices: the WGRADs add their fp32 sums
        into them in place (always on the Triton kernel) and (None, None) is returned.
        score_ptrs (Config.save_route_outputs=False): the gathered rows are grad_y, unscaled;
        each row's score is read at score_ptrs[i] and its score gradient <W2^T grad_y, h2> is
        written (accumulated, fused path) at score_ptrs[i] + score_grad_delta."""
        cfg = self.cfg
        D, F = cfg.hidden_dim, cfg.intermediate_dim
        Rm = self.max_rows
        offs, nrows = tabs.expert_offsets, tabs.num_rows
        out_dtype = wgrad_store_dtype(wgrad_dtype, w13_E2FD.dtype)
        act = (F, Rm, self.clamped, cfg.swiglu_alpha, cfg.swiglu_limit)
        if self.gemm == "torch":
            grad_w13, grad_w2 = self._backward_torch(tabs, w13_E2FD, w2_EDF, gather_ptrs,
                                                     scatter_ptrs, xg_addr, h1_addr, out_dtype,
                                                     score_ptrs, score_grad_delta)
            if wgrad_into is None:
                return grad_w13, grad_w2
            # torch._grouped_mm stores bf16 only: its sums arrive rounded (as documented there)
            for table, g in zip(wgrad_into, (grad_w13, grad_w2)):
                self._add_into_table(table, g)
            return None, None
        from ...kernels.grouped_gemm import grouped_mm_dgrad
        # h2 is rebuilt from h1 (BF16 full-save keeps h1, not h2).
        if self.fuse_swiglu_bwd:
            # W2 DGRAD's epilogue turns grad_h2 into grad_h1 over h1 in place and rebuilds h2
            # from the same h1 tile (nothing reads h1 after this backward)
            w2_out = dict(epilogue="swiglu_bwd", h1=h1_addr, h2=sp.h2,
                          activation=cfg.activation, swiglu_alpha=cfg.swiglu_alpha,
                          swiglu_limit=cfg.swiglu_limit, score_ptrs=score_ptrs,
                          score_grad_delta=score_grad_delta)
            grad_h1 = h1_addr
        else:
            K_rows.swiglu_fwd(h1_addr, sp.h2, nrows, *act)
            w2_out = dict(epilogue="store", out=sp.grad_h2)
            grad_h1 = sp.grad_h1
        if self.pipeline == "staged":
            grouped_mm_dgrad(w=w2_EDF, expert_offsets=offs, max_rows=Rm, a_row_ptrs=gather_ptrs,
                             a_copy_out=sp.g3, claim_flags=self.claim, **w2_out)
        else:
            # grad_y is published once per token without saved route outputs (score_ptrs)
            self._gather(tabs, gather_ptrs, sp.g3, nrows,
                         "combine" if score_ptrs is not None else None)
            grouped_mm_dgrad(w=w2_EDF, expert_offsets=offs, max_rows=Rm, a=sp.g3, **w2_out)
        if score_ptrs is not None and not self.fuse_swiglu_bwd:
            # grad_s = <u, h2> to the owners; grad_h2 = s u and h2 = s h2 in place
            K_rows.score_grad_rows(sp.grad_h2, sp.h2, score_ptrs, nrows, F, score_grad_delta, Rm)
        grad_w2 = (wgrad_into[1] if wgrad_into is not None
                   else torch.empty(self.E, D, F, dtype=out_dtype, device=self.device))
        self._wgrad(sp.g3, sp.h2, offs, grad_w2)
        if not self.fuse_swiglu_bwd:
            # grad_h1 overwrites h2 and g3 (scratch reuse), after WGRAD W2 read them
            K_rows.swiglu_bwd(h1_addr, sp.grad_h2, sp.grad_h1, nrows, *act)
        grouped_mm_dgrad(w=w13_E2FD, expert_offsets=offs, max_rows=Rm, a=grad_h1,
                         epilogue="scatter", out_row_ptrs=scatter_ptrs)
        grad_w13 = (wgrad_into[0] if wgrad_into is not None
                    else torch.empty(self.E, 2 * F, D, dtype=out_dtype, device=self.device))
        if self.wgrad_stream is not None:
            # grad_w13 is allocated on the main stream and the caller joins (join_side_work)
            # before returning it or touching scratch again, so no record_stream is needed.
            self.wgrad_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.wgrad_stream):
                self._wgrad(grad_h1, xg_addr, offs, grad_w13)
        else:
            self._wgrad(grad_h1, xg_addr, offs, grad_w13)
        if wgrad_into is not None:
            return None, None
        return grad_w13, grad_w2

    def _wgrad(self, a, b, offs, out) -> None:
        """out[e] = a_e^T @ b_e (a, b: device pointers to bf16 rows), on CUTLASS with
        DIST_MOE_WGRAD_CUTLASS, else on the Triton kernel; out[e] += a_e^T @ b_e when out is an
        ExpertOutTable (routed_experts(wgrad_into=...))."""
        from ...kernels.grouped_gemm import ExpertOutTable, grouped_mm_wgrad
        if isinstance(out, ExpertOutTable):
            grouped_mm_wgrad(a, b, offs, out, accumulate=True, dtype=torch.bfloat16)
            return
        if self.wgrad_cutlass is None:
            grouped_mm_wgrad(a, b, offs, out, dtype=torch.bfloat16)
            return
        gemm = self._wgrad_sm90.get(out.dtype)
        if gemm is None:
            from ...kernels.grouped_gemm_sm90 import GroupedWgradSm90
            gemm = self._wgrad_sm90[out.dtype] = GroupedWgradSm90(self.E, self.device,
                                                                  self.wgrad_cutlass, out.dtype)
        gemm(a, b, offs, out)

    @staticmethod
    def _add_into_table(table, g_EMN: torch.Tensor) -> None:
        """table's matrices += g_EMN[e] (fp32), through a strided view per expert: the torch
        engine's path of routed_experts(wgrad_into=...)."""
        E, M, N = g_EMN.shape
        for e in range(E):
            table.tensors[e].view(M, N).add_(g_EMN[e])

    def join_side_work(self) -> None:
        """Order the main stream after the side-stream WGRAD (no-op without it)."""
        if self.wgrad_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.wgrad_stream)

    def _backward_torch(self, tabs, w13_E2FD, w2_EDF, gather_ptrs, scatter_ptrs, xg_addr,
                        h1_addr, out_dtype, score_ptrs=None, score_grad_delta=0):
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
        self._gather(tabs, gather_ptrs, K_rows.device_ptr(g3), nrows,
                     "combine" if score_ptrs is not None else None)
        grad_h2 = torch._grouped_mm(g3, w2_EDF, offs=offs[1:])
        h2 = torch.empty(Rm, F, **bf)
        K_rows.swiglu_fwd(K_rows.device_ptr(h1), K_rows.device_ptr(h2), nrows, F, Rm,
                          self.clamped, cfg.swiglu_alpha, cfg.swiglu_limit)
        if score_ptrs is not None:   # g3 holds unscaled grad_y rows: see `backward`
            K_rows.score_grad_rows(K_rows.device_ptr(grad_h2), K_rows.device_ptr(h2), score_ptrs,
                                   nrows, F, score_grad_delta, Rm)
        # torch._grouped_mm stores in the operand dtype only (fp32 accumulation inside); out_dtype
        # is bf16 for bf16 weights (wgrad_store_dtype), so the casts below are no-ops.
        grad_w2 = torch._grouped_mm(g3.t(), h2, offs=offs[1:]).to(out_dtype)
        grad_h1 = torch.empty(Rm, 2 * F, **bf)
        K_rows.swiglu_bwd(K_rows.device_ptr(h1), K_rows.device_ptr(grad_h2),
                          K_rows.device_ptr(grad_h1), nrows, F, Rm, self.clamped,
                          cfg.swiglu_alpha, cfg.swiglu_limit)
        grad_xg = torch._grouped_mm(grad_h1, w13_E2FD, offs=offs[1:])
        K_rows.scatter_rows(K_rows.device_ptr(grad_xg), scatter_ptrs, nrows, D, torch.bfloat16, Rm)
        grad_w13 = torch._grouped_mm(grad_h1.t(), xg, offs=offs[1:]).to(out_dtype)
        return grad_w13, grad_w2

"""The expert MLP on received rows: gather -> W13 -> SwiGLU -> W2 -> scatter, and its backward.

x_g and h1 are written to (forward) and read from (backward) device-chosen addresses: the
activation slot when the planner keeps full state, the shared scratch otherwise. Every other
intermediate lives in the scratch region at the addresses of the one per-call layout
(layout.py; the bookkeeping computes them on the device).

Two layers:
    Bf16Kernels     the kernels of one precision, one method per step, at device addresses
                    (a precision adds such a class, not branches)
    a pipeline      the order of the steps (Execution.pipeline and gemm_engine):
        StandardPipeline  gather kernel, W13 (+SwiGLU), W2 (+scatter to the owners); backward:
                          gather, W2 DGRAD (+SwiGLU backward, + score-gradient parts), W2
                          WGRAD, W13 DGRAD (+scatter to the owners), W13 WGRAD
        StagedPipeline    the same, but W13 and the W2 DGRAD gather their own A rows (claim
                          mode: the programs that reach an m-tile copy it once, in slices)
        TorchPipeline     torch._grouped_mm with separate gather / SwiGLU / scatter kernels:
                          the GEMM oracle and a baseline
        MegaPipeline      the forward's W13 + SwiGLU and W2 + scatter in one persistent launch
                          after the gather (kernels/grouped_gemm/mega.py); backward as standard
        Fp8BlockPipeline  fp8_block: quantization kernels and the FP8 block-scaled GEMMs
        Mxfp8Pipeline     mxfp8: quantization kernels around StandardPipeline's bf16 GEMMs,
                          which read bf16 copies of the MXFP8 operands (exact)
        Nvfp4Pipeline     nvfp4 inference on prepared weights: the source rank publishes NVFP4
                          rows, NVFP4 GEMMs decode both operands to bf16 in registers
Device predicates (replay or not) zero the expert offsets and row counts, so the launch sequence
is the same either way.
"""

from __future__ import annotations

import torch

from ...config import Config
from ...execution import Execution
from ...kernels import rows as K_rows
from ...layout import tail_rows
from .routing import RoutingTables

__all__ = ["Bf16Kernels", "Fp8BlockKernels", "Mxfp8Kernels", "StandardPipeline",
           "StagedPipeline", "MegaPipeline", "TorchPipeline", "Fp8BlockPipeline", "Mxfp8Pipeline",
           "Nvfp4Pipeline",
           "make_expert_pipeline", "wgrad_store_dtype"]


def wgrad_store_dtype(wgrad_dtype: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the WGRAD GEMMs store: Config.wgrad_dtype, but never wider than the weights.

    The op returns weight gradients in the weights' dtype (autograd's rule, library.py). The
    kernels sum in fp32 and round once in their epilogue, so storing fp32 and rounding to bf16
    afterwards gives the same bits as storing bf16 directly (GPU test
    `test_wgrad_bf16_store_equals_rounded_fp32_store`), at three times the bytes."""
    if wgrad_dtype not in ("bf16", "fp32"):
        raise ValueError(f"wgrad_dtype {wgrad_dtype!r}: expected 'bf16' or 'fp32'")
    if wgrad_dtype == "fp32" and weight_dtype in (torch.float32, torch.float64):
        return torch.float32
    return torch.bfloat16


def wgrad_output(wgrad_into, which: int, shape: tuple, dtype: torch.dtype, device):
    """Where a WGRAD goes: wgrad_into[which] (an ExpertOutTable the kernel adds into) or a new
    stacked [E, M, N] tensor."""
    if wgrad_into is not None:
        return wgrad_into[which]
    return torch.empty(shape, dtype=dtype, device=device)


class Bf16Kernels:
    """The bf16 steps of the expert path (Triton): row gathers, the four grouped GEMMs with
    their epilogues, the two WGRADs and the score-gradient reduction."""

    def __init__(self, cfg: Config, num_local_experts: int, max_rows: int, timeout_s: float,
                 rank: int):
        self.cfg, self.E, self.max_rows = cfg, num_local_experts, max_rows
        self.timeout = dict(timeout_s=timeout_s, rank=rank)
        self.act = dict(activation=cfg.activation, swiglu_alpha=cfg.swiglu_alpha,
                        swiglu_limit=cfg.swiglu_limit)

    def gather(self, tabs: RoutingTables, row_ptrs, dst, nrows, token_rows_at: str | None):
        """Rows i < nrows of dst = the rows at row_ptrs[i]; where the source holds one row per
        token ('dispatch': x, 'combine': grad_y published per token), the same rows from one
        read per token (`rows.fanout_rows`)."""
        D = self.cfg.hidden_dim
        fan = tabs.fanout
        if token_rows_at is not None and fan is not None:
            base = fan.dispatch_base_EP if token_rows_at == "dispatch" else fan.combine_base_EP
            K_rows.fanout_rows(base, D * 2, fan.dest_rows, fan.T, fan.K, dst, nrows, D,
                               torch.bfloat16)
        else:
            K_rows.gather_rows(row_ptrs, dst, nrows, D, torch.bfloat16, self.max_rows)

    def w13_swiglu(self, w13, offs, xg, h1, h2, claim=None, row_ptrs=None, config=None,
                   xg_tail: int = 0):
        """h1 = x_g W13^T, h2 = act(h1); with `claim`, x_g is first copied from row_ptrs;
        config: the tiles (default: the launcher's choice for this shape); xg_tail: rows of
        x_g's region past R (layout.tail_rows)."""
        from ...kernels.grouped_gemm import grouped_mm_fwd
        a = dict(a=xg) if claim is None else dict(a_row_ptrs=row_ptrs, a_copy_out=xg,
                                                  claim_flags=claim)
        grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=self.max_rows, epilogue="swiglu",
                       h1=h1, h2=h2, config=config, a_tail_rows=xg_tail, **a, **self.act,
                       **self.timeout)

    def w2_scatter(self, w2, offs, h2, out_rows, h2_tail: int = 0):
        """h3 = h2 W2^T, row i stored at out_rows[i] (the owners' combine rows); h2_tail: rows
        of h2's region past R."""
        from ...kernels.grouped_gemm import grouped_mm_fwd
        grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=self.max_rows, a=h2,
                       epilogue="scatter", out_row_ptrs=out_rows, a_tail_rows=h2_tail)

    def w2_dgrad_swiglu_bwd(self, w2, offs, g3, h1, h2, score, claim=None, row_ptrs=None):
        """grad_h2 = g3 W2 inside the kernel; grad_h1 over h1, h2 rebuilt; with `score` =
        (score_ptrs, score_grad_delta, part_stride) h2 is scaled by the route's score and each
        n-tile's share of the score gradient goes to the owner's part slots."""
        from ...kernels.grouped_gemm import grouped_mm_dgrad
        a = dict(a=g3) if claim is None else dict(a_row_ptrs=row_ptrs, a_copy_out=g3,
                                                  claim_flags=claim)
        sc = {} if score is None else dict(score_ptrs=score[0], score_grad_delta=score[1],
                                          part_stride=score[2])
        grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=self.max_rows,
                         epilogue="swiglu_bwd", h1=h1, h2=h2, **a, **sc, **self.act,
                         **self.timeout)

    def score_parts(self, device) -> int:
        """Score-gradient parts per route the W2 DGRAD writes (its n-tiles over F)."""
        from ...kernels.grouped_gemm import score_parts_count, select_config
        F = self.cfg.intermediate_dim
        return score_parts_count(F, select_config("dgrad", n=F, kd=self.cfg.hidden_dim,
                                                  device=device))

    def w13_dgrad_scatter(self, w13, offs, grad_h1, out_rows):
        from ...kernels.grouped_gemm import grouped_mm_dgrad
        grouped_mm_dgrad(w=w13, expert_offsets=offs, max_rows=self.max_rows, a=grad_h1,
                         epilogue="scatter", out_row_ptrs=out_rows)

    def wgrad(self, a, b, offs, out) -> None:
        """out[e] = a_e^T b_e (bf16 rows at device pointers); += when out is an
        ExpertOutTable (routed_experts(wgrad_into=...))."""
        from ...kernels.grouped_gemm import ExpertOutTable, grouped_mm_wgrad
        grouped_mm_wgrad(a, b, offs, out, accumulate=isinstance(out, ExpertOutTable),
                         dtype=torch.bfloat16)


class StandardPipeline:
    """Gather kernel, then the GEMMs (see the module docstring)."""

    name = "standard"

    def __init__(self, cfg: Config, execution: Execution, num_local_experts: int, max_rows: int,
                 device: torch.device, rank: int):
        self.cfg, self.E, self.max_rows, self.device = cfg, num_local_experts, max_rows, device
        self.k = Bf16Kernels(cfg, num_local_experts, max_rows, execution.wait_timeout_s, rank)
        # score-gradient parts per route the backward writes (rows.sum_score_parts sums them)
        self.score_parts = self.k.score_parts(torch.device(device))
        # rows past R that the inference layout keeps at the GEMMs' A regions
        self.inference_tails = tail_rows("inference", cfg.hidden_dim, cfg.intermediate_dim,
                                         cfg.precision)

    @property
    def uses_fanout(self) -> bool:
        """Whether the routing tables must carry the fan-out table (`rows.fanout_rows`)."""
        return True

    # the first GEMM of each direction: what the staged pipeline changes
    def _w13_tiles(self, w13):
        """The W13 launch's tiles (None: the launcher's choice for this shape)."""
        return None

    def _w13(self, tabs, w13, offs, nrows, xg, h1, h2, xg_tail=0):
        self.k.gather(tabs, tabs.fwd_gather_ptrs, xg, nrows, "dispatch")
        self.k.w13_swiglu(w13, offs, xg, h1, h2, config=self._w13_tiles(w13), xg_tail=xg_tail)

    def _w2_dgrad(self, tabs, w2, offs, nrows, gather_ptrs, g3, h1, h2, score):
        # grad_y is published once per token without saved route outputs (score)
        self.k.gather(tabs, gather_ptrs, g3, nrows, "combine" if score is not None else None)
        self.k.w2_dgrad_swiglu_bwd(w2, offs, g3, h1, h2, score)

    def prepare(self, w13_E2FD, w2_EDF, training: bool, into=None):
        """What the GEMMs read of the weights: the bf16 weights themselves. (Pipelines that
        quantize them write into `into`, a weight cache entry of an earlier prepare, when given.)"""
        return None

    def forward(self, tabs: RoutingTables, w13_E2FD, w2_EDF, scatter_ptrs, at: dict,
                rows: tuple[torch.Tensor, torch.Tensor] | None = None, prepared=None,
                training: bool = True) -> None:
        """Expert MLP of the received rows into the call's regions `at` (region name -> int64
        [1] device address; x_g and h1 land in the slot or scratch, as the bookkeeping chose),
        route outputs h3 at scatter_ptrs (peer combine rows; None: stop after W13 + SwiGLU, as a
        backward replay without saved route outputs does). A replay passes its predicated
        (expert offsets, row count) as `rows`: zeros when nothing is replayed."""
        offs, nrows = rows if rows is not None else (tabs.expert_offsets, tabs.num_rows)
        tails = {} if training else self.inference_tails
        self._w13(tabs, w13_E2FD, offs, nrows, at["x_g"], at["h1"], at["h2"],
                  tails.get("x_g", 0))
        if scatter_ptrs is not None:
            self.k.w2_scatter(w2_EDF, offs, at["h2"], scatter_ptrs, tails.get("h2", 0))

    def backward(self, tabs: RoutingTables, w13_E2FD, w2_EDF, gather_ptrs, scatter_ptrs, ba,
                 wgrad_dtype: str, score_ptrs=None, score_grad_delta: int = 0,
                 part_stride: int = 0, wgrad_into=None, prepared=None):
        """Returns (grad_w13 [E,2F,D], grad_w2 [E,D,F]); route input gradients are stored at
        scatter_ptrs (owners' dispatch rows). `ba`: the call's BackwardAddresses. The g3 rows
        are read from gather_ptrs. wgrad_into: (w13, w2) ExpertOutTable of fp32 matrices: the
        WGRADs add their fp32 sums into them and (None, None) is returned. score_ptrs
        (Config.save_route_outputs=False): the gathered rows are grad_y, unscaled; each row's
        score is read at score_ptrs[i] and the n-tiles' shares of its score gradient
        <W2^T grad_y, h2> are stored at score_ptrs[i] + score_grad_delta + j * part_stride
        (`self.score_parts` of them; the owner sums them)."""
        D, F = self.cfg.hidden_dim, self.cfg.intermediate_dim
        offs, nrows = tabs.expert_offsets, tabs.num_rows
        out_dtype = wgrad_store_dtype(wgrad_dtype, w13_E2FD.dtype)
        score = None if score_ptrs is None else (score_ptrs, score_grad_delta, part_stride)
        at = ba.at
        self._w2_dgrad(tabs, w2_EDF, offs, nrows, gather_ptrs, at["g3"], at["h1"], at["h2"],
                       score)
        grad_w2 = wgrad_output(wgrad_into, 1, (self.E, D, F), out_dtype, self.device)
        self.k.wgrad(at["g3"], at["h2"], offs, grad_w2)
        self.k.w13_dgrad_scatter(w13_E2FD, offs, at["h1"], scatter_ptrs)  # grad_h1 is over h1
        grad_w13 = wgrad_output(wgrad_into, 0, (self.E, 2 * F, D), out_dtype, self.device)
        self.k.wgrad(at["h1"], at["x_g"], offs, grad_w13)
        if wgrad_into is not None:
            return None, None
        return grad_w13, grad_w2


class StagedPipeline(StandardPipeline):
    """W13 and the W2 DGRAD gather their own A rows (claim mode, kernels/grouped_gemm/claim.py):
    two launches per direction instead of three."""

    name = "staged"

    def __init__(self, cfg, execution, num_local_experts, max_rows, device, rank):
        super().__init__(cfg, execution, num_local_experts, max_rows, device, rank)
        from ...kernels.grouped_gemm import ClaimFlags
        # one set of flags: every claimed launch of this context runs on one stream
        self.claim = ClaimFlags(max_rows, None, num_local_experts, device)

    @property
    def uses_fanout(self) -> bool:
        return False

    def _w13(self, tabs, w13, offs, nrows, xg, h1, h2, xg_tail=0):
        self.k.w13_swiglu(w13, offs, xg, h1, h2, claim=self.claim, row_ptrs=tabs.fwd_gather_ptrs,
                          xg_tail=xg_tail)

    def _w2_dgrad(self, tabs, w2, offs, nrows, gather_ptrs, g3, h1, h2, score):
        self.k.w2_dgrad_swiglu_bwd(w2, offs, g3, h1, h2, score, claim=self.claim,
                                   row_ptrs=gather_ptrs)


class MegaPipeline(StandardPipeline):
    """The Mega forward (bf16): the gather kernel, then one persistent launch whose programs
    claim W13 tiles (+ SwiGLU) and then W2 tiles (+ scatter to the owners) from one device work
    list, an m-tile's W2 tiles starting as soon as its h2 is stored. A replay that stops after
    W13 (no route outputs kept) runs the standard W13 launch. The backward is the standard
    pipeline's."""

    name = "mega"

    def __init__(self, cfg, execution, num_local_experts, max_rows, device, rank):
        super().__init__(cfg, execution, num_local_experts, max_rows, device, rank)
        from ...kernels.grouped_gemm.mega import MegaFlags
        self.flags = MegaFlags(max_rows, num_local_experts, device)
        self.timeout = dict(timeout_s=execution.wait_timeout_s, rank=rank)

    def _w13_tiles(self, w13):
        # the W13-only replay runs the Mega kernel's tiles: the bits its forward stored
        from ...kernels.grouped_gemm.mega import mega_config
        return mega_config(w13[0].numel() // w13.shape[-1], w13.shape[-1], w13.device,
                           self.max_rows, self.E)

    def forward(self, tabs: RoutingTables, w13_E2FD, w2_EDF, scatter_ptrs, at: dict,
                rows=None, prepared=None, training: bool = True) -> None:
        from ...kernels.grouped_gemm.mega import mega_fwd
        if scatter_ptrs is None:
            return super().forward(tabs, w13_E2FD, w2_EDF, None, at, rows, prepared, training)
        offs, nrows = rows if rows is not None else (tabs.expert_offsets, tabs.num_rows)
        self.k.gather(tabs, tabs.fwd_gather_ptrs, at["x_g"], nrows, "dispatch")
        mega_fwd(xg=at["x_g"], w13=w13_E2FD, w2=w2_EDF, expert_offsets=offs,
                 max_rows=self.max_rows, h2=at["h2"], h1=at["h1"], out_row_ptrs=scatter_ptrs,
                 flags=self.flags, **self.k.act, **self.timeout,
                 xg_tail_rows=0 if training else self.inference_tails.get("x_g", 0),
                 h2_tail_rows=0 if training else self.inference_tails.get("h2", 0))


class TorchPipeline:
    """torch._grouped_mm with separate gather / SwiGLU / scatter kernels (the GEMM oracle and a
    baseline; Execution.gemm_engine="torch"). Its outputs are copied to the chosen addresses;
    its temporaries are torch allocations."""

    name = "torch"
    uses_fanout = True
    score_parts = 1     # score_grad_rows stores each route's whole score gradient as part 0

    def __init__(self, cfg: Config, execution: Execution, num_local_experts: int, max_rows: int,
                 device: torch.device, rank: int):
        self.cfg, self.E, self.max_rows, self.device = cfg, num_local_experts, max_rows, device
        self.k = Bf16Kernels(cfg, num_local_experts, max_rows, execution.wait_timeout_s, rank)
        self.clamped = cfg.activation == "swiglu_clamped"

    def _act(self):
        c = self.cfg
        return (c.intermediate_dim, self.max_rows, self.clamped, c.swiglu_alpha, c.swiglu_limit)

    def prepare(self, w13_E2FD, w2_EDF, training: bool, into=None):
        return None

    def forward(self, tabs, w13_E2FD, w2_EDF, scatter_ptrs, at, rows=None, prepared=None,
                training=True) -> None:
        D, F, Rm = self.cfg.hidden_dim, self.cfg.intermediate_dim, self.max_rows
        xg_addr, h1_addr = at["x_g"], at["h1"]
        offs, nrows = rows if rows is not None else (tabs.expert_offsets, tabs.num_rows)
        xg = torch.empty(Rm, D, dtype=torch.bfloat16, device=self.device)
        self.k.gather(tabs, tabs.fwd_gather_ptrs, K_rows.device_ptr(xg), nrows, "dispatch")
        h1 = torch._grouped_mm(xg, w13_E2FD.transpose(1, 2), offs=offs[1:])
        h2 = torch.empty(Rm, F, dtype=torch.bfloat16, device=self.device)
        K_rows.swiglu_fwd(K_rows.device_ptr(h1), K_rows.device_ptr(h2), nrows, *self._act())
        if scatter_ptrs is not None:
            h3 = torch._grouped_mm(h2, w2_EDF.transpose(1, 2), offs=offs[1:])
            K_rows.scatter_rows(K_rows.device_ptr(h3), scatter_ptrs, nrows, D, torch.bfloat16, Rm)
        K_rows.copy_rows(K_rows.device_ptr(xg), xg_addr, nrows, D, Rm)
        K_rows.copy_rows(K_rows.device_ptr(h1), h1_addr, nrows, 2 * F, Rm)

    def backward(self, tabs, w13_E2FD, w2_EDF, gather_ptrs, scatter_ptrs, ba, wgrad_dtype,
                 score_ptrs=None, score_grad_delta=0, part_stride=0, wgrad_into=None,
                 prepared=None):
        D, F, Rm = self.cfg.hidden_dim, self.cfg.intermediate_dim, self.max_rows
        offs, nrows = tabs.expert_offsets, tabs.num_rows
        out_dtype = wgrad_store_dtype(wgrad_dtype, w13_E2FD.dtype)
        bf = dict(dtype=torch.bfloat16, device=self.device)
        xg = torch.empty(Rm, D, **bf)
        h1 = torch.empty(Rm, 2 * F, **bf)
        K_rows.copy_rows(ba.at["x_g"], K_rows.device_ptr(xg), nrows, D, Rm)
        K_rows.copy_rows(ba.at["h1"], K_rows.device_ptr(h1), nrows, 2 * F, Rm)
        g3 = torch.empty(Rm, D, **bf)
        self.k.gather(tabs, gather_ptrs, K_rows.device_ptr(g3), nrows,
                      "combine" if score_ptrs is not None else None)
        grad_h2 = torch._grouped_mm(g3, w2_EDF, offs=offs[1:])
        h2 = torch.empty(Rm, F, **bf)
        K_rows.swiglu_fwd(K_rows.device_ptr(h1), K_rows.device_ptr(h2), nrows, *self._act())
        if score_ptrs is not None:   # g3 holds unscaled grad_y rows: see StandardPipeline
            K_rows.score_grad_rows(K_rows.device_ptr(grad_h2), K_rows.device_ptr(h2), score_ptrs,
                                   nrows, F, score_grad_delta, Rm)
        # torch._grouped_mm stores in the operand dtype only (fp32 accumulation inside); out_dtype
        # is bf16 for bf16 weights (wgrad_store_dtype), so the casts below are no-ops.
        grad_w2 = torch._grouped_mm(g3.t(), h2, offs=offs[1:]).to(out_dtype)
        grad_h1 = torch.empty(Rm, 2 * F, **bf)
        K_rows.swiglu_bwd(K_rows.device_ptr(h1), K_rows.device_ptr(grad_h2),
                          K_rows.device_ptr(grad_h1), nrows, *self._act())
        grad_xg = torch._grouped_mm(grad_h1, w13_E2FD, offs=offs[1:])
        K_rows.scatter_rows(K_rows.device_ptr(grad_xg), scatter_ptrs, nrows, D, torch.bfloat16, Rm)
        grad_w13 = torch._grouped_mm(grad_h1.t(), xg, offs=offs[1:]).to(out_dtype)
        if wgrad_into is None:
            return grad_w13, grad_w2
        # torch._grouped_mm stores bf16 only: its sums arrive rounded
        for table, g in zip(wgrad_into, (grad_w13, grad_w2)):
            for e in range(self.E):
                table.tensors[e].view(g.shape[1:]).add_(g[e])
        return None, None


class Fp8BlockKernels:
    """The fp8_block steps: block quantization of rows and columns, the FP8 block-scaled grouped
    GEMMs with their epilogues, the SwiGLU with the quantization of its input and output
    (Triton: kernels/quant_fp8.py, kernels/grouped_gemm/fp8.py; with fp8_gemm "cutlass"
    (Execution.fp8_gemm) the W13 FPROP, the DGRADs' GEMMs and the WGRADs on CUTLASS:
    kernels/grouped_gemm_sm90.py; with fp8_quant "cuda" (Execution.fp8_quant) the rows +
    columns quantizer on CUDA C++: kernels/quant_fp8_cuda.py)."""

    def __init__(self, cfg: Config, num_local_experts: int, max_rows: int,
                 fp8_gemm: str = "triton", device: torch.device | None = None,
                 training: bool = True, fp8_quant: str = "triton"):
        from ...quant.fp8_block import BlockScaling
        self.cfg, self.E, self.max_rows = cfg, num_local_experts, max_rows
        # Execution.fp8_quant: the quantizer's engine, its launcher picked once
        if fp8_quant == "cuda":   # built or loaded here, outside any capture or timed region
            from ...kernels import quant_fp8_cuda
            self._quantize_rows_cols = quant_fp8_cuda.quantize_rows_cols
            self._swiglu_bwd_quant = self._swiglu_bwd_quant_fused
            try:
                quant_fp8_cuda.load()
            except (RuntimeError, OSError) as err:   # nvcc, the link or the load failed
                raise RuntimeError(f"fp8_block's CUDA quantizer (Execution.fp8_quant='cuda') "
                                   f"could not be loaded: {err}\nRun the Triton one instead: "
                                   "create_context(..., execution_overrides="
                                   "{'fp8_quant': 'triton'})") from err
        else:
            from ...kernels.quant_fp8 import quantize_rows_cols
            self._quantize_rows_cols = quantize_rows_cols
            self._swiglu_bwd_quant = self._swiglu_bwd_quant_composed
        self.recipe = BlockScaling.of(cfg)
        self.act = dict(activation=cfg.activation, swiglu_alpha=cfg.swiglu_alpha,
                        swiglu_limit=cfg.swiglu_limit)
        # Execution.fp8_gemm: the CUTLASS GEMMs own device argument (and zero) blocks, made
        # here (context creation, outside any capture; the WGRAD's for the two weight shapes)
        self.cutlass_fprop = self.cutlass_wgrad = None
        if fp8_gemm == "cutlass":
            from ...kernels.grouped_gemm_sm90 import GroupedFp8FpropSm90, GroupedFp8WgradSm90
            D, F = cfg.hidden_dim, cfg.intermediate_dim
            try:
                self.cutlass_fprop = GroupedFp8FpropSm90(num_local_experts, device)
                if training:
                    self.cutlass_wgrad = GroupedFp8WgradSm90(num_local_experts, device)
            except (RuntimeError, OSError) as err:    # nvcc, the link or the load failed
                raise RuntimeError(f"fp8_block's CUTLASS GEMMs (Execution.fp8_gemm='cutlass') "
                                   f"could not be loaded: {err}\nRun our Triton GEMMs instead: "
                                   "create_context(..., execution_overrides="
                                   "{'fp8_gemm': 'triton'})") from err
            if training:
                for M, N in ((2 * F, D), (D, F)):
                    self.cutlass_wgrad.reserve(M, N)

    def quantize(self, x, offs, K: int, rows=None, cols=None, row_ptrs=None):
        self._quantize_rows_cols(x, offs, self.max_rows, K, rows=rows, cols=cols, recipe=self.recipe,
                           row_ptrs=row_ptrs)

    def swiglu_quant(self, h1, nrows, h2q, h1q=None):
        from ...kernels.quant_fp8 import swiglu_quant
        swiglu_quant(h1, nrows, self.max_rows, self.cfg.intermediate_dim, h2q=h2q, h1q=h1q,
                     recipe=self.recipe, **self.act)

    def weights(self, w13_E2FD, w2_EDF, transposed: bool, into=None):
        """Fp8Weights of one version (both orientations when `transposed`, for a backward),
        written into the tensors of `into` (an Fp8Weights) when given."""
        from ...kernels.quant_fp8 import quantize_weight
        from ...quant.fp8_block import Fp8Weights
        o13 = o2 = None
        if into is not None:
            o13 = (into.w13, into.w13_s, into.w13_t, into.w13_t_s)
            o2 = (into.w2, into.w2_s, into.w2_t, into.w2_t_s)
        q13, s13, q13t, s13t = quantize_weight(w13_E2FD, self.recipe, transposed=transposed,
                                               out=o13)
        q2, s2, q2t, s2t = quantize_weight(w2_EDF, self.recipe, transposed=transposed, out=o2)
        return Fp8Weights(q13, s13, q13t, s13t, q2, s2, q2t, s2t)

    def mm(self, a, w, w_s, offs, epilogue, **kw):
        if epilogue == "store" and self.cutlass_fprop is not None:
            self.cutlass_fprop(a, w, w_s, offs, kw["out"])
            return
        from ...kernels.grouped_gemm.fp8 import fp8_grouped_mm
        fp8_grouped_mm(a=a, w=w, w_scales=w_s, expert_offsets=offs, max_rows=self.max_rows,
                       epilogue=epilogue, **kw, **self.act)

    def w2_dgrad(self, g3q, W, offs, nrows, h1q, u, gh1, gh1_rows, gh1_cols, h2_cols, **score):
        """grad_h1's row and column bundles and h2's column bundle from the g3 row bundle and
        the saved h1 row bundle: the GEMM (CUTLASS or Triton, as the W13 FPROP) stores
        u = g3 W2 (bf16 [R, F]) into `u`, then the SwiGLU backward (with the score-gradient
        parts) and the quantizations run as Execution.fp8_quant says: one CUDA pass
        (quant_fp8_cuda.swiglu_bwd_quant), or Triton's swiglu_bwd_rows writing grad_h1 (bf16,
        into `gh1`) and h2 (over u) and the quantizer reading them back."""
        self.mm(g3q, W.w2_t, W.w2_t_s, offs, "store", out=u)
        self._swiglu_bwd_quant(u, h1q, offs, nrows, gh1, gh1_rows, gh1_cols, h2_cols, score)

    def _swiglu_bwd_quant_fused(self, u, h1q, offs, nrows, gh1, gh1_rows, gh1_cols, h2_cols,
                                score):
        from ...kernels import quant_fp8_cuda
        from ...kernels.grouped_gemm.fp8 import fp8_config
        quant_fp8_cuda.swiglu_bwd_quant(u, h1q, offs, self.max_rows, self.cfg.intermediate_dim,
                                        gh1_rows=gh1_rows, gh1_cols=gh1_cols, h2_cols=h2_cols,
                                        recipe=self.recipe,
                                        part_cols=fp8_config(offs.device).block_n, **score,
                                        **self.act)

    def _swiglu_bwd_quant_composed(self, u, h1q, offs, nrows, gh1, gh1_rows, gh1_cols, h2_cols,
                                   score):
        from ...kernels.grouped_gemm.fp8 import fp8_config
        from ...kernels.quant_fp8 import swiglu_bwd_rows
        F = self.cfg.intermediate_dim
        swiglu_bwd_rows(u, h1q, gh1, nrows, self.max_rows, F,
                        block_n=fp8_config(offs.device).block_n, **score, **self.act)
        self.quantize(gh1, offs, 2 * F, rows=gh1_rows, cols=gh1_cols)
        self.quantize(u, offs, F, cols=h2_cols)

    def w13_dgrad(self, gh1q, W, offs, nrows, scatter_ptrs, dense):
        """grad_x_g rows to the owners' addresses. Triton: one GEMM scattering from its
        epilogue. CUTLASS: the GEMM stores the rows into `dense` (bf16 [R, D], a region free
        by then), one copy launch scatters them. scatter_ptrs None: the rows stay in `dense`
        (either engine), where the owner reads them (Execution.fp8_combine == 'pull')."""
        if scatter_ptrs is None:
            self.mm(gh1q, W.w13_t, W.w13_t_s, offs, "store", out=dense)
            return
        if self.cutlass_fprop is None:
            self.mm(gh1q, W.w13_t, W.w13_t_s, offs, "scatter", out_row_ptrs=scatter_ptrs)
            return
        from ...kernels import rows as K_rows
        from ...kernels.common import as_device_ptr
        self.cutlass_fprop(gh1q, W.w13_t, W.w13_t_s, offs, dense)
        K_rows.scatter_rows(as_device_ptr(dense, "dense", torch.bfloat16), scatter_ptrs, nrows,
                            self.cfg.hidden_dim, torch.bfloat16, self.max_rows)

    def wgrad(self, a, b, offs, out):
        from ...kernels.grouped_gemm import ExpertOutTable
        accumulate = isinstance(out, ExpertOutTable)
        if self.cutlass_wgrad is not None:
            self.cutlass_wgrad(a, b, offs, out, accumulate=accumulate)
            return
        from ...kernels.grouped_gemm.fp8 import fp8_grouped_wgrad
        fp8_grouped_wgrad(a, b, offs, out, accumulate=accumulate)

    def score_parts(self, device) -> int:
        """Score-gradient parts per route the FP8 W2 DGRAD writes (its n-tiles over F)."""
        from ...kernels.grouped_gemm import score_parts_count
        from ...kernels.grouped_gemm.fp8 import fp8_config
        return score_parts_count(self.cfg.intermediate_dim, fp8_config(torch.device(device)))


class Fp8BlockPipeline:
    """fp8_block, standard order. Forward: quantize x's gathered rows (and, training, their
    columns: the saved x_c), read by the quantizer where they lie at EP = 1 or from a bf16
    fan-out copy x_g (Execution.quantizer_gathers), W13 FP8 GEMM -> h1 (bf16), SwiGLU +
    quantization (h2 row bundle; training: the saved h1 row bundle), W2 FP8 GEMM + scatter to
    the owners. Backward: quantize g3's rows and columns (gathered as x is), W2 DGRAD GEMM ->
    u = g3 W2 (bf16, in h2's region), the SwiGLU backward from u and the saved h1 bundle
    (score-gradient parts too) with grad_h1's row and column bundles and h2's column bundle
    (Fp8BlockKernels.w2_dgrad: one CUDA pass, or the Triton pass through bf16 grad_h1 and h2
    and the quantizer), W2 WGRAD, W13 DGRAD + scatter, W13 WGRAD. Execution.fp8_gemm: the W13
    FPROP, the WGRADs and the two DGRADs' GEMMs on CUTLASS (the W13 DGRAD's scatter then a
    separate launch), or all of them on Triton.

    Weights are quantized by every forward (`prepare`: both orientations, one byte per element
    each); its backward reuses that forward's copies. Across calls only through the caller's
    routed_experts(is_first_microbatch=...) (weight_cache.py: `prepare(..., into=entry)`
    rewrites the context's entry in place): a weight's version counter does not see
    Megatron's optimizer, which writes the weights through `.data` (docs/decisions.md)."""

    name = "standard"

    def __init__(self, cfg: Config, execution: Execution, num_local_experts: int, max_rows: int,
                 device: torch.device, rank: int):
        self.cfg, self.E, self.max_rows, self.device = cfg, num_local_experts, max_rows, device
        self.k = Fp8BlockKernels(cfg, num_local_experts, max_rows, execution.fp8_gemm, device,
                                 training=not execution.inference,
                                 fp8_quant=execution.fp8_quant)
        self.bf = Bf16Kernels(cfg, num_local_experts, max_rows, execution.wait_timeout_s, rank)
        self.score_parts = self.k.score_parts(device)
        self.quantizer_gathers = execution.quantizer_gathers
        self.pull_combine = execution.fp8_combine == "pull"

    @property
    def uses_fanout(self) -> bool:
        """Whether the routing tables must carry the fan-out table (`rows.fanout_rows`; its
        route -> row map also tells the pulling combine where each route's row lies)."""
        return not self.quantizer_gathers or self.pull_combine

    def combine_source(self, tabs: RoutingTables, at: dict):
        """(rows' device pointer, route -> row int32 [T*K], R) where the combine kernel reads the
        route outputs (Execution.fp8_combine == 'pull': the W2 FPROP's dense rows in the x_g
        region, EP = 1), or None: they are in the combine buffer."""
        return ((at["x_g"], tabs.fanout.dest_rows, tabs.num_rows) if self.pull_combine
                else None)

    def grad_source(self, tabs: RoutingTables, at: dict):
        """As combine_source for the route input gradients: the W13 DGRAD's dense rows in g3's
        region (free once g3 is quantized), or None: they are in the dispatch buffer."""
        return (at["g3"], tabs.fanout.dest_rows, tabs.num_rows) if self.pull_combine else None

    def _gather_quantize(self, tabs, row_ptrs, token_rows_at, bf16_rows, offs, nrows, **bundles):
        """The row (and column) bundles of the rows at row_ptrs: read by the quantizer where
        they lie (Execution.quantizer_gathers), or gathered into bf16_rows first."""
        D = self.cfg.hidden_dim
        if self.quantizer_gathers:
            self.k.quantize(None, offs, D, row_ptrs=row_ptrs, **bundles)
            return
        self.bf.gather(tabs, row_ptrs, bf16_rows, nrows, token_rows_at)
        self.k.quantize(bf16_rows, offs, D, **bundles)

    def prepare(self, w13_E2FD, w2_EDF, training: bool, into=None):
        """The Fp8Weights of these weights (see the class docstring), written into `into`."""
        return self.k.weights(w13_E2FD, w2_EDF, transposed=training, into=into)

    def forward(self, tabs: RoutingTables, w13_E2FD, w2_EDF, scatter_ptrs, at: dict,
                rows=None, prepared=None, training: bool = True) -> None:
        offs, nrows = rows if rows is not None else (tabs.expert_offsets, tabs.num_rows)
        W = prepared if prepared is not None else self.prepare(w13_E2FD, w2_EDF, training)
        self._gather_quantize(tabs, tabs.fwd_gather_ptrs, "dispatch", at["x_g"], offs, nrows,
                              rows=(at["xq"], at["xq_s"]),
                              cols=(at["x_c"], at["x_c_s"]) if training else None)
        self.k.mm((at["xq"], at["xq_s"]), W.w13, W.w13_s, offs, "store", out=at["h1"])
        self.k.swiglu_quant(at["h1"], nrows, (at["h2q"], at["h2q_s"]),
                            (at["h1q"], at["h1q_s"]) if training else None)
        if scatter_ptrs is None:
            return
        if self.pull_combine:   # dense rows into x_g's region (free by now: quantized or unused)
            self.k.mm((at["h2q"], at["h2q_s"]), W.w2, W.w2_s, offs, "store", out=at["x_g"])
        else:
            self.k.mm((at["h2q"], at["h2q_s"]), W.w2, W.w2_s, offs, "scatter",
                      out_row_ptrs=scatter_ptrs)

    def backward(self, tabs: RoutingTables, w13_E2FD, w2_EDF, gather_ptrs, scatter_ptrs, ba,
                 wgrad_dtype: str, score_ptrs=None, score_grad_delta: int = 0,
                 part_stride: int = 0, wgrad_into=None, prepared=None):
        """As StandardPipeline.backward; `prepared`: the forward's Fp8Weights."""
        D, F = self.cfg.hidden_dim, self.cfg.intermediate_dim
        offs, nrows = tabs.expert_offsets, tabs.num_rows
        at = ba.at
        W = prepared if prepared is not None else self.prepare(w13_E2FD, w2_EDF, True)
        out_dtype = wgrad_store_dtype(wgrad_dtype, w13_E2FD.dtype)
        self._gather_quantize(tabs, gather_ptrs, "combine" if score_ptrs is not None else None,
                              at["g3"], offs, nrows, rows=(at["g3q"], at["g3q_s"]),
                              cols=(at["g3c"], at["g3c_s"]))
        sc = {} if score_ptrs is None else dict(score_ptrs=score_ptrs,
                                               score_grad_delta=score_grad_delta,
                                               part_stride=part_stride)
        self.k.w2_dgrad((at["g3q"], at["g3q_s"]), W, offs, nrows, (at["h1q"], at["h1q_s"]),
                        at["h2"], at["gh1"], (at["gh1q"], at["gh1q_s"]),
                        (at["gh1c"], at["gh1c_s"]), (at["h2c"], at["h2c_s"]), **sc)
        grad_w2 = wgrad_output(wgrad_into, 1, (self.E, D, F), out_dtype, self.device)
        self.k.wgrad((at["g3c"], at["g3c_s"]), (at["h2c"], at["h2c_s"]), offs, grad_w2)
        # (g3's bf16 rows are dead once quantized: the CUTLASS W13 DGRAD's dense rows go there)
        self.k.w13_dgrad((at["gh1q"], at["gh1q_s"]), W, offs, nrows,
                         None if self.pull_combine else scatter_ptrs, at["g3"])
        grad_w13 = wgrad_output(wgrad_into, 0, (self.E, 2 * F, D), out_dtype, self.device)
        self.k.wgrad((at["gh1c"], at["gh1c_s"]), (at["x_c"], at["x_c_s"]), offs, grad_w13)
        if wgrad_into is not None:
            return None, None
        return grad_w13, grad_w2


class Mxfp8Kernels:
    """The mxfp8 steps (Triton, kernels/quant_mxfp8.py): the quantizations that write the bf16
    copies of MXFP8 operands the bf16 GEMMs read (exact: quant/mxfp8.py), the saved bundles,
    and the dequantization of saved bundles."""

    def __init__(self, cfg: Config, max_rows: int):
        self.cfg, self.max_rows = cfg, max_rows
        self.act = dict(activation=cfg.activation, swiglu_alpha=cfg.swiglu_alpha,
                        swiglu_limit=cfg.swiglu_limit)

    def quantize(self, x, offs, K: int, rows_fake=None, cols=None, cols_fake=None,
                 row_ptrs=None):
        from ...kernels.quant_mxfp8 import quantize
        quantize(x, offs, self.max_rows, K, rows_fake=rows_fake, cols=cols, cols_fake=cols_fake,
                 row_ptrs=row_ptrs)

    def swiglu_quant(self, h1, nrows, h2_fake, h1q=None):
        from ...kernels.quant_mxfp8 import swiglu_quant
        swiglu_quant(h1, nrows, self.max_rows, self.cfg.intermediate_dim, h2_fake=h2_fake,
                     h1q=h1q, **self.act)

    def dequantize_rows(self, q, e, nrows, K: int, out):
        from ...kernels.quant_mxfp8 import dequantize_rows
        dequantize_rows(q, e, nrows, self.max_rows, K, out=out)

    def dequantize_cols(self, q, e, offs, K: int, out):
        from ...kernels.quant_mxfp8 import dequantize_cols
        dequantize_cols(q, e, offs, self.max_rows, K, out=out)

    @staticmethod
    def weights(w13_E2FD, w2_EDF, into=None):
        """(W13, W2) as bf16 copies of their 32 x 32 tile quantization (one serves FPROP and
        DGRAD, as the guide's grouped 32 x 32 weight quantization intends), written into the
        pair `into` when given."""
        from ...kernels.quant_mxfp8 import fake_weight
        o13, o2 = into if into is not None else (None, None)
        return (fake_weight(w13_E2FD.contiguous(), out=o13),
                fake_weight(w2_EDF.contiguous(), out=o2))


class Mxfp8Pipeline(StandardPipeline):
    """mxfp8, standard order, with the bf16 GEMMs of StandardPipeline on MXFP8 operands (their
    bf16 copies, exact). The gathers as Fp8BlockPipeline's (Execution.fp8_gather: at EP = 1 the
    quantizer reads the token rows where they lie and writes x_g's fake rows, no bf16 copy
    first). Forward: gather x_g, quantize it (x_g's fake rows in place; training:
    the saved column bundle x_c), W13 -> h1, SwiGLU + quantization (h2q: fake rows of h2;
    training: the saved h1 row bundle), W2 + scatter. Backward: gather g3, quantize it (fake
    columns g3_wg, then fake rows in place), h1 from the saved bundle into gh1, W2 DGRAD with
    the SwiGLU backward over gh1 (+ h2, + score parts), fake columns of h2 and grad_h1 and grad_h1's
    fake rows in place, W2 WGRAD, W13 DGRAD + scatter, x_wg from x_c, W13 WGRAD. Weights: bf16
    copies of their quantization, made by every forward (as Fp8BlockPipeline's, also the
    weight cache) and reused by its backward."""

    def __init__(self, cfg, execution, num_local_experts, max_rows, device, rank):
        super().__init__(cfg, execution, num_local_experts, max_rows, device, rank)
        self.mx = Mxfp8Kernels(cfg, max_rows)
        self.quantizer_gathers = execution.quantizer_gathers

    @property
    def uses_fanout(self) -> bool:
        return not self.quantizer_gathers

    def _gather_quantize(self, tabs, row_ptrs, token_rows_at, rows_fake, offs, nrows, **outs):
        """rows_fake (bf16 [R, D]) := the fake rows of the rows at row_ptrs, with the other
        outputs of Mxfp8Kernels.quantize: read by the quantizer where they lie
        (Execution.quantizer_gathers), or gathered into rows_fake first and quantized there."""
        D = self.cfg.hidden_dim
        if self.quantizer_gathers:
            self.mx.quantize(None, offs, D, rows_fake=rows_fake, row_ptrs=row_ptrs, **outs)
            return
        self.k.gather(tabs, row_ptrs, rows_fake, nrows, token_rows_at)
        self.mx.quantize(rows_fake, offs, D, rows_fake=rows_fake, **outs)

    def prepare(self, w13_E2FD, w2_EDF, training: bool, into=None):
        return self.mx.weights(w13_E2FD, w2_EDF, into)    # one copy serves both directions

    def forward(self, tabs: RoutingTables, w13_E2FD, w2_EDF, scatter_ptrs, at: dict,
                rows=None, prepared=None, training: bool = True) -> None:
        from ...kernels.grouped_gemm import grouped_mm_fwd
        offs, nrows = rows if rows is not None else (tabs.expert_offsets, tabs.num_rows)
        w13, w2 = prepared if prepared is not None else self.prepare(w13_E2FD, w2_EDF, training)
        self._gather_quantize(tabs, tabs.fwd_gather_ptrs, "dispatch", at["x_g"], offs, nrows,
                              cols=(at["x_c"], at["x_c_s"]) if training else None)
        tails = {} if training else self.inference_tails
        grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=self.max_rows, a=at["x_g"],
                       epilogue="store", out=at["h1"], a_tail_rows=tails.get("x_g", 0))
        self.mx.swiglu_quant(at["h1"], nrows, at["h2q"],
                             (at["h1q"], at["h1q_s"]) if training else None)
        if scatter_ptrs is not None:
            self.k.w2_scatter(w2, offs, at["h2q"], scatter_ptrs, tails.get("h2q", 0))

    def backward(self, tabs: RoutingTables, w13_E2FD, w2_EDF, gather_ptrs, scatter_ptrs, ba,
                 wgrad_dtype: str, score_ptrs=None, score_grad_delta: int = 0,
                 part_stride: int = 0, wgrad_into=None, prepared=None):
        """As StandardPipeline.backward; `prepared`: the forward's weight copies."""
        D, F = self.cfg.hidden_dim, self.cfg.intermediate_dim
        offs, nrows = tabs.expert_offsets, tabs.num_rows
        at = ba.at
        w13, w2 = prepared if prepared is not None else self.prepare(w13_E2FD, w2_EDF, True)
        out_dtype = wgrad_store_dtype(wgrad_dtype, w13_E2FD.dtype)
        score = None if score_ptrs is None else (score_ptrs, score_grad_delta, part_stride)
        self._gather_quantize(tabs, gather_ptrs, "combine" if score is not None else None,
                              at["g3"], offs, nrows, cols_fake=at["g3_wg"])
        self.mx.dequantize_rows(at["h1q"], at["h1q_s"], nrows, 2 * F, out=at["gh1"])
        self.k.w2_dgrad_swiglu_bwd(w2, offs, at["g3"], at["gh1"], at["h2"], score)
        self.mx.quantize(at["gh1"], offs, 2 * F, rows_fake=at["gh1"], cols_fake=at["gh1_wg"])
        self.mx.quantize(at["h2"], offs, F, cols_fake=at["h2_wg"])
        grad_w2 = wgrad_output(wgrad_into, 1, (self.E, D, F), out_dtype, self.device)
        self.k.wgrad(at["g3_wg"], at["h2_wg"], offs, grad_w2)
        self.k.w13_dgrad_scatter(w13, offs, at["gh1"], scatter_ptrs)
        self.mx.dequantize_cols(at["x_c"], at["x_c_s"], offs, D, out=at["x_wg"])
        grad_w13 = wgrad_output(wgrad_into, 0, (self.E, 2 * F, D), out_dtype, self.device)
        self.k.wgrad(at["gh1_wg"], at["x_wg"], offs, grad_w13)
        if wgrad_into is not None:
            return None, None
        return grad_w13, grad_w2


class Nvfp4Pipeline:
    """nvfp4 inference (prepared.PreparedWeight weights). The source rank quantizes its token
    rows into its dispatch buffer (`publish`: one NVFP4 byte row per token in each bf16 row
    slot, so the routing tables' addresses hold); the experts' owner gathers them (fan-out,
    layout.nvfp4_row_bytes(D) bytes per row) into x_g and, in the same pass, their values into
    a16 (fp16), W13 -> h1 (bf16), SwiGLU + quantization -> h2q (NVFP4 rows) and its a16, W2 +
    scatter to the owners' combine rows in bf16
    (kernels/quant_nvfp4.py, kernels/grouped_gemm/nvfp4.py)."""

    name = "standard"
    uses_fanout = True
    score_parts = 0      # no backward

    def __init__(self, cfg: Config, execution: Execution, num_local_experts: int, max_rows: int,
                 device: torch.device, rank: int):
        self.cfg, self.E, self.max_rows, self.device = cfg, num_local_experts, max_rows, device
        self.wait_timeout_s = execution.wait_timeout_s
        self.act = dict(activation=cfg.activation, swiglu_alpha=cfg.swiglu_alpha,
                        swiglu_limit=cfg.swiglu_limit)
        # Execution.nvfp4_gemm: the CUDA engine's GEMM per GEMM at this row bound (W13
        # contracts D, W2 F): the decode GEMM up to 16 rows per expert, the wgmma GEMM above
        # (kernels/grouped_gemm/nvfp4_decode.py, nvfp4_wgmma.py), else the Triton NVFP4 GEMM;
        # either engine, from memory_plan.NVFP4_DENSE_MIN_ROWS_PER_EXPERT, decodes the weights
        # once per call into the plan's scratch (nvfp4_dense.py, Triton); each GEMM's a16 is
        # decoded in the order its kernel reads
        from ...memory_plan import nvfp4_weight_scratch_bytes
        D, F = cfg.hidden_dim, cfg.intermediate_dim
        self.cuda_variants = None
        self.gemm_workspace = None   # the stream-K variants' partial sums and flags
        self.gemm_status = None      # its status word (a wait that gave up)
        self.dense_scratch = None    # nvfp4_dense's decoded weights (its variant only)
        self.a16_orders = ("k", "k")
        scratch_bytes = nvfp4_weight_scratch_bytes(cfg, num_local_experts, max_rows)
        self.dense = scratch_bytes > 0
        if self.dense:
            self.dense_scratch = torch.empty(scratch_bytes // 2, dtype=torch.float16,
                                             device=device)
        if execution.nvfp4_gemm == "cuda" and not self.dense:   # the dense form needs neither
            from ...kernels.grouped_gemm import nvfp4_decode, nvfp4_wgmma
            # an explicit override skips Execution's probe: fail here, at creation
            if not nvfp4_decode.loads(device):
                raise RuntimeError(
                    "nvfp4's CUDA GEMMs (Execution.nvfp4_gemm='cuda') cannot run on "
                    f"{device}: they need an sm_90 GPU where csrc/nvfp4_*_mm.cu build (nvcc); "
                    "use execution_overrides={'nvfp4_gemm': 'triton'}")
            self.cuda_variants = tuple(nvfp4_wgmma.cuda_variant(max_rows, num_local_experts, k)
                                       for k in (D, F))
            self.a16_orders = tuple(nvfp4_wgmma.a16_order(v) for v in self.cuda_variants)
            self.gemm_workspace = nvfp4_wgmma.new_workspace(self.cuda_variants, device)
            if self.gemm_workspace is not None:
                self.gemm_status = nvfp4_wgmma.workspace_status(self.gemm_workspace)

    def _gemm(self, which: int, **kw) -> None:
        if self.dense:
            from ...kernels.grouped_gemm.nvfp4_dense import nvfp4_dense_mm
            nvfp4_dense_mm(scratch=self.dense_scratch, **kw)
        elif self.cuda_variants is not None:
            from ...kernels.grouped_gemm import nvfp4_wgmma
            # the GEMMs share the workspace's status word: one check after the last of them
            nvfp4_wgmma.run(self.cuda_variants[which], workspace=self.gemm_workspace,
                            wait_timeout_s=self.wait_timeout_s, check=False, **kw)
        else:
            from ...kernels.grouped_gemm.nvfp4 import nvfp4_grouped_mm
            nvfp4_grouped_mm(**kw)

    def publish(self, x_TD, ids_TK, header, ids16, dispatch, sched=None) -> None:
        """The routing header, the IDs and this rank's token rows quantized into its dispatch
        buffer (row slots 2D bytes apart), in one launch."""
        from ...kernels.quant_nvfp4 import publish_quantized
        publish_quantized(x_TD, ids_TK, header, ids16, dispatch, out_stride=2 * x_TD.shape[1],
                          sched=sched)

    def prepare(self, w13, w2, training: bool, into=None):
        assert not training, "nvfp4 runs inference only"
        return w13, w2

    def forward(self, tabs: RoutingTables, w13, w2, scatter_ptrs, at: dict, rows=None,
                prepared=None, training: bool = False) -> None:
        from ...kernels.quant_nvfp4 import fanout_dequantize, swiglu_quant
        D, F = self.cfg.hidden_dim, self.cfg.intermediate_dim
        offs, nrows = rows if rows is not None else (tabs.expert_offsets, tabs.num_rows)
        fan = tabs.fanout
        # each quantized token read once, decoded once into a16 for all of its rows here
        fanout_dequantize(fan.dispatch_base_EP, 2 * D, fan.dest_rows, fan.T, fan.K, at["x_g"],
                          nrows, D, a16=at["a16"], order=self.a16_orders[0])
        self._gemm(0, a=at["x_g"], a16=at["a16"], weight=w13, expert_offsets=offs,
                   max_rows=self.max_rows, epilogue="store", out=at["h1"])
        # h2's byte rows, and their decode into a16 (W13's a16 is read by then), in one pass
        swiglu_quant(at["h1"], nrows, self.max_rows, F, out=at["h2q"],
                     a16=at["a16"] if scatter_ptrs is not None else None,
                     a16_order=self.a16_orders[1], **self.act)
        if scatter_ptrs is not None:
            self._gemm(1, a=at["h2q"], a16=at["a16"], weight=w2, expert_offsets=offs,
                       max_rows=self.max_rows, epilogue="scatter", out_row_ptrs=scatter_ptrs)
        if self.gemm_status is not None:   # a stream-K wait that gave up traps here
            from ...kernels.checks import check_status
            check_status(self.gemm_status)

    def backward(self, *args, **kwargs):
        raise RuntimeError("nvfp4 runs inference only (Config refuses nvfp4 training)")


def make_expert_pipeline(cfg: Config, execution: Execution, num_local_experts: int,
                         max_rows: int, device: torch.device, rank: int):
    if execution.precision == "fp8_block":
        cls = Fp8BlockPipeline
    elif execution.precision == "mxfp8":
        cls = Mxfp8Pipeline
    elif execution.precision == "nvfp4":
        cls = Nvfp4Pipeline
    elif execution.gemm_engine == "torch":
        cls = TorchPipeline
    elif execution.pipeline == "mega":
        cls = MegaPipeline
    else:
        cls = StagedPipeline if execution.pipeline == "staged" else StandardPipeline
    return cls(cfg, execution, num_local_experts, max_rows, device, rank)

"""fp8_block: the block-quantization kernels, the FP8 block-scaled GEMMs and their pipeline."""

from __future__ import annotations

import torch

from ....config import Config
from ....execution import Execution
from ....kernels import rows as K_rows
from ..routing import RoutingTables
from .bf16 import Bf16Kernels
from .common import wgrad_output, wgrad_store_dtype


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
        from ....quant.fp8_block import BlockScaling
        self.cfg, self.E, self.max_rows = cfg, num_local_experts, max_rows
        # Execution.fp8_quant: the quantizer's engine, its launcher picked once
        if fp8_quant == "cuda":   # built or loaded here, outside any capture or timed region
            from ....kernels import quant_fp8_cuda
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
            from ....kernels.quant_fp8 import quantize_rows_cols
            self._quantize_rows_cols = quantize_rows_cols
            self._swiglu_bwd_quant = self._swiglu_bwd_quant_composed
        self.recipe = BlockScaling.of(cfg)
        self.act = dict(activation=cfg.activation, swiglu_alpha=cfg.swiglu_alpha,
                        swiglu_limit=cfg.swiglu_limit)
        # Execution.fp8_gemm: the CUTLASS GEMMs own device argument (and zero) blocks, made
        # here (context creation, outside any capture; the WGRAD's for the two weight shapes)
        self.cutlass_fprop = self.cutlass_wgrad = None
        if fp8_gemm == "cutlass":
            from ....kernels.grouped_gemm_sm90 import GroupedFp8FpropSm90, GroupedFp8WgradSm90
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
        from ....kernels.quant_fp8 import swiglu_quant
        swiglu_quant(h1, nrows, self.max_rows, self.cfg.intermediate_dim, h2q=h2q, h1q=h1q,
                     recipe=self.recipe, **self.act)

    def weights(self, w13_E2FD, w2_EDF, transposed: bool, into=None):
        """Fp8Weights of one version (both orientations when `transposed`, for a backward),
        written into the tensors of `into` (an Fp8Weights) when given."""
        from ....kernels.quant_fp8 import quantize_weight
        from ....quant.fp8_block import Fp8Weights
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
        from ....kernels.grouped_gemm.fp8 import fp8_grouped_mm
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
        from ....kernels import quant_fp8_cuda
        from ....kernels.grouped_gemm.fp8 import fp8_config
        quant_fp8_cuda.swiglu_bwd_quant(u, h1q, offs, self.max_rows, self.cfg.intermediate_dim,
                                        gh1_rows=gh1_rows, gh1_cols=gh1_cols, h2_cols=h2_cols,
                                        recipe=self.recipe,
                                        part_cols=fp8_config(offs.device).block_n, **score,
                                        **self.act)

    def _swiglu_bwd_quant_composed(self, u, h1q, offs, nrows, gh1, gh1_rows, gh1_cols, h2_cols,
                                   score):
        from ....kernels.grouped_gemm.fp8 import fp8_config
        from ....kernels.quant_fp8 import swiglu_bwd_rows
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
        from ....kernels.common import as_device_ptr
        self.cutlass_fprop(gh1q, W.w13_t, W.w13_t_s, offs, dense)
        K_rows.scatter_rows(as_device_ptr(dense, "dense", torch.bfloat16), scatter_ptrs, nrows,
                            self.cfg.hidden_dim, torch.bfloat16, self.max_rows)

    def wgrad(self, a, b, offs, out):
        from ....kernels.grouped_gemm import ExpertOutTable
        accumulate = isinstance(out, ExpertOutTable)
        if self.cutlass_wgrad is not None:
            self.cutlass_wgrad(a, b, offs, out, accumulate=accumulate)
            return
        from ....kernels.grouped_gemm.fp8 import fp8_grouped_wgrad
        fp8_grouped_wgrad(a, b, offs, out, accumulate=accumulate)

    def score_parts(self, device) -> int:
        """Score-gradient parts per route the FP8 W2 DGRAD writes (its n-tiles over F)."""
        from ....kernels.grouped_gemm import score_parts_count
        from ....kernels.grouped_gemm.fp8 import fp8_config
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

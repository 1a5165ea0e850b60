"""nvfp4 inference on prepared weights: publication of NVFP4 rows, the NVFP4 GEMMs."""

from __future__ import annotations

import torch

from ....config import Config
from ....execution import Execution
from ..routing import RoutingTables


class Nvfp4Pipeline:
    """nvfp4 inference (prepared.PreparedWeight weights). The source rank quantizes its token
    rows into its dispatch buffer (`publish`: one NVFP4 byte row per token in each bf16 row
    slot, so the routing tables' addresses hold); the experts' owner gathers them (fan-out,
    layout.nvfp4_row_bytes(D) bytes per row) into x_g and, in the same pass, their values into
    a16 (fp16), W13 -> h1 (bf16), SwiGLU + quantization -> h2q (NVFP4 rows) and its a16 (the
    dense GEMM: W13 with the SwiGLU epilogue -> h2 (bf16), quantization -> h2q and its a16), W2
    + scatter to the owners' combine rows in bf16
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
        from ....memory_plan import nvfp4_weight_scratch_bytes
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
            from ....kernels.grouped_gemm import nvfp4_decode, nvfp4_wgmma
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
            from ....kernels.grouped_gemm.nvfp4_dense import nvfp4_dense_mm
            nvfp4_dense_mm(scratch=self.dense_scratch, **kw)
        elif self.cuda_variants is not None:
            from ....kernels.grouped_gemm import nvfp4_wgmma
            # the GEMMs share the workspace's status word: one check after the last of them
            nvfp4_wgmma.run(self.cuda_variants[which], workspace=self.gemm_workspace,
                            wait_timeout_s=self.wait_timeout_s, check=False, **kw)
        else:
            from ....kernels.grouped_gemm.nvfp4 import nvfp4_grouped_mm
            nvfp4_grouped_mm(**kw)

    def publish(self, x_TD, ids_TK, header, ids16, dispatch, sched=None) -> None:
        """The routing header, the IDs and this rank's token rows quantized into its dispatch
        buffer (row slots 2D bytes apart), in one launch."""
        from ....kernels.quant_nvfp4 import publish_quantized
        publish_quantized(x_TD, ids_TK, header, ids16, dispatch, out_stride=2 * x_TD.shape[1],
                          sched=sched)

    def prepare(self, w13, w2, training: bool, into=None):
        assert not training, "nvfp4 runs inference only"
        return w13, w2

    def forward(self, tabs: RoutingTables, w13, w2, scatter_ptrs, at: dict, rows=None,
                prepared=None, training: bool = False) -> None:
        from ....kernels.quant_nvfp4 import fanout_dequantize, quantize_rows, swiglu_quant
        D, F = self.cfg.hidden_dim, self.cfg.intermediate_dim
        offs, nrows = rows if rows is not None else (tabs.expert_offsets, tabs.num_rows)
        fan = tabs.fanout
        # each quantized token read once, decoded once into a16 for all of its rows here. Every
        # NVFP4 GEMM given a16 reads only the row's S_dec of a byte row: x_g and h2q hold that
        # alone (the packed values and block scales would be bytes written and never read)
        fanout_dequantize(fan.dispatch_base_EP, 2 * D, fan.dest_rows, fan.T, fan.K, at["x_g"],
                          nrows, D, a16=at["a16"], order=self.a16_orders[0], s_dec_only=True)
        # h2's byte rows, and their decode into a16 (W13's a16 is read by then), in one pass
        a16_h2 = at["a16"] if scatter_ptrs is not None else None
        sdec = a16_h2 is not None
        if self.dense:
            # the dense GEMM's SwiGLU epilogue stores bf16 h2 (in h1's region) and never h1;
            # its quantization then reads half of swiglu_quant's bytes, to the same bits
            self._gemm(0, a=at["x_g"], a16=at["a16"], weight=w13, expert_offsets=offs,
                       max_rows=self.max_rows, epilogue="swiglu", h2=at["h1"], **self.act)
            quantize_rows(at["h1"], nrows, self.max_rows, F, out=at["h2q"], a16=a16_h2,
                          a16_order=self.a16_orders[1], s_dec_only=sdec)
        else:
            self._gemm(0, a=at["x_g"], a16=at["a16"], weight=w13, expert_offsets=offs,
                       max_rows=self.max_rows, epilogue="store", out=at["h1"])
            swiglu_quant(at["h1"], nrows, self.max_rows, F, out=at["h2q"], a16=a16_h2,
                         a16_order=self.a16_orders[1], s_dec_only=sdec, **self.act)
        if scatter_ptrs is not None:
            self._gemm(1, a=at["h2q"], a16=at["a16"], weight=w2, expert_offsets=offs,
                       max_rows=self.max_rows, epilogue="scatter", out_row_ptrs=scatter_ptrs)
        if self.gemm_status is not None:   # a stream-K wait that gave up traps here
            from ....kernels.checks import check_status
            check_status(self.gemm_status)

    def backward(self, *args, **kwargs):
        raise RuntimeError("nvfp4 runs inference only (Config refuses nvfp4 training)")

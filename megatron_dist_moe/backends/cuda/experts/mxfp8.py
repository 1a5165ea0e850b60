"""mxfp8: the quantization kernels around the bf16 pipeline's GEMMs (exact on Hopper)."""

from __future__ import annotations


from ....config import Config
from ..routing import RoutingTables
from .bf16 import StandardPipeline
from .common import wgrad_output, wgrad_store_dtype


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
        from ....kernels.quant_mxfp8 import quantize
        quantize(x, offs, self.max_rows, K, rows_fake=rows_fake, cols=cols, cols_fake=cols_fake,
                 row_ptrs=row_ptrs)

    def swiglu_quant(self, h1, nrows, h2_fake, h1q=None):
        from ....kernels.quant_mxfp8 import swiglu_quant
        swiglu_quant(h1, nrows, self.max_rows, self.cfg.intermediate_dim, h2_fake=h2_fake,
                     h1q=h1q, **self.act)

    def dequantize_rows(self, q, e, nrows, K: int, out):
        from ....kernels.quant_mxfp8 import dequantize_rows
        dequantize_rows(q, e, nrows, self.max_rows, K, out=out)

    def dequantize_cols(self, q, e, offs, K: int, out):
        from ....kernels.quant_mxfp8 import dequantize_cols
        dequantize_cols(q, e, offs, self.max_rows, K, out=out)

    @staticmethod
    def weights(w13_E2FD, w2_EDF, into=None):
        """(W13, W2) as bf16 copies of their 32 x 32 tile quantization (one serves FPROP and
        DGRAD, as the guide's grouped 32 x 32 weight quantization intends), written into the
        pair `into` when given."""
        from ....kernels.quant_mxfp8 import fake_weight
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
        from ....kernels.grouped_gemm import grouped_mm_fwd
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

"""bf16: the kernels of the expert path (Bf16Kernels) and the pipelines that order them
(Standard, Staged, Mega; TorchPipeline, the GEMM oracle and a baseline)."""

from __future__ import annotations

import torch

from ....config import Config
from ....execution import Execution
from ....kernels import rows as K_rows
from ....layout import tail_rows
from ..routing import RoutingTables
from .common import wgrad_output, wgrad_store_dtype


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
        from ....kernels.grouped_gemm import grouped_mm_fwd
        a = dict(a=xg) if claim is None else dict(a_row_ptrs=row_ptrs, a_copy_out=xg,
                                                  claim_flags=claim)
        grouped_mm_fwd(w=w13, expert_offsets=offs, max_rows=self.max_rows, epilogue="swiglu",
                       h1=h1, h2=h2, config=config, a_tail_rows=xg_tail, **a, **self.act,
                       **self.timeout)

    def w2_scatter(self, w2, offs, h2, out_rows, h2_tail: int = 0):
        """h3 = h2 W2^T, row i stored at out_rows[i] (the owners' combine rows); h2_tail: rows
        of h2's region past R."""
        from ....kernels.grouped_gemm import grouped_mm_fwd
        grouped_mm_fwd(w=w2, expert_offsets=offs, max_rows=self.max_rows, a=h2,
                       epilogue="scatter", out_row_ptrs=out_rows, a_tail_rows=h2_tail)

    def w2_dgrad_swiglu_bwd(self, w2, offs, g3, h1, h2, score, claim=None, row_ptrs=None):
        """grad_h2 = g3 W2 inside the kernel; grad_h1 over h1, h2 rebuilt; with `score` =
        (score_ptrs, score_grad_delta, part_stride) h2 is scaled by the route's score and each
        n-tile's share of the score gradient goes to the owner's part slots."""
        from ....kernels.grouped_gemm import grouped_mm_dgrad
        a = dict(a=g3) if claim is None else dict(a_row_ptrs=row_ptrs, a_copy_out=g3,
                                                  claim_flags=claim)
        sc = {} if score is None else dict(score_ptrs=score[0], score_grad_delta=score[1],
                                          part_stride=score[2])
        grouped_mm_dgrad(w=w2, expert_offsets=offs, max_rows=self.max_rows,
                         epilogue="swiglu_bwd", h1=h1, h2=h2, **a, **sc, **self.act,
                         **self.timeout)

    def score_parts(self, device) -> int:
        """Score-gradient parts per route the W2 DGRAD writes (its n-tiles over F)."""
        from ....kernels.grouped_gemm import score_parts_count, select_config
        F = self.cfg.intermediate_dim
        return score_parts_count(F, select_config("dgrad", n=F, kd=self.cfg.hidden_dim,
                                                  device=device))

    def w13_dgrad_scatter(self, w13, offs, grad_h1, out_rows):
        from ....kernels.grouped_gemm import grouped_mm_dgrad
        grouped_mm_dgrad(w=w13, expert_offsets=offs, max_rows=self.max_rows, a=grad_h1,
                         epilogue="scatter", out_row_ptrs=out_rows)

    def wgrad(self, a, b, offs, out) -> None:
        """out[e] = a_e^T b_e (bf16 rows at device pointers); += when out is an
        ExpertOutTable (routed_experts(wgrad_into=...))."""
        from ....kernels.grouped_gemm import ExpertOutTable, grouped_mm_wgrad
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
        # an inference forward stores no h1 (its layout has none): only a backward reads it
        self._w13(tabs, w13_E2FD, offs, nrows, at["x_g"], at["h1"] if training else None,
                  at["h2"], tails.get("x_g", 0))
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
        from ....kernels.grouped_gemm import ClaimFlags
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
        from ....kernels.grouped_gemm.mega import MegaFlags
        self.flags = MegaFlags(max_rows, num_local_experts, device)
        self.timeout = dict(timeout_s=execution.wait_timeout_s, rank=rank)

    def _w13_tiles(self, w13):
        # the W13-only replay runs the Mega kernel's tiles: the bits its forward stored
        from ....kernels.grouped_gemm.mega import mega_config
        return mega_config(w13[0].numel() // w13.shape[-1], w13.shape[-1], w13.device,
                           self.max_rows, self.E)

    def forward(self, tabs: RoutingTables, w13_E2FD, w2_EDF, scatter_ptrs, at: dict,
                rows=None, prepared=None, training: bool = True) -> None:
        from ....kernels.grouped_gemm.mega import mega_fwd
        if scatter_ptrs is None:
            return super().forward(tabs, w13_E2FD, w2_EDF, None, at, rows, prepared, training)
        offs, nrows = rows if rows is not None else (tabs.expert_offsets, tabs.num_rows)
        self.k.gather(tabs, tabs.fwd_gather_ptrs, at["x_g"], nrows, "dispatch")
        mega_fwd(xg=at["x_g"], w13=w13_E2FD, w2=w2_EDF, expert_offsets=offs,
                 max_rows=self.max_rows, h2=at["h2"], h1=at["h1"] if training else None,
                 out_row_ptrs=scatter_ptrs, flags=self.flags, **self.k.act, **self.timeout,
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
        xg_addr = at["x_g"]
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
        if training:   # an inference layout has no h1 (nothing reads it)
            K_rows.copy_rows(K_rows.device_ptr(h1), at["h1"], nrows, 2 * F, Rm)

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

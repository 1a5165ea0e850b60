"""The expert math of the reference backend, one class per precision (plain torch).

The reference backend moves rows between ranks and decides where each tensor lives; these
classes compute the expert MLP on the received rows, expert-major, in the arena regions of the
one per-call layout (layout.py). `views(name, shape, dtype)` returns the region `name` (the
activation slot for saved regions of a full-save layer, else the call's scratch).

    Bf16Math        operands in the storage dtype, fp32 accumulation (fp64 for fp64 inputs)
    BlockQuantMath  a block-scaled format's quantizers at every GEMM operand (fp8_block:
                    quant/fp8_block.py), fp32 accumulation of the dequantized values; the same
                    quantization points as the CUDA kernels
    Mxfp8Math       the same quantization points with quant/mxfp8.py's quantizers, the
                    dequantized operands held in bf16 regions (exact), as the CUDA backend
                    computes mxfp8
    Nvfp4Math       inference on prepared NVFP4 weights (prepared.py): x arrives as NVFP4
                    rows quantized on the source rank, h2 is quantized to NVFP4 rows before W2

Segments: `segs` lists (expert, first row, row end) of the expert-major rows.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..activation import Activation
from ..layout import BLOCK as PAD   # column bundles pad each expert's rows to this multiple
from ..layout import padded_rows
from ..quant import format_of
from ..quant.fp8_block import FP8_DTYPE, padded_offsets

__all__ = ["Bf16Math", "BlockQuantMath", "Mxfp8Math", "Nvfp4Math", "make_math"]

Views = Callable[..., torch.Tensor]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class Bf16Math:
    """h1 = round(x_g W13^T), h2 = round(act(h1)), h3 = round(h2 W2^T); the backward rebuilds h2
    from h1 and writes grad_h1 over h1 (as the CUDA kernels do)."""

    precision = "bf16"

    def __init__(self, act: Activation, D: int, F: int, num_local_experts: int):
        self.act, self.D, self.F, self.E = act, D, F, num_local_experts

    def forward(self, views: Views, x_g: torch.Tensor, w13_END, w2_EDF, segs, with_w2: bool,
                training: bool) -> torch.Tensor | None:
        R, F, dt = x_g.shape[0], self.F, x_g.dtype
        acc = _acc(dt)
        segs = list(segs)
        h2 = views("h2", (R, F), dt)
        # an inference layout has no h1 (nothing reads it after the forward)
        h1 = views("h1", (R, 2 * F), dt) if training else None
        h3 = torch.empty_like(x_g) if with_w2 else None
        for e, a, b in segs:
            h1_e = (x_g[a:b].to(acc) @ w13_END[e].to(acc).T).to(dt)
            if h1 is not None:
                h1[a:b].copy_(h1_e)
            h2[a:b].copy_(self.act.forward(h1_e.to(acc)))
            if with_w2:
                h3[a:b].copy_(h2[a:b].to(acc) @ w2_EDF[e].to(acc).T)
        return h3

    def backward(self, views: Views, g3: torch.Tensor, s_rows, w13_END, w2_EDF, segs):
        """(grad_xg [R, D] storage dtype, grad_w13, grad_w2 in the accumulation dtype,
        grad_s_rows [R, 1] or None). s_rows [R, 1]: g3 holds unscaled grad_y rows, and the
        score of each row scales grad_h2 and h2 here (the expert-side score gradients)."""
        R, D, F, dt = g3.shape[0], self.D, self.F, g3.dtype
        acc = _acc(dt)
        segs = list(segs)
        x_g, h1, h2 = views("x_g", (R, D), dt), views("h1", (R, 2 * F), dt), views("h2", (R, F), dt)
        grad_w2 = torch.zeros(self.E, D, F, dtype=acc, device=g3.device)
        grad_w13 = torch.zeros(self.E, 2 * F, D, dtype=acc, device=g3.device)
        grad_s = None if s_rows is None else torch.zeros(R, 1, dtype=acc, device=g3.device)
        grad_h2 = torch.empty(R, F, dtype=dt, device=g3.device)
        for e, a, b in segs:
            h2[a:b].copy_(self.act.forward(h1[a:b].to(acc)))     # h2 is never saved
            g3e, h2e = g3[a:b].to(acc), h2[a:b].to(acc)
            u = g3e @ w2_EDF[e].to(acc)
            if s_rows is not None:
                grad_s[a:b] = (u * h2e).sum(dim=-1, keepdim=True)
                u, h2e = s_rows[a:b] * u, s_rows[a:b] * h2e
            grad_w2[e] = g3e.T @ h2e
            grad_h2[a:b].copy_(u)
        h1.copy_(self.act.backward(h1.to(acc), grad_h2.to(acc)))   # grad_h1, over h1
        grad_xg = torch.empty(R, D, dtype=dt, device=g3.device)
        for e, a, b in segs:
            gh1e = h1[a:b].to(acc)
            grad_w13[e] = gh1e.T @ x_g[a:b].to(acc)
            grad_xg[a:b].copy_(gh1e @ w13_END[e].to(acc))
        return grad_xg, grad_w13, grad_w2, grad_s


class BlockQuantMath:
    """A block-scaled precision: every GEMM operand quantized by `fmt` (fp8_block).

    forward   xq = rows(x_g) [, x_c = cols(x_g)], h1 = round(xq W13q^T) (bf16),
              [h1q = rows(h1) (saved)], h2 = round(act(h1)), h2q = rows(h2),
              h3 = round(h2q W2q^T)
    backward  h1 = deq(h1q) (fp32), h2 = round(act(h1)); g3q = rows(g3), g3c = cols(g3);
              u = g3q W2q (fp32); [s_rows: grad_s = <u, h2>, u = s u, h2 = round(s act(h1))];
              grad_h1 = round(act'(h1) round(u)); h2c = cols(h2); grad_W2 = g3c^T h2c;
              gh1q = rows(grad_h1), gh1c = cols(grad_h1); grad_xg = round(gh1q W13q);
              grad_W13 = gh1c^T x_c
    The weights are quantized from the passed bf16 weights on every call (128 x 128 tiles);
    the forward h2 comes from the bf16 h1, the backward's from the saved fp8 h1 (DeepSeek-V3).
    """

    def __init__(self, act: Activation, D: int, F: int, num_local_experts: int, fmt):
        self.act, self.D, self.F, self.E, self.fmt = act, D, F, num_local_experts, fmt
        self.precision = fmt.name

    def _rows(self, views, name, x):
        q, s = self.fmt.rows(x)
        views(name, q.shape, q.dtype).copy_(q)
        views(name + "_s", s.shape, s.dtype).copy_(s)
        return self.fmt.deq_rows(q, s)

    def _cols(self, views, name, x, offsets):
        Rp = padded_rows(x.shape[0], self.E)
        q, s = self.fmt.cols(x, offsets, Rp)
        views(name, q.shape, q.dtype).copy_(q)
        views(name + "_s", s.shape, s.dtype).copy_(s)
        return self.fmt.deq_cols(q, s)

    @staticmethod
    def _offsets(segs, R, device):
        ends = [b for _e, _a, b in segs]
        return torch.tensor([0] + ends if ends else [0, R], dtype=torch.int64, device=device)

    def _read_rows(self, views, name, R, width):
        q = views(name, (R, width), FP8_DTYPE)
        s = views(name + "_s", (R, width // self.fmt.block), self.fmt.scale_dtype)
        return self.fmt.deq_rows(q, s)

    def _read_cols(self, views, name, R, width):
        Rp = padded_rows(R, self.E)
        q = views(name, (width, Rp), FP8_DTYPE)
        s = views(name + "_s", (Rp // self.fmt.block, width), self.fmt.scale_dtype)
        return self.fmt.deq_cols(q, s)

    def _weights(self, w13_END, w2_EDF):
        return (self.fmt.deq_weight(*self.fmt.weight(w13_END)),
                self.fmt.deq_weight(*self.fmt.weight(w2_EDF)))

    def forward(self, views: Views, x_g, w13_END, w2_EDF, segs, with_w2, training):
        R, F, dt = x_g.shape[0], self.F, x_g.dtype
        segs = list(segs)
        w13, w2 = self._weights(w13_END, w2_EDF)
        xd = self._rows(views, "xq", x_g)
        if training:
            self._cols(views, "x_c", x_g, self._offsets(segs, R, x_g.device))
        h1 = views("h1", (R, 2 * F), dt)
        for e, a, b in segs:
            h1[a:b].copy_(xd[a:b] @ w13[e].T)
        if training:
            self._rows(views, "h1q", h1)
        h2 = self.act.forward(h1.float()).to(dt)
        h2d = self._rows(views, "h2q", h2)
        if not with_w2:
            return None
        h3 = torch.empty_like(x_g)
        for e, a, b in segs:
            h3[a:b].copy_(h2d[a:b] @ w2[e].T)
        return h3

    def backward(self, views: Views, g3, s_rows, w13_END, w2_EDF, segs):
        R, D, F, dt, dev = g3.shape[0], self.D, self.F, g3.dtype, g3.device
        segs = list(segs)
        offsets = self._offsets(segs, R, dev)
        poffs = padded_offsets(offsets).tolist()
        w13, w2 = self._weights(w13_END, w2_EDF)
        h1 = self._read_rows(views, "h1q", R, 2 * F)
        h2f = self.act.forward(h1)
        h2 = h2f.to(dt)
        g3d = self._rows(views, "g3q", g3)
        g3c = self._cols(views, "g3c", g3, offsets)
        grad_s = None if s_rows is None else torch.zeros(R, 1, dtype=torch.float32, device=dev)
        u = torch.zeros(R, F, dtype=torch.float32, device=dev)
        for e, a, b in segs:
            u[a:b] = g3d[a:b] @ w2[e]
        if s_rows is not None:
            grad_s = (u * h2.float()).sum(dim=-1, keepdim=True)
            u = s_rows * u
            h2 = (s_rows * h2f).to(dt)
        gh1 = views("gh1", (R, 2 * F), dt)
        gh1.copy_(self.act.backward(h1, u.to(dt).float()))
        views("h2", (R, F), dt).copy_(h2)
        h2c = self._cols(views, "h2c", h2, offsets)
        gh1d = self._rows(views, "gh1q", gh1)
        gh1c = self._cols(views, "gh1c", gh1, offsets)
        x_c = self._read_cols(views, "x_c", R, D)
        grad_w2 = torch.zeros(self.E, D, F, dtype=torch.float32, device=dev)
        grad_w13 = torch.zeros(self.E, 2 * F, D, dtype=torch.float32, device=dev)
        grad_xg = torch.empty(R, D, dtype=dt, device=dev)
        for (e, a, b), p in zip(segs, poffs):
            q = p + (b - a + PAD - 1) // PAD * PAD   # the padded segment
            grad_w2[e] = g3c[p:q].T @ h2c[p:q]
            grad_w13[e] = gh1c[p:q].T @ x_c[p:q]
            grad_xg[a:b].copy_(gh1d[a:b] @ w13[e])
        return grad_xg, grad_w13, grad_w2, grad_s


class Mxfp8Math:
    """mxfp8 at the regions of layout.py's mxfp8 layout: every GEMM operand is the bf16 copy of
    its MXFP8 quantization (quant/mxfp8.py `fake_*`, exact), the quantization points those of
    BlockQuantMath, so testing.block_quant_emulation gives the same values.

    forward   x_c = cols(x_g) (training); x_g = fake_rows(x_g); h1 = round(x_g W13f^T);
              h1q = rows(h1) (training); h2q = fake_rows(round(act(h1))); h3 = round(h2q W2f^T)
    backward  gh1 = deq(h1q); g3_wg = fake_cols(g3); g3 = fake_rows(g3); u = g3 W2f (fp32);
              [s_rows: grad_s = <u, round(act(gh1))>, u = s u]; h2 = round(s act(gh1));
              gh1 = round(act'(gh1) round(u)); h2_wg = fake_cols(h2); gh1_wg = fake_cols(gh1);
              gh1 = fake_rows(gh1); x_wg = deq(x_c); grad_W2 = g3_wg^T h2_wg,
              grad_xg = round(gh1 W13f), grad_W13 = gh1_wg^T x_wg
    W13f, W2f: the 32 x 32 tile quantization of the passed bf16 weights, dequantized."""

    precision = "mxfp8"

    def __init__(self, act: Activation, D: int, F: int, num_local_experts: int):
        self.act, self.D, self.F, self.E = act, D, F, num_local_experts

    @staticmethod
    def _offsets(segs, R, device):
        return BlockQuantMath._offsets(segs, R, device)

    @staticmethod
    def _weights(w13_END, w2_EDF):
        from ..quant.mxfp8 import fake_weight
        return fake_weight(w13_END).float(), fake_weight(w2_EDF).float()

    def forward(self, views: Views, x_g, w13_END, w2_EDF, segs, with_w2, training):
        from ..quant import mxfp8 as MX
        R, D, F, dt = x_g.shape[0], self.D, self.F, x_g.dtype
        segs = list(segs)
        w13, w2 = self._weights(w13_END, w2_EDF)
        if training:
            q, e = MX.quantize_cols(x_g, self._offsets(segs, R, x_g.device),
                                    padded_rows(R, self.E))
            views("x_c", q.shape, q.dtype).copy_(q)
            views("x_c_s", e.shape, e.dtype).copy_(e)
        x_g.copy_(MX.fake_rows(x_g))
        h1 = views("h1", (R, 2 * F), dt)
        for e_, a, b in segs:
            h1[a:b].copy_(x_g[a:b].float() @ w13[e_].T)
        if training:
            q, e = MX.quantize_rows(h1)
            views("h1q", q.shape, q.dtype).copy_(q)
            views("h1q_s", e.shape, e.dtype).copy_(e)
        h2q = views("h2q", (R, F), dt)
        h2q.copy_(MX.fake_rows(self.act.forward(h1.float()).to(dt)))
        if not with_w2:
            return None
        h3 = torch.empty(R, D, dtype=dt, device=x_g.device)
        for e_, a, b in segs:
            h3[a:b].copy_(h2q[a:b].float() @ w2[e_].T)
        return h3

    def backward(self, views: Views, g3, s_rows, w13_END, w2_EDF, segs):
        from ..quant import mxfp8 as MX
        R, D, F, dt, dev = g3.shape[0], self.D, self.F, g3.dtype, g3.device
        segs = list(segs)
        offsets = self._offsets(segs, R, dev)
        w13, w2 = self._weights(w13_END, w2_EDF)
        gh1 = views("gh1", (R, 2 * F), dt)
        h1q = views("h1q", (R, 2 * F), FP8_DTYPE)
        gh1.copy_(MX.dequantize_rows(h1q, views("h1q_s", (R, 2 * F // MX.BLOCK), torch.uint8)))
        views("g3_wg", (R, D), dt).copy_(MX.fake_cols(g3, offsets))
        g3.copy_(MX.fake_rows(g3))
        u = torch.zeros(R, F, dtype=torch.float32, device=dev)
        for e_, a, b in segs:
            u[a:b] = g3[a:b].float() @ w2[e_]
        h1 = gh1.float()
        h2f = self.act.forward(h1)
        h2 = h2f.to(dt)
        grad_s = None
        if s_rows is not None:
            grad_s = (u * h2.float()).sum(dim=-1, keepdim=True)
            u = s_rows * u
            h2 = (s_rows * h2f).to(dt)
        gh1.copy_(self.act.backward(h1, u.to(dt).float()))
        views("h2", (R, F), dt).copy_(h2)
        h2_wg = views("h2_wg", (R, F), dt)
        h2_wg.copy_(MX.fake_cols(h2, offsets))
        gh1_wg = views("gh1_wg", (R, 2 * F), dt)
        gh1_wg.copy_(MX.fake_cols(gh1, offsets))
        gh1.copy_(MX.fake_rows(gh1))
        Rp = padded_rows(R, self.E)
        x_c = MX.dequantize_cols(views("x_c", (D, Rp), FP8_DTYPE),
                                 views("x_c_s", (Rp // MX.BLOCK, D), torch.uint8))
        x_wg = views("x_wg", (R, D), dt)
        g3_wg = views("g3_wg", (R, D), dt)
        poffs = padded_offsets(offsets).tolist()
        grad_w2 = torch.zeros(self.E, D, F, dtype=torch.float32, device=dev)
        grad_w13 = torch.zeros(self.E, 2 * F, D, dtype=torch.float32, device=dev)
        grad_xg = torch.empty(R, D, dtype=dt, device=dev)
        for (e_, a, b), p in zip(segs, poffs):
            x_wg[a:b].copy_(x_c[p:p + b - a])
            grad_w2[e_] = g3_wg[a:b].float().T @ h2_wg[a:b].float()
            grad_w13[e_] = gh1_wg[a:b].float().T @ x_wg[a:b].float()
            grad_xg[a:b].copy_(gh1[a:b].float() @ w13[e_])
        return grad_xg, grad_w13, grad_w2, grad_s


class Nvfp4Math:
    """nvfp4 inference: every GEMM operand is NVFP4 (quant/nvfp4.py), products of the
    dequantized values accumulated in fp32.

    source    xq = rows(x) per token (the dispatched byte rows: layout.nvfp4_row_bytes)
    forward   h1 = round(deq(xq) W13d^T); h2 = round(act(h1)); h2q = rows(h2);
              h3 = round(deq(h2q) W2d^T)
    rows(.): one global scale per row (its amax), E4M3 scales per 16 values; W13d, W2d: the
    prepared weights, dequantized (one global scale per expert matrix)."""

    precision = "nvfp4"

    def __init__(self, act: Activation, D: int, F: int, num_local_experts: int):
        self.act, self.D, self.F, self.E = act, D, F, num_local_experts

    def source_rows(self, x_TD: torch.Tensor) -> torch.Tensor:
        """What the source rank publishes per token: its NVFP4 byte row."""
        from ..quant import nvfp4
        return nvfp4.quantize_row_bytes(x_TD)

    def forward(self, views: Views, x_g, w13, w2, segs, with_w2, training):
        from ..quant import nvfp4
        assert not training, "nvfp4 runs inference only"
        R, D, F = x_g.shape[0], self.D, self.F
        segs = list(segs)
        xd = nvfp4.dequantize_row_bytes(x_g, D)
        w13d, w2d = w13.dequantize(), w2.dequantize()
        h1 = views("h1", (R, 2 * F), torch.bfloat16)
        for e, a, b in segs:
            h1[a:b].copy_(xd[a:b] @ w13d[e].T)
        h2 = self.act.forward(h1.float()).to(torch.bfloat16)
        h2q = views("h2q", (R, nvfp4.row_bytes(F)), torch.uint8)
        h2q.copy_(nvfp4.quantize_row_bytes(h2))
        if not with_w2:
            return None
        h2d = nvfp4.dequantize_row_bytes(h2q, F)
        h3 = torch.empty(R, D, dtype=torch.bfloat16, device=x_g.device)
        for e, a, b in segs:
            h3[a:b].copy_(h2d[a:b] @ w2d[e].T)
        return h3

    def backward(self, *args, **kwargs):
        raise RuntimeError("nvfp4 runs inference only (Config refuses nvfp4 training)")


def make_math(config, num_local_experts: int):
    act = Activation.of(config)
    D, F = config.hidden_dim, config.intermediate_dim
    if config.precision == "bf16":
        return Bf16Math(act, D, F, num_local_experts)
    if config.precision == "mxfp8":
        return Mxfp8Math(act, D, F, num_local_experts)
    if config.precision == "nvfp4":
        return Nvfp4Math(act, D, F, num_local_experts)
    if config.precision == "fp8_block":
        return BlockQuantMath(act, D, F, num_local_experts, format_of(config))
    raise ValueError(f"the reference backend has no expert math for precision "
                     f"{config.precision!r}")

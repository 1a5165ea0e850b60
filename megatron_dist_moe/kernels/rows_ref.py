"""Plain-torch twins of kernels/rows.py and of the row kernels of kernels/quant_fp8.py (same
rounding points), used by tests."""

from __future__ import annotations

import torch

from ..activation import Activation

__all__ = ["act_ref", "act_bwd_ref", "combine_routes_ref", "fanout_rows_ref",
           "publish_grad_routes_ref", "reduce_routes_ref", "score_grad_rows_ref",
           "swiglu_bwd_rows_ref", "swiglu_bwd_quant_ref"]


def act_ref(h1_R2F: torch.Tensor, F: int, clamped: bool, alpha: float, limit: float) -> torch.Tensor:
    """SwiGLU (or the clamped GPT-OSS form) on [g | u] rows, computed in h1's dtype."""
    assert h1_R2F.shape[-1] == 2 * F, f"h1 is {h1_R2F.shape[-1]} wide, expected 2F = {2 * F}"
    return Activation("swiglu_clamped" if clamped else "swiglu", alpha, limit).forward(h1_R2F)


def act_bwd_ref(h1_R2F, grad_h2_RF, F, clamped, alpha, limit):
    """grad_h1 by autograd of act_ref (fp32)."""
    h1 = h1_R2F.float().detach().requires_grad_()
    (act_ref(h1, F, clamped, alpha, limit) * grad_h2_RF.float()).sum().backward()
    return h1.grad


def combine_routes_ref(routes_TKD, ids_TK, scores_TK):
    live = (ids_TK >= 0)[..., None]
    r = torch.where(live, routes_TKD.float(), 0.0)
    return (r * scores_TK.float()[..., None]).sum(1)


def publish_grad_routes_ref(gy_TD, routes_TKD, ids_TK, scores_TK):
    live = ids_TK >= 0
    grad_routes = (scores_TK.float()[..., None] * gy_TD.float()[:, None, :]).to(torch.bfloat16)
    r = torch.where(live[..., None], routes_TKD.float(), 0.0)
    grad_scores = (r * gy_TD.float()[:, None, :]).sum(-1)
    return grad_routes, grad_scores


def reduce_routes_ref(routes_TKD, ids_TK):
    return torch.where((ids_TK >= 0)[..., None], routes_TKD.float(), 0.0).sum(1)


def score_grad_rows_ref(u_RF, h2_RF, s_R):
    """(grad_s [R] fp32 = <u, h2>, bf16(s u), bf16(s h2)) for bf16 rows u, h2 and fp32 scores."""
    u, h = u_RF.float(), h2_RF.float()
    s = s_R.float()[:, None]
    return (u * h).sum(-1), (s * u).to(torch.bfloat16), (s * h).to(torch.bfloat16)


def fanout_rows_ref(src_EPTD: torch.Tensor, dest_rows: torch.Tensor, num_rows: int,
                    out_RD: torch.Tensor) -> torch.Tensor:
    """out[dest_rows[(r*T + t)*K + k]] = src[r, t] for rows in [0, num_rows); others untouched."""
    EP, T, D = src_EPTD.shape
    K = dest_rows.numel() // max(EP * T, 1)
    dest = dest_rows.view(EP, T, K).to(torch.int64)
    for r in range(EP):
        for t in range(T):
            for k in range(K):
                row = int(dest[r, t, k])
                if 0 <= row < num_rows:
                    out_RD[row] = src_EPTD[r, t]
    return out_RD


def swiglu_bwd_rows_ref(u_RF: torch.Tensor, h1q, act: Activation, s_R=None, block_n: int = 128):
    """quant_fp8.swiglu_bwd_rows in torch: (grad_h1 bf16 [R, 2F], h2 bf16 [R, F], parts fp32
    [R, F / block_n] or None) from bf16 u, the h1 row bundle (q, s) and the scores s_R (None:
    s = 1, no parts). grad_h1 = act'(h1) round(s u), h2 = round(s act(h1)), each part the
    <u, round(act(h1))> of one block_n-wide column block."""
    from ..quant.fp8_block import dequantize_rows
    R, F = u_RF.shape
    h1 = dequantize_rows(*h1q)
    u = u_RF.float()
    h2f = act.forward(h1)
    if s_R is None:
        return act.backward(h1, u).to(torch.bfloat16), h2f.to(torch.bfloat16), None
    s = s_R.float()[:, None]
    dh = (s * u).to(torch.bfloat16).float()
    parts = (u * h2f.to(torch.bfloat16).float()).view(R, F // block_n, block_n).sum(-1)
    return act.backward(h1, dh).to(torch.bfloat16), (s * h2f).to(torch.bfloat16), parts


def swiglu_bwd_quant_ref(u_RF: torch.Tensor, h1q, offsets: torch.Tensor, Rp: int, act: Activation,
                         s_R=None, part_cols: int = 128, recipe=None):
    """quant_fp8_cuda.swiglu_bwd_quant in torch: (grad_h1's row bundle, its column bundle, h2's
    column bundle, parts or None), swiglu_bwd_rows_ref's bf16 values quantized by
    quant/fp8_block.py (offsets: int [E + 1]; Rp: the padded rows of the column bundles)."""
    from ..quant import fp8_block as Q
    recipe = recipe if recipe is not None else Q.BlockScaling()
    gh1, h2, parts = swiglu_bwd_rows_ref(u_RF, h1q, act, s_R, part_cols)
    offs = offsets.long()
    return (Q.quantize_rows(gh1, recipe), Q.quantize_cols(gh1, offs, Rp, recipe),
            Q.quantize_cols(h2, offs, Rp, recipe), parts)

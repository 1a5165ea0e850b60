"""Baseline (a): the path users have today — NCCL all-to-all dispatch (host-synced split sizes)
+ torch._grouped_mm experts + all-to-all combine, differentiable through torch autograd.

Same contract as routed_experts (x [T,D] bf16, ids/scores [T,K], w13 [E_local,2F,D],
w2 [E_local,D,F]) so the benchmark can check it against our path before timing it.

Baseline (b), Megatron-Core's alltoall dispatcher with its own experts fed the same routes and
weights, is in megatron_baseline.py (it needs megatron-core).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as Fn
from torch.distributed.nn.functional import all_to_all_single


def a2a_grouped_mm_experts(x_TD, ids_TK, scores_TK, w13_E2FD, w2_EDF, group=None):
    EP = dist.get_world_size(group)
    E_local = w13_E2FD.shape[0]
    T, D = x_TD.shape
    K = ids_TK.shape[1]
    F = w2_EDF.shape[2]
    dev = x_TD.device
    flat_ids = ids_TK.reshape(-1).to(torch.int64)
    active = flat_ids >= 0
    # Sort this rank's routes by global expert (destination rank, then local expert).
    key = torch.where(active, flat_ids, torch.iinfo(torch.int64).max)
    order = torch.argsort(key, stable=True)
    n_active = int(active.sum())                          # host sync (as the baseline does)
    order = order[:n_active]
    dst_rank = flat_ids[order] // E_local
    send_counts = torch.bincount(dst_rank, minlength=EP)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits = send_counts.tolist()
    recv_splits = recv_counts.tolist()
    tok = order // K
    x_send = x_TD[tok]                                    # [n_active, D] permuted rows
    n_recv = sum(recv_splits)
    x_recv = all_to_all_single(torch.empty(n_recv, D, dtype=x_TD.dtype, device=dev), x_send,
                               recv_splits, send_splits, group=group)
    le_send = (flat_ids[order] % E_local).to(torch.int32)
    le_recv = torch.empty(n_recv, dtype=torch.int32, device=dev)
    dist.all_to_all_single(le_recv, le_send, recv_splits, send_splits, group=group)
    # Group received rows by local expert.
    perm = torch.argsort(le_recv, stable=True)
    counts = torch.bincount(le_recv.to(torch.int64), minlength=E_local)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xe = x_recv[perm]
    h1 = torch._grouped_mm(xe, w13_E2FD.transpose(1, 2), offs=offs)
    h2 = Fn.silu(h1[:, :F]) * h1[:, F:]
    h3 = torch._grouped_mm(h2, w2_EDF.transpose(1, 2), offs=offs)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=dev)
    back = all_to_all_single(torch.empty(n_active, D, dtype=x_TD.dtype, device=dev), h3[inv],
                             send_splits, recv_splits, group=group)
    w = scores_TK.reshape(-1)[order].to(torch.float32)
    y = torch.zeros(T, D, dtype=torch.float32, device=dev)
    y = y.index_add(0, tok, back.float() * w[:, None])
    return y.to(x_TD.dtype)

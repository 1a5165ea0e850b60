"""Symmetric (peer-addressable) buffers of one context: routing header, dispatch, combine.

One torch symmetric-memory allocation per context holds three regions at fixed byte offsets:

    routing   [128-byte header: int32 T, int32 schedule word] [int16 expert ids [T_max, K]]
              (save_route_outputs=False: + [fp32 scores [T_max, K]]
               [fp32 score-gradient parts [MemoryPlan.score_parts, T_max, K]])
    dispatch  [T_max * K, D] bf16   forward: x rows [T, D]; backward: route input gradients
    combine   [T_max * K, D] bf16   forward: route outputs h3; backward: route output gradients

Peer base addresses are kept as int64 device tensors (one entry per EP rank), so kernels build
peer row addresses on the device. Multicast is never used (GPU_FACTS: it must stay off).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...memory_plan import MemoryPlan, ROUTING_HEADER_BYTES, align128

__all__ = ["SymmetricBuffers"]


def _align(n: int, a: int = 4096) -> int:
    return -(-n // a) * a


def symm_mem_rendezvous(nbytes: int, group: dist.ProcessGroup, device: torch.device):
    """(local buffer, handle) from torch symmetric memory. The handle gives `buffer_ptrs` (every
    rank's base address), `get_buffer(rank, shape, dtype, offset)` and `barrier(channel=)`."""
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    return buf, symm_mem.rendezvous(buf, group.group_name)


class SymmetricBuffers:
    def __init__(self, plan: MemoryPlan, group: dist.ProcessGroup, device: torch.device,
                 rendezvous=symm_mem_rendezvous, barrier_timeout_s: float = 600.0):
        """rendezvous(nbytes, group, device) -> (buffer, handle); see `symm_mem_rendezvous`.
        The CPU tests pass a single-rank stand-in to run the backend's orchestration there.
        barrier_timeout_s: a device barrier whose peers do not all arrive within it traps
        (torch's barrier kernel prints which wait failed) instead of waiting for ever."""
        cfg = plan.config
        T, D, K = cfg.num_local_input_tokens, cfg.hidden_dim, cfg.top_k
        self.routing_off = 0
        self.dispatch_off = _align(plan.routing_bytes)
        self.combine_off = self.dispatch_off + _align(plan.dispatch_bytes)
        total = self.combine_off + _align(plan.combine_bytes)
        self.buf, self.handle = rendezvous(total, group, device)
        self.rank = dist.get_rank(group)
        self.ep_size = dist.get_world_size(group)
        bases = [int(p) for p in self.handle.buffer_ptrs]
        self.base_EP = torch.tensor(bases, dtype=torch.int64, device=device)
        self.routing_base_EP = self.base_EP + self.routing_off
        self.dispatch_base_EP = self.base_EP + self.dispatch_off
        self.combine_base_EP = self.base_EP + self.combine_off
        # Local typed views.
        b = self.buf
        self.header = b[0:8].view(torch.int32)
        self.ids_TK = b[ROUTING_HEADER_BYTES:ROUTING_HEADER_BYTES + align128(T * K * 2)][: T * K * 2] \
            .view(torch.int16).view(T, K)
        self.dispatch = b[self.dispatch_off:self.dispatch_off + plan.dispatch_bytes].view(torch.bfloat16)
        self.combine = b[self.combine_off:self.combine_off + plan.combine_bytes].view(torch.bfloat16)
        self.scores_TK = self.score_parts = None
        if not cfg.inference and not cfg.save_route_outputs:
            # expert-side score gradients: the owner's scores and the experts' parts (fp32), one
            # [T_max, K] slice per part (`rows.sum_score_parts` reads the parts as [P, T_max*K])
            s0, dlt = plan.route_scores_offset, plan.route_score_grads_delta
            self.scores_TK = b[s0:s0 + T * K * 4].view(torch.float32).view(T, K)
            stride = plan.score_part_stride // 4
            parts = b[s0 + dlt:s0 + dlt + plan.score_parts * plan.score_part_stride]
            self.score_parts = parts.view(torch.float32).view(plan.score_parts, stride)
        # Peer views of the routing regions (read after the publication barrier).
        self.peer_header = []
        self.peer_ids = []
        for r in range(self.ep_size):
            whole = self.handle.get_buffer(r, (total,), torch.uint8, 0)
            self.peer_header.append(whole[0:8].view(torch.int32))
            self.peer_ids.append(whole[ROUTING_HEADER_BYTES:ROUTING_HEADER_BYTES + T * K * 2]
                                 .view(torch.int16).view(T, K))
        self.T_max, self.D, self.K = T, D, K
        self.barrier_timeout_ms = max(1, int(barrier_timeout_s * 1000))

    def barrier(self, channel: int = 0) -> None:
        """Device-side barrier over the EP group, ordered on the current stream (no host sync);
        bounded by the context's Config.wait_timeout_s."""
        self.handle.barrier(channel=channel, timeout_ms=self.barrier_timeout_ms)

    def gather_routing(self, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids_all [EP, T, K] int16, T_all [EP] int32, schedule words [EP] int32) read from
        every rank's header."""
        ids = torch.stack([p[:T] for p in self.peer_ids])
        header = torch.stack(self.peer_header)
        return ids, header[:, 0], header[:, 1]

    def close(self) -> None:
        # NOTE: drop every view now: freeing symmetric memory later (from the cyclic garbage
        # collector) could land inside another context's CUDA-graph capture and abort it.
        self.peer_header.clear()
        self.peer_ids.clear()
        self.header = self.ids_TK = self.dispatch = self.combine = None
        self.scores_TK = self.score_parts = None
        self.handle = None
        self.buf = None

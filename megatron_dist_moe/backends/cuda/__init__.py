"""CUDA backend: peer-memory dispatch, grouped expert GEMMs, owner-side combine (Hopper sm_90).

Forward, per call (one CUDA stream, no host synchronisation):
    1. publish T, int16 IDs and x into this rank's symmetric routing/dispatch regions
    2. device barrier; read every rank's IDs; build expert-major peer address tables
    3. training: planner decision for this layer; x_g and h1 are then written straight into
       the selected activation slot (full save) or into scratch (replay), addresses chosen on
       the device
    4. expert MLP on the received rows (gather -> W13 -> SwiGLU -> W2 -> scatter to owners)
    5. device barrier; owner applies scores and sums the K routes in fp32
    6. training: keep x (replay) or the route outputs (full save) in the slot; device-predicated
       row counts (0 for what is not kept)
Backward mirrors it (guide §05), replaying the forward under a device predicate when the planner
chose recompute. The expert-MLP step is delegated to the context's expert pipeline
(the experts/ package: one module per precision), chosen by its Execution.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ...execution import Execution
from ...kernels import rows as K_rows
from ...memory_plan import ROUTING_HEADER_BYTES
from ...planner import LayerRecord
from .arena import make_arena
from .bookkeeping import make_bookkeeping
from .experts import make_expert_pipeline
from .routing import FanoutTable, RoutingTables, build_routing_tables
from .symmetric import SymmetricBuffers

__all__ = ["CudaBackend"]


@dataclass
class _Saved:
    record: LayerRecord
    rec_vec: torch.Tensor | None
    tables: RoutingTables
    ids_TK: torch.Tensor
    scores_TK: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    T: int
    prepared: object = None            # what the pipeline made of the weights (fp8: Fp8Weights)
    wgrad_into: tuple | None = None    # see reference._Saved


class CudaBackend:
    name = "cuda"
    supported_dtypes = (torch.bfloat16,)

    def __init__(self, ctx, execution: Execution):
        cfg = ctx.config
        self.ctx = ctx
        self.cfg = cfg
        self.execution = execution
        if execution.fp8_combine == "pull" and ctx.ep_size != 1:
            raise ValueError(f"fp8_combine='pull' runs at EP = 1 only (this group has "
                             f"{ctx.ep_size} ranks)")
        dev = ctx.device
        # (a CPU device only in the CPU tests of this orchestration: Triton interpreter, torch
        # GEMM engine, a single-rank stand-in for symmetric memory)
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            if dev.type == "cuda" and ctx.ep_size > 1:
                from .peers import check_peer_access
                check_peer_access(ctx.group, dev)
            self.sym = SymmetricBuffers(ctx.plan, ctx.group, dev,
                                        barrier_timeout_s=execution.wait_timeout_s)
            self.arena = make_arena(ctx.plan, dev)
            self.act_base = torch.tensor([self.arena.base], dtype=torch.int64, device=dev)
            self.arena_end = torch.tensor([self.arena.base + self.arena.nbytes],
                                          dtype=torch.int64, device=dev)
            self.max_rows = ctx.plan.total_scratch_rows
            self._wgrad_table_cache: dict[tuple, tuple] = {}
            self.experts = make_expert_pipeline(cfg, execution, ctx.num_local_experts,
                                                self.max_rows, dev, ctx.rank)
            assert self.experts.score_parts <= ctx.plan.score_parts, (
                f"the W2 DGRAD writes {self.experts.score_parts} score-gradient parts per route, "
                f"the plan has {ctx.plan.score_parts} slots")
            self.route_ws = None
            if execution.routing == "triton":
                from ...kernels.routing import RouteWorkspace
                self.route_ws = RouteWorkspace(self.sym.ep_size, cfg.num_local_input_tokens,
                                               cfg.top_k, ctx.num_local_experts, dev)
            # Config.save_route_outputs=False: per received row, the address of its route's score
            # in the owner's routing region (built in each backward from the combine table)
            self.score_ptrs = self.gy_ptrs = None
            if not cfg.inference and not cfg.save_route_outputs:
                self.score_ptrs = torch.zeros(max(1, self.max_rows), dtype=torch.int64,
                                              device=dev)
                self.gy_ptrs = torch.zeros_like(self.score_ptrs)
            self.p_dispatch = K_rows.device_ptr(self.sym.dispatch)
            self.p_combine = K_rows.device_ptr(self.sym.combine)
            self.bk = make_bookkeeping(execution.bookkeeping, ctx.plan, ctx.planner, ctx.rank,
                                       self.act_base, self.arena_end, self.p_combine,
                                       ctx.num_local_experts)
            # Tests and benchmarks may set a list here: each training forward appends its 0-d
            # need_recompute tensor (graph outputs stay live, so replays update them).
            self.decision_trace: list[torch.Tensor] | None = None
            # Make sure every rank's buffers exist before any peer access.
            torch.distributed.barrier(group=ctx.group)

    # -- helpers ----------------------------------------------------------------------------
    def check_collective(self, x_TD: torch.Tensor, local_error=None, training=None) -> None:
        # Equal T and the schedule word (training or not, the selected slot and its planned layer
        # count) across ranks are checked on the device (routing header), without a host sync.
        # A rank whose own validation failed still meets its peers at the call's first device
        # barrier, with T = -1 in its routing header: their routing check traps, naming this
        # rank (CHECK_PEER_REJECTED), instead of waiting at the barrier for ever; this rank then
        # raises its own error (ops.routed_experts). The peers' contexts are gone after the trap:
        # the job stops with both messages. Agreeing on the host instead would cost a sync on
        # every call.
        if local_error is not None:
            self.sym.header.fill_(-1)
            self.sym.barrier(0)

    def _publish(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, training: bool) -> None:
        """T, the schedule word, the IDs and the token rows where the peers read them, in one
        launch. The schedule word (a training forward's selected slot and planned layer count,
        else -1) is compared across ranks by the routing check: ranks whose planners were told
        different things would take different save / replay decisions, and a backward would
        replay on one rank from rows its peer never republished."""
        publish = getattr(self.experts, "publish", None)
        args = (x_TD.contiguous(), ids_TK.contiguous(), self.sym.header, self.sym.ids_TK,
                self.sym.dispatch)
        sched = None
        if training:
            sched = (self.ctx.planner.selected,
                     self.cfg.max_moe_layers_per_activation_slot + 1)
        if publish is not None:       # the precision's own row form (nvfp4: quantized rows)
            publish(*args, sched=sched)
        else:
            K_rows.publish_tokens(*args, sched=sched)

    def _routing(self, T: int, scores_TK: torch.Tensor | None) -> RoutingTables:
        fanout = self.experts.uses_fanout   # the fan-out table only where the gathers use it
        if self.route_ws is not None:
            from ...kernels.routing import route_tables
            offs, nrows, rows_EP, fwd, comb, disp, _status, *fan = route_tables(
                self.route_ws, self.sym.routing_base_EP, T, self.cfg.top_k, self.ctx.rank,
                self.cfg.num_experts, self.max_rows, self.sym.dispatch_base_EP,
                self.sym.combine_base_EP, row_bytes=self.cfg.hidden_dim * 2,
                own_scores_TK=scores_TK, header_bytes=ROUTING_HEADER_BYTES, fanout=fanout)
            return RoutingTables(
                expert_offsets=offs, num_rows=nrows, rows_EP=rows_EP, fwd_gather_ptrs=fwd,
                combine_ptrs=comb, dispatch_route_ptrs=disp, max_rows=self.max_rows,
                fanout=FanoutTable(fan[0], T, self.cfg.top_k, self.sym.dispatch_base_EP,
                                   self.sym.combine_base_EP) if fanout else None)
        ids_all, T_all, sched_all = self.sym.gather_routing(T)
        return build_routing_tables(
            ids_all, T_all, T, self.ctx.rank, self.ctx.num_local_experts, self.cfg.num_experts,
            self.max_rows, self.sym.dispatch_base_EP, self.sym.combine_base_EP,
            row_bytes=self.cfg.hidden_dim * 2, own_scores_TK=scores_TK, fanout=fanout,
            sched_all_EP=sched_all)

    def _routes_view(self, buf: torch.Tensor, T: int) -> torch.Tensor:
        K, D = self.cfg.top_k, self.cfg.hidden_dim
        return buf[: T * K * D].view(T, K, D)

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x_TD, ids_TK, scores_TK, w13_E2FD, w2_EDF, training: bool,
                weight_cache: bool | None = None):
        T = x_TD.shape[0]
        D = self.cfg.hidden_dim
        self._publish(x_TD, ids_TK, training)
        self.sym.barrier(0)
        tabs = self._routing(T, scores_TK)
        # training: planner decision; x_g and h1 then go straight into the selected activation
        # slot (full save) or into scratch (replay), addresses chosen on the device
        fa = self.bk.forward(tabs, T, training)
        if training and self.decision_trace is not None:
            self.decision_trace.append(fa.record.need_recompute)
        # the quantized weights: this call's, or the context's cache entry (weight_cache.py;
        # an entry of a training context holds both orientations, for any later backward)
        prepared = self.ctx.weight_cache.resolve(
            w13_E2FD, w2_EDF, weight_cache, lambda into: self.experts.prepare(
                w13_E2FD, w2_EDF, not self.cfg.inference, into=into))
        if prepared is None:
            prepared = self.experts.prepare(w13_E2FD, w2_EDF, training)
        self.experts.forward(tabs, w13_E2FD, w2_EDF, tabs.combine_ptrs, fa.at, prepared=prepared,
                             training=training)
        self.sym.barrier(1)
        y_TD = torch.empty_like(x_TD)
        routes = self._routes_view(self.sym.combine, T)
        # where the route outputs are: the combine buffer, or (fp8_combine='pull') the expert
        # GEMM's dense rows
        source = getattr(self.experts, "combine_source", None)
        pull = source(tabs, fa.at) if source is not None else None
        if not training:
            K_rows.combine_routes(routes, ids_TK, scores_TK, y_TD, pull=pull)
            return y_TD, None
        # Keep the route outputs for the score gradients (full save; stored by the combine
        # kernel as it reads them; not with save_route_outputs=False) or the input x (replay);
        # both device-predicated.
        keep_routes = self.cfg.save_route_outputs
        K_rows.combine_routes(routes, ids_TK, scores_TK, y_TD,
                              save_addr=fa.routes_save if keep_routes else None,
                              save_flag=fa.save_flag if keep_routes else None, pull=pull)
        K_rows.copy_rows(K_rows.device_ptr(x_TD), fa.x_slot, fa.x_rows, D, T)
        return y_TD, _Saved(fa.record, fa.rec_vec, tabs, ids_TK, scores_TK, w13_E2FD, w2_EDF, T,
                            prepared)

    # -- backward ---------------------------------------------------------------------------
    def _wgrad_tables(self, wgrad_into):
        """(w13 table, w2 table) of ExpertOutTable for routed_experts(wgrad_into=...), cached by
        the tensors' addresses (Megatron's main_grad buffers never move); None without."""
        if wgrad_into is None:
            return None
        from ...kernels.grouped_gemm import ExpertOutTable
        key = tuple(t.data_ptr() for accs in wgrad_into for t in accs)
        tables = self._wgrad_table_cache.get(key)
        if tables is None:
            F, D = self.cfg.intermediate_dim, self.cfg.hidden_dim
            tables = (ExpertOutTable.of([t.view(2 * F, D) for t in wgrad_into[0]], "wgrad_into"),
                      ExpertOutTable.of(wgrad_into[1], "wgrad_into"))
            if len(self._wgrad_table_cache) >= 64:   # bounded: e.g. tensors allocated per step
                self._wgrad_table_cache.clear()
            self._wgrad_table_cache[key] = tables
        return tables

    def backward(self, grad_y_TD, saved: _Saved):
        cfg = self.cfg
        D, K = cfg.hidden_dim, cfg.top_k
        T = saved.T
        tabs = saved.tables
        ba = self.bk.backward(saved.record, saved.rec_vec, tabs, T)   # rewinds the slot first

        keep_routes = cfg.save_route_outputs
        # Replay (device-predicated): republish x from the slot and rerun the forward experts,
        # rebuilding x_g / h1 in scratch and (save_route_outputs) the route outputs in the
        # owners' combine buffers; without saved route outputs the W2 GEMM is not replayed.
        K_rows.copy_rows(ba.x_slot, self.p_dispatch, ba.x_rows, D, T)
        self.sym.barrier(0)
        self.experts.forward(tabs, saved.w13, saved.w2,
                             tabs.combine_ptrs if keep_routes else None, ba.at,
                             rows=(ba.replay_offsets, ba.replay_rows), prepared=saved.prepared)
        grad_scores = torch.empty(T, K, dtype=torch.float32, device=grad_y_TD.device)
        if keep_routes:
            self.sym.barrier(1)
            # Owner: score gradients from the route outputs (kept in the slot, or just replayed
            # into combine) and route output gradients written into combine.
            K_rows.publish_grad_routes(grad_y_TD, ba.routes_read, saved.ids_TK, saved.scores_TK,
                                       self._routes_view(self.sym.combine, T), grad_scores)
        else:
            # Owner: grad_y once per token (unscaled) at the start of combine, its scores where
            # the experts read them, zeroed score-gradient sums; the experts compute the score
            # gradients. (No barrier after the replay: it wrote no peer memory, and barrier 2
            # orders the rest.)
            K_rows.publish_grad_y(grad_y_TD, saved.scores_TK,
                                  self.sym.combine[: T * D].view(T, D), self.sym.scores_TK[:T])
            plan = self.ctx.plan
            K_rows.route_score_ptrs(tabs.combine_ptrs, tabs.num_rows, self.sym.combine_base_EP,
                                    plan.combine_bytes, self.sym.routing_base_EP,
                                    plan.route_scores_offset, D * 2, K, self.score_ptrs,
                                    self.gy_ptrs)
        self.sym.barrier(2)
        grad_w13, grad_w2 = self.experts.backward(
            tabs, saved.w13, saved.w2,
            gather_ptrs=tabs.combine_ptrs if keep_routes else self.gy_ptrs,
            scatter_ptrs=tabs.dispatch_route_ptrs, ba=ba,
            wgrad_dtype=cfg.wgrad_dtype, wgrad_into=self._wgrad_tables(saved.wgrad_into),
            score_ptrs=None if keep_routes else self.score_ptrs,
            score_grad_delta=self.ctx.plan.route_score_grads_delta,
            part_stride=self.ctx.plan.score_part_stride, prepared=saved.prepared)
        self.sym.barrier(3)
        if not keep_routes:
            K_rows.sum_score_parts(self.sym.score_parts, self.experts.score_parts, saved.ids_TK,
                                   grad_scores)
        grad_x = torch.empty(T, D, dtype=grad_y_TD.dtype, device=grad_y_TD.device)
        source = getattr(self.experts, "grad_source", None)
        K_rows.reduce_routes(self._routes_view(self.sym.dispatch, T), saved.ids_TK, grad_x,
                             pull=source(tabs, ba.at) if source is not None else None)
        return grad_x, grad_scores, grad_w13, grad_w2

    def reset(self) -> None:
        return None

    def close(self) -> None:
        import gc

        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        self.experts = None
        self._wgrad_table_cache.clear()
        self.arena.close()
        self.arena = self.act_base = self.p_dispatch = self.p_combine = None
        self.sym.close()
        self.ctx = None          # break the Context <-> backend cycle
        gc.collect()

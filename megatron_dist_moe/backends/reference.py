"""ReferenceBackend: routed_experts in plain PyTorch + torch.distributed, on any device.

It is the oracle for the CUDA backend and the backend CI runs (gloo on CPU, NCCL on GPU). Clarity
beats speed here, but nothing is simplified away: rows travel between ranks through
`all_to_all_single`, the save/recompute planner takes the same decisions as on the GPU, and every
saved tensor is a view into a real byte arena laid out by the memory plan.

Data flow of one call (EP ranks, this rank = r):

    1. all-gather expert IDs -> ids_all [EP, T, K]. Every rank derives every rank's received row
       count rows_EP from it, so overflow and save/replay decisions agree on all ranks.
    2. dispatch: each source sends x[t] once per route (t, k) to the expert's owner; the owner
       orders the received rows expert-major (local expert, source rank, t, k) -> x_g [R, D].
    3. experts: h1 = round(x_g @ W13^T); h2 = round(act(h1)); h3 = round(h2 @ W2^T), with operands
       in the storage dtype and fp32 accumulation (fp64 when x is fp64).
    4. combine: h3 rows return to their token owners -> routes h3 [T, K, D] (zero on inactive
       routes); y = round(sum_k score[t, k] * h3[t, k]) summed in fp32.

Backward mirrors it: grad_h3 = round(score * grad_y) is dispatched like x, W2 DGRAD/WGRAD, SwiGLU
backward from h1, W13 DGRAD/WGRAD, and the route input gradients return to the token owners, who
sum the K routes in fp32. grad_scores[t, k] = <grad_y[t], h3[t, k]> in fp32.

Arena: one uint8 tensor holding the activation slots followed by the scratch region
(`plan.num_slots * plan.slot_bytes + plan.total_scratch_bytes`: the device scratch plus the part
the CUDA backend would back with pinned host pages). Each call's scratch tensors are views at the
offsets of the one per-call layout (layout.py), anchored at the arena end as on the GPU. The
plan counts bf16 bytes; for fp32 / fp64 inputs (oracle tests) the backend keeps a second arena
whose every offset is scaled by itemsize / 2, so the byte layout is the same in units of
elements.

Weight gradients are accumulated in fp32 (fp64 for fp64 inputs), rounded to Config.wgrad_dtype
and returned in the parameter's dtype: autograd casts a gradient to its input's dtype anyway, so
wgrad_dtype="fp32" with bf16 weights yields fp32-accumulated gradients rounded once to bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ARG_NAMES, RoutedExpertsInputError
from ..layout import call_layout
from ..routing import expert_major_order, owner_ranks, rows_per_rank
from ..planner import LayerRecord, plan_backward, plan_forward, saved_layout
from .reference_math import make_math

__all__ = ["ReferenceBackend"]


def _schedule_word(ctx) -> int:
    """The selected activation slot and its planned layer count as one int (the planner's
    device selection, read on the host: the reference backend syncs anyway)."""
    slot, layers = (int(v) for v in ctx.planner.selected.tolist())
    return slot * (ctx.config.max_moe_layers_per_activation_slot + 1) + layers


def _describe_schedule(word: int, max_layers: int) -> str:
    if word < 0:
        return "no training forward"
    return f"training, slot {word // (max_layers + 1)} for {word % (max_layers + 1)} layer(s)"


# -- routing of one call -----------------------------------------------------------------------
@dataclass
class _Routes:
    """Who sends which route rows where, for one call (host-side lists are fine here)."""

    T: int
    rows_EP: torch.Tensor          # [EP] int64: routed rows each rank receives
    send_flat_idx: torch.Tensor    # [S] int64: this rank's active routes t*K+k, by owner rank
    send_counts: list[int]         # [EP] rows this rank sends to each owner
    recv_counts: list[int]         # [EP] rows this rank receives from each source
    em_order: torch.Tensor         # [R] int64: received-row index of each expert-major row
    expert_counts: list[int]       # [E_local] rows per local expert (expert-major segments)

    @property
    def rows(self) -> int:
        return len(self.em_order)


@dataclass
class _Saved:
    """What a training forward keeps for its backward (besides the arena bytes)."""

    record: LayerRecord
    routes: _Routes
    scores_TK: torch.Tensor
    w13_END: torch.Tensor
    w2_EDF: torch.Tensor
    dtype: torch.dtype
    # routed_experts(wgrad_into=...): (w13 list, w2 list) of fp32 tensors the weight gradients
    # are added into (set by library.routed_experts_fwd)
    wgrad_into: tuple | None = None


class ReferenceBackend:
    """Pure-PyTorch backend over torch.distributed; see the module docstring."""

    name = "reference"

    def __init__(self, ctx):
        self.ctx = ctx
        self.math = make_math(ctx.config, ctx.num_local_experts)
        # the bf16 math runs fp32 / fp64 inputs too (oracle tests); a quantized precision
        # quantizes bf16 values
        self.supported_dtypes = ((torch.bfloat16, torch.float32, torch.float64)
                                 if ctx.config.precision == "bf16" else (torch.bfloat16,))
        self.plan = ctx.plan
        self._arena_bytes = self.plan.scratch_offset + self.plan.total_scratch_bytes
        self._arenas: dict[int, torch.Tensor] = {}
        self._arena(torch.bfloat16)   # the bf16 arena is what the plan sizes: allocate up front

    # -- arena ----------------------------------------------------------------------------------
    def _arena(self, dtype: torch.dtype) -> torch.Tensor:
        scale = dtype.itemsize // 2
        if scale not in self._arenas:
            # NOTE: 0xFF bytes are NaN in bf16/fp32/fp64: a read of bytes nobody wrote shows up.
            self._arenas[scale] = torch.full((self._arena_bytes * scale,), 0xFF, dtype=torch.uint8,
                                             device=self.ctx.device)
        return self._arenas[scale]

    def _view(self, dtype: torch.dtype, offset: int, shape: tuple[int, ...],
              arena_dtype: torch.dtype | None = None) -> torch.Tensor:
        """A `dtype` view of `shape` at plan byte `offset` of the arena of `arena_dtype` (the
        call's input dtype, default `dtype`), whose offsets are in units of plan bytes (bf16)."""
        arena_dtype = arena_dtype or dtype
        scale = arena_dtype.itemsize // 2
        numel = 1
        for s in shape:
            numel *= s
        start = int(offset) * scale
        arena = self._arena(arena_dtype)
        assert start + numel * dtype.itemsize <= arena.numel(), "arena view out of range"
        return arena[start:start + numel * dtype.itemsize].view(dtype).view(shape)

    def _views(self, dtype: torch.dtype, mode: str, R: int, saved_at: dict | None = None):
        """views(name, shape, view_dtype=dtype): region `name` of this call's layout
        (layout.call_layout: the layout of R rows ends at the arena end, as on the GPU), or the
        slot offset of a saved region (saved_at, a full-save layer)."""
        cfg = self.ctx.config
        lay = call_layout(mode, R, cfg.hidden_dim, cfg.intermediate_dim, cfg.precision,
                          self.ctx.num_local_experts)
        assert lay.total <= self.plan.total_scratch_bytes, (
            f"the {mode} layout of {R} rows needs {lay.total:,} B, the plan holds "
            f"{self.plan.total_scratch_bytes:,} B of scratch")
        end = self._arena_bytes
        at = {r.name: end - lay.total + r.offset for r in lay.regions}
        at.update({k: int(v) for k, v in (saved_at or {}).items()})

        def views(name: str, shape, view_dtype: torch.dtype | None = None) -> torch.Tensor:
            return self._view(view_dtype or dtype, at[name], tuple(shape), arena_dtype=dtype)
        return views

    # -- collectives ----------------------------------------------------------------------------
    def check_collective(self, x_TD: torch.Tensor,
                         local_error: RoutedExpertsInputError | None = None,
                         training: bool | None = None) -> None:

        ctx = self.ctx
        bad = -1 if local_error is None else (
            ARG_NAMES.index(local_error.arg) if local_error.arg in ARG_NAMES else 0)
        T_local = x_TD.shape[0] if isinstance(x_TD, torch.Tensor) and x_TD.dim() >= 1 else -1
        # x's dtype too: rows of different widths would break the exchange itself
        dt = self.supported_dtypes.index(x_TD.dtype) if local_error is None else -1
        # the schedule: -1 for a call that keeps no state; for a training forward the selected
        # slot and its planned layer count. Ranks that differ would take different save /
        # replay decisions, and a backward would then replay on one rank only
        sched = _schedule_word(ctx) if training else -1
        t = torch.tensor([T_local, bad, dt, sched], dtype=torch.int64, device=ctx.device)
        got = [torch.empty_like(t) for _ in range(ctx.ep_size)]
        dist.all_gather(got, t, group=ctx.group)
        if local_error is not None:
            return       # the caller raises this rank's own error
        for r, v in enumerate(got):
            if int(v[1]) >= 0:
                arg = ARG_NAMES[int(v[1])]
                raise RoutedExpertsInputError(
                    arg, f"rank {r} of the EP group rejected its {arg!r} argument, so this "
                    "collective call is abandoned on every rank; nothing was written")
        Ts = [int(v[0]) for v in got]
        if len(set(Ts)) > 1:
            raise RoutedExpertsInputError(
                "x", f"every rank must pass the same number of rows T (pad with all-inactive "
                f"rows); this is rank {ctx.rank} with T={x_TD.shape[0]}, per-rank T = {Ts}")
        dtypes = [str(self.supported_dtypes[int(v[2])]) for v in got]
        if len(set(dtypes)) > 1:
            raise RoutedExpertsInputError(
                "x", f"every rank must pass x (and its weights) in the same dtype; this is rank "
                f"{ctx.rank} with {x_TD.dtype}, per-rank dtypes = {dtypes}")
        scheds = [int(v[3]) for v in got]
        if len(set(scheds)) > 1:
            L = ctx.config.max_moe_layers_per_activation_slot
            said = [_describe_schedule(s, L) for s in scheds]
            raise RoutedExpertsInputError(
                "ctx", f"every rank must make the same call: training forwards on every rank "
                "(or on none), each after the same ctx.select_activation_slot(slot, "
                f"num_moe_layers_in_slot); this is rank {ctx.rank}, per rank: {said}")

    def _exchange(self, rows: torch.Tensor, send_counts: list[int],
                  recv_counts: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv_counts), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=self.ctx.group)
        return out

    def _route(self, expert_ids_TK: torch.Tensor) -> _Routes:
        ctx = self.ctx
        EP, r, E_local = ctx.ep_size, ctx.rank, ctx.num_local_experts
        T, K = expert_ids_TK.shape
        ids = expert_ids_TK.to(torch.int64).contiguous()
        gathered = [torch.empty_like(ids) for _ in range(EP)]
        dist.all_gather(gathered, ids, group=ctx.group)
        ids_all = torch.stack(gathered).view(EP, T * K)
        ids_N = ids_all.reshape(-1)
        owner_all = owner_ranks(ids_N, E_local, ctx.config.num_experts).view(EP, T * K)
        rows_EP = rows_per_rank(ids_N, E_local, EP, ctx.config.num_experts)

        worst = int(rows_EP.max()) if EP else 0
        if worst > self.plan.total_scratch_rows:
            q = int(rows_EP.argmax())
            raise RoutedExpertsInputError(
                "expert_ids", f"rank {q} would receive {worst} routed rows but the scratch holds "
                f"{self.plan.total_scratch_rows} (balanced T*K={self.plan.balanced_rows}); raise "
                "Config.device_scratch_capacity_factor or host_scratch_capacity_factor")

        mine = owner_all[r]
        active = (mine >= 0).nonzero().view(-1)
        by_owner = torch.sort(mine[active], stable=True).indices
        send_flat_idx = active[by_owner]
        send_counts = torch.bincount(mine[active], minlength=EP).tolist()

        # rows arrive from each source in its route order: received positions n = src*T*K + t*K
        # + k, ascending; expert-major row i is the route at order[i] (routing.py)
        recv_mask = owner_all == r
        recv_pos = recv_mask.view(-1).nonzero().view(-1)
        order, offsets = expert_major_order(ids_N, r, E_local)
        R = int(offsets[-1])
        em_order = torch.searchsorted(recv_pos, order[:R])
        return _Routes(T=T, rows_EP=rows_EP, send_flat_idx=send_flat_idx, send_counts=send_counts,
                       recv_counts=recv_mask.sum(1).tolist(), em_order=em_order,
                       expert_counts=offsets.diff().tolist())

    def _dispatch(self, src_rows: torch.Tensor, routes: _Routes, out: torch.Tensor) -> None:
        """Send src_rows [S, D] (one per active route of this rank) to the experts' owners and
        write the received rows expert-major into out [R, D]."""
        recv = self._exchange(src_rows, routes.send_counts, routes.recv_counts)
        out.copy_(recv[routes.em_order])

    def _return(self, em_rows: torch.Tensor, routes: _Routes) -> torch.Tensor:
        """Send expert-major rows em_rows [R, D] back to their token owners; returns [S, D] in
        the order of routes.send_flat_idx."""
        back = torch.empty_like(em_rows)
        back[routes.em_order] = em_rows
        return self._exchange(back, routes.recv_counts, routes.send_counts)

    # -- expert math ----------------------------------------------------------------------------
    @staticmethod
    def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if dtype == torch.bfloat16 else dtype

    def _segments(self, routes: _Routes):
        a = 0
        for e, n in enumerate(routes.expert_counts):
            yield e, a, a + n
            a += n

    def _replay(self, x_TD, w13_END, w2_EDF, routes: _Routes, views,
                routes_TKD: torch.Tensor | None, training: bool) -> None:
        """The forward up to the combine: dispatch into x_g, the expert math into the layout's
        regions, and routes_TKD [T, K, D] (None: stop before the W2 GEMM, as a backward replay
        without saved route outputs does)."""
        K, D = self.ctx.config.top_k, self.ctx.config.hidden_dim
        source_rows = getattr(self.math, "source_rows", None)
        if source_rows is None:           # the rows themselves
            x_g = views("x_g", (routes.rows, D))
            self._dispatch(x_TD[routes.send_flat_idx // K], routes, x_g)
        else:                             # what the source rank publishes (nvfp4: byte rows)
            rows_T = source_rows(x_TD)
            x_g = views("x_g", (routes.rows, rows_T.shape[1]), rows_T.dtype)
            self._dispatch(rows_T[routes.send_flat_idx // K], routes, x_g)
        h3 = self.math.forward(views, x_g, w13_END, w2_EDF, self._segments(routes),
                               with_w2=routes_TKD is not None, training=training)
        if routes_TKD is None:
            return
        flat = routes_TKD.view(-1, routes_TKD.shape[-1])
        flat.zero_()     # inactive routes hold exact zeros, never stale bytes
        flat[routes.send_flat_idx] = self._return(h3, routes)

    # -- Backend API ----------------------------------------------------------------------------
    def _cached_weights(self, w13_END, w2_EDF, mode):
        """The weights a call quantizes: its own, or (is_first_microbatch) the bf16 snapshot the
        last True call took for these tensors, which the math quantizes as the CUDA backend's
        cached copies were quantized (bit-exact twins: the same bits)."""
        def make(entry):
            if entry is None:
                return w13_END.detach().clone(), w2_EDF.detach().clone()
            entry[0].copy_(w13_END)
            entry[1].copy_(w2_EDF)
            return entry
        entry = self.ctx.weight_cache.resolve(w13_END, w2_EDF, mode, make)
        return (w13_END, w2_EDF) if entry is None else entry

    def forward(self, x_TD, expert_ids_TK, scores_TK, w13_END, w2_EDF, training: bool,
                weight_cache: bool | None = None):
        ctx, plan, cfg = self.ctx, self.plan, self.ctx.config
        if training and cfg.inference:
            raise RuntimeError("routed_experts: this context has Config.inference=True and keeps "
                               "no state for backward; call it under torch.no_grad() or create "
                               "the context with inference=False")
        T, D, K = x_TD.shape[0], cfg.hidden_dim, cfg.top_k
        dtype = x_TD.dtype
        routes = self._route(expert_ids_TK)          # raises on overflow, before any write
        R = routes.rows
        saved_at = None
        record = None
        if training:
            planner = ctx.planner
            slot = int(planner.selected[0])
            pos, planned = int(planner.layer_position[slot]), int(planner.selected[1])
            if pos >= planned:
                raise RuntimeError(
                    f"routed_experts: activation slot {slot} already holds {pos} layer(s), the "
                    f"number it was selected for; call ctx.select_activation_slot(slot, n) with "
                    f"n <= max_moe_layers_per_activation_slot="
                    f"{cfg.max_moe_layers_per_activation_slot} before each group of layer "
                    "forwards, and run their backwards before reusing the slot")
            record = plan_forward(planner, routes.rows_EP, ctx.rank, plan)
            added = int(planner.buffer_offsets[slot]) - int(record.start)
            assert int(record.start) + added <= plan.slot_base(slot) + plan.slot_bytes, \
                "planner placed saved state past the slot end"
            if bool(record.need_recompute):
                self._view(dtype, int(record.start), (T, D)).copy_(x_TD)
                routes_TKD = torch.empty(T, K, D, dtype=dtype, device=x_TD.device)
            else:
                lay = saved_layout(record, routes.rows_EP[ctx.rank], plan)
                saved_at = lay.regions
                routes_TKD = (self._view(dtype, int(lay.routes), (T, K, D))
                              if cfg.save_route_outputs else
                              torch.empty(T, K, D, dtype=dtype, device=x_TD.device))
        else:
            routes_TKD = torch.empty(T, K, D, dtype=dtype, device=x_TD.device)

        views = self._views(dtype, "train_forward" if training else "inference", R, saved_at)
        w13_END, w2_EDF = self._cached_weights(w13_END, w2_EDF, weight_cache)
        self._replay(x_TD, w13_END, w2_EDF, routes, views, routes_TKD, training)
        acc = self._acc_dtype(dtype)
        y_TD = (scores_TK.to(acc).unsqueeze(-1) * routes_TKD.to(acc)).sum(dim=1).to(dtype)
        if not training:
            return y_TD, None
        saved = _Saved(record=record, routes=routes, scores_TK=scores_TK.detach().clone(),
                       w13_END=w13_END.detach(), w2_EDF=w2_EDF.detach(), dtype=dtype)
        return y_TD, saved

    def backward(self, grad_y_TD, saved: _Saved):
        ctx, plan, cfg = self.ctx, self.plan, self.ctx.config
        record, routes, dtype = saved.record, saved.routes, saved.dtype
        plan_backward(ctx.planner, record)           # rewind first: backward runs in reverse
        T, K, D, R = routes.T, cfg.top_k, cfg.hidden_dim, routes.rows
        acc = self._acc_dtype(dtype)
        w13, w2 = saved.w13_END, saved.w2_EDF
        replay = bool(record.need_recompute)
        keep_routes = cfg.save_route_outputs
        if replay:
            views = self._views(dtype, "replay", R)
            x_TD = self._view(dtype, int(record.start), (T, D))
            routes_TKD = (torch.empty(T, K, D, dtype=dtype, device=grad_y_TD.device)
                          if keep_routes else None)
            self._replay(x_TD, w13, w2, routes, views, routes_TKD, training=True)
        else:
            lay = saved_layout(record, routes.rows_EP[ctx.rank], plan)
            views = self._views(dtype, "backward", R, lay.regions)
            routes_TKD = self._view(dtype, int(lay.routes), (T, K, D)) if keep_routes else None
        g3 = views("g3", (R, D))
        gy = grad_y_TD.to(acc)
        s_rows = None
        if keep_routes:
            # token owner: score gradients from the saved route outputs, and s * grad_y per route
            grad_scores_TK = (gy.unsqueeze(1) * routes_TKD.to(acc)).sum(dim=-1)
            grad_h3 = (saved.scores_TK.to(acc).unsqueeze(-1) * gy.unsqueeze(1)).to(dtype)
            self._dispatch(grad_h3.view(T * K, D)[routes.send_flat_idx], routes, g3)
        else:
            # token owner sends grad_y (unscaled) and the score of each route; the expert side
            # computes u = W2^T grad_y, grad_s = <u, h2>, grad_h2 = s u and the W2 WGRAD from
            # (grad_y, s h2), and returns grad_s per route
            self._dispatch(grad_y_TD[routes.send_flat_idx // K], routes, g3)
            s_rows = torch.empty(R, 1, dtype=acc, device=grad_y_TD.device)
            self._dispatch(saved.scores_TK.to(acc).reshape(-1, 1)[routes.send_flat_idx],
                           routes, s_rows)
        # expert owner: the expert MLP's backward; route input gradients go back to the owners
        grad_xg, grad_w13, grad_w2, grad_s_rows = self.math.backward(
            views, g3, s_rows, w13, w2, self._segments(routes))
        if not keep_routes:
            grad_scores_TK = torch.zeros(T * K, dtype=acc, device=grad_y_TD.device)
            grad_scores_TK[routes.send_flat_idx] = self._return(
                grad_s_rows.to(acc), routes).view(-1)
            grad_scores_TK = grad_scores_TK.view(T, K)
        grad_routes = torch.zeros(T * K, D, dtype=acc, device=grad_y_TD.device)
        grad_routes[routes.send_flat_idx] = self._return(grad_xg, routes).to(acc)
        grad_x_TD = grad_routes.view(T, K, D).sum(dim=1).to(dtype)

        if saved.wgrad_into is not None:
            # the fp32 sums (wgrad_dtype="fp32", checked in ops) added into the caller's tensors
            for accs, g in zip(saved.wgrad_into, (grad_w13, grad_w2)):
                for e, acc_e in enumerate(accs):
                    acc_e.view(g.shape[1:]).add_(g[e].to(acc_e.dtype))
            return grad_x_TD, grad_scores_TK, None, None

        def wgrad(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            if cfg.wgrad_dtype == "bf16":
                g = g.to(torch.bfloat16)
            return g.to(w.dtype)

        return grad_x_TD, grad_scores_TK, wgrad(grad_w13, w13), wgrad(grad_w2, w2)

    def reset(self) -> None:
        """Nothing to rewind beyond the planner state (Context.reset does that)."""

    def close(self) -> None:
        self._arenas.clear()

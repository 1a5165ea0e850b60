"""DistMoELayer: Megatron-Core's MoELayer with dispatcher + experts replaced by routed_experts().

What is kept from Megatron:
    * the router (TopKRouter from the spec: scores, aux losses, expert bias, z-loss, logging);
    * the shared experts (SharedExpertMLP, not overlapped);
    * the expert weights, owned per local expert exactly as SequentialMLP owns them
      (`experts.local_experts.{i}.linear_fc1.weight` [2F, D] = [gate; up] and
      `experts.local_experts.{i}.linear_fc2.weight` [D, F]) so that state dicts, distributed
      checkpoints (interchangeable with TEGroupedMLP's, per Megatron) and optimizer states load
      and save unchanged, and DDP sees expert-parallel parameters with Megatron's attributes.

What changes: forward turns the router's (probs [T, E], routing_map [T, E]) into top-k
(expert_ids [T, K], scores [T, K]), takes the per-expert weights as w13 [E_local, 2F, D] and
w2 [E_local, D, F] and calls `megatron_dist_moe.routed_experts` on the EP group. DistMoEExperts
packs each layer's fc1 and fc2 weights into one storage each, so w13 and w2 are views of the
parameters; only where Megatron's distributed optimizer has moved the parameters into its own
buffer does a forward copy them (see _StackExpertWeights, also for where the weight gradients
go).

`isinstance(layer, MoELayer)` holds, so TransformerLayer treats it as an MoE layer (pre-MLP
layernorm, recompute decisions, aux-loss plumbing).
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import BaseMoELayer, MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import (
    MoECudaGraphTensorStore,
    get_default_pg_collection,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_size

import megatron_dist_moe as dm

from .config_map import (
    DistMoEOptions,
    check_supported,
    dist_moe_config,
    megatron_args_or_none,
    options_from_args,
    tokens_per_rank_from_args,
)
from .runtime import get_runtime

logger = logging.getLogger(__name__)

__all__ = ["DistMoELayer", "DistMoEExperts", "routing_map_to_topk", "stack_expert_weights",
           "main_grad_accumulators", "pack_expert_weights", "packed_expert_view"]


def routing_map_to_topk(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, top_k: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k form of Megatron's router output.

    Args:
        probs_TE:       [T, E] float, non-zero only where routed (TopKRouter scatters the top-k).
        routing_map_TE: [T, E] bool, True on the routed experts (at most top_k per row).
        top_k:          K.

    Returns:
        expert_ids_TK [T, K] int64 (global IDs; -1 where a row has fewer than K routes) and
        scores_TK [T, K] fp32 (probs at those IDs, 0 on inactive routes; differentiable).
    """
    # topk on a 0/1 map finds the routed columns in any order; the order of routes does not
    # change the score-weighted sum.
    ids_TK = routing_map_TE.to(torch.int8).topk(top_k, dim=-1, sorted=False).indices
    active_TK = routing_map_TE.gather(1, ids_TK)
    scores_TK = probs_TE.gather(1, ids_TK).float()
    scores_TK = torch.where(active_TK, scores_TK, torch.zeros_like(scores_TK))
    ids_TK = torch.where(active_TK, ids_TK, torch.full_like(ids_TK, -1))
    return ids_TK, scores_TK


def packed_expert_view(weights: list[torch.Tensor] | tuple[torch.Tensor, ...]
                       ) -> Optional[torch.Tensor]:
    """[E, *shape] view of the weights' own memory when they lie back to back in one storage
    (as DistMoEExperts packs them), else None.

    stack_expert_weights records the weights' versions when it returns this view: an in-place
    update of any weight between that forward and its backward raises an error there instead
    of leaving gradients computed from two different weights.
    """
    if torch.compiler.is_compiling():   # fake tensors have no addresses; torch.stack traces
        return None
    w0 = weights[0]
    n = w0.numel()
    if n == 0 or not w0.is_contiguous() or w0.data_ptr() % 16:
        return None
    base_ptr = w0.untyped_storage().data_ptr()
    for i, w in enumerate(weights):
        if (w.shape != w0.shape or w.dtype != w0.dtype or w.device != w0.device
                or not w.is_contiguous() or w.untyped_storage().data_ptr() != base_ptr
                or w.storage_offset() != w0.storage_offset() + i * n):
            return None
    return w0.detach().as_strided((len(weights), *w0.shape), (n, *w0.stride()),
                                  w0.storage_offset())


class _StackExpertWeights(torch.autograd.Function):
    """[W_0, ..., W_{E-1}] -> stacked [E, ...]; backward routes each slice to its owner.

    Forward is free when the weights are packed (`packed_expert_view`: DistMoEExperts keeps
    them so unless Megatron's distributed optimizer moves them into its own buffer); otherwise
    it copies them (torch.stack).

    With Megatron's gradient_accumulation_fusion the slice is added straight into
    `param.main_grad` (fp32) and a dummy gradient is returned with `grad_added_to_main_grad`
    set, exactly as Megatron's own linear layers do, so DDP's hook skips the second add.
    Otherwise the slice becomes the plain `.grad` (a view of the stacked gradient, no copy).
    """

    @staticmethod
    def forward(fctx, fuse_into_main_grad: bool, grads_accumulated: bool,
                *weights: torch.Tensor) -> torch.Tensor:
        fctx.weights = weights
        fctx.fuse = fuse_into_main_grad
        fctx.accumulated = grads_accumulated
        packed = packed_expert_view(weights)
        # the forward read the weights in place: backward checks that they are unchanged
        fctx.versions = [w._version for w in weights] if packed is not None else None
        return packed if packed is not None else torch.stack([w.detach() for w in weights])

    @staticmethod
    def backward(fctx, grad_stacked: torch.Tensor):
        if fctx.versions is not None:
            for i, (w, v) in enumerate(zip(fctx.weights, fctx.versions)):
                if w._version != v:
                    raise RuntimeError(
                        f"expert weight {i} (shape {tuple(w.shape)}) was modified in place "
                        f"(version {v} -> {w._version}) between the forward that read it in "
                        "place and this backward; update the weights after backward")
        grads = []
        for w, g in zip(fctx.weights, grad_stacked.unbind(0)):
            if fctx.accumulated:
                # routed_experts(wgrad_into=main_grads) already added the fp32 sums into
                # main_grad; grad_stacked is zeros. Mark it as Megatron's fused layers do.
                w.grad_added_to_main_grad = True
                grads.append(torch.zeros_like(w) if getattr(w, "zero_out_wgrad", False)
                             else torch.empty_like(w))
            elif fctx.fuse and getattr(w, "main_grad", None) is not None and hasattr(
                    w, "grad_added_to_main_grad"):
                # bf16 g into fp32 main_grad: the add upcasts on the fly (exact), without the
                # fp32 temporary that g.to(fp32) would write and read back (2x main_grad's bytes)
                w.main_grad.add_(g)
                w.grad_added_to_main_grad = True
                # NOTE: DDP's hook re-adds .grad when zero_out_wgrad is set: keep that one zero.
                dummy = (torch.zeros_like(w) if getattr(w, "zero_out_wgrad", False)
                         else torch.empty_like(w))
                grads.append(dummy)
            else:
                grads.append(g)
        fctx.weights = None
        return (None, None, *grads)


def stack_expert_weights(weights: list[torch.Tensor], fuse_into_main_grad: bool = False,
                         grads_accumulated: bool = False) -> torch.Tensor:
    """torch.stack for parameters, with the gradient routing of _StackExpertWeights.
    grads_accumulated: the caller passed the weights' main_grad to routed_experts(wgrad_into=),
    so backward only marks grad_added_to_main_grad (the stacked gradient is zeros)."""
    return _StackExpertWeights.apply(fuse_into_main_grad, grads_accumulated, *weights)


def pack_expert_weights(weights: list[torch.Tensor]) -> bool:
    """Move same-shaped parameters into one [E, *shape] storage (each `.data` becomes a slice
    of it), so that `stack_expert_weights` is a view instead of a copy. The Parameter objects
    and their attributes are kept. Returns whether the weights are packed afterwards."""
    if packed_expert_view(weights) is not None:
        return True
    w0 = weights[0]
    if any(w.shape != w0.shape or w.dtype != w0.dtype or w.device != w0.device
           for w in weights) or w0.device.type == "meta":
        return False
    with torch.no_grad():
        packed = torch.stack([w.detach() for w in weights])
    for w, slice_ in zip(weights, packed.unbind(0)):
        w.data = slice_
    return packed_expert_view(weights) is not None


def main_grad_accumulators(weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The weights' fp32 `main_grad` buffers (Megatron DDP), when every weight has a contiguous,
    16-byte aligned one and the grad_added_to_main_grad flag; else None."""
    out = []
    for w in weights:
        mg = getattr(w, "main_grad", None)
        if (mg is None or not hasattr(w, "grad_added_to_main_grad")
                or mg.dtype != torch.float32 or mg.shape != w.shape or not mg.is_contiguous()
                or mg.data_ptr() % 16):
            return None
        out.append(mg)
    return out


class DistMoEExperts(SequentialMLP):
    """SequentialMLP's parameters and checkpoint layout, computed by routed_experts.

    Never run `forward` on it: the layer takes `stacked_weights()` and calls routed_experts.
    Loading also accepts TEGroupedMLP's plain (non-distributed) layout
    `linear_fc1.weight{i}` / `linear_fc2.weight{i}`.

    The fc1 weights of all local experts share one [E_local, 2F, D] storage and the fc2 weights
    one [E_local, D, F] storage (`pack_weights`; each parameter is a slice), so
    `stacked_weights()` costs nothing. Loading a state dict copies into the slices and keeps
    the packing; a dtype or device conversion packs again.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig, pg_collection=None,
                 name: str | None = None):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        # The expert linears are only parameter holders: their own forward (whose
        # gradient_accumulation_fusion needs APEX's fused wgrad kernel) never runs. The layer
        # reads the fusion flag from the real config.
        holder_config = copy.copy(config)
        holder_config.gradient_accumulation_fusion = False
        super().__init__(num_local_experts, holder_config,
                         MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                       linear_fc2=RowParallelLinear),
                         pg_collection=pg_collection, name=name)
        self._register_load_state_dict_pre_hook(_grouped_to_sequential_keys, with_module=True)
        self.pack_weights()

    def run_weight_pre_hooks(self) -> None:
        """Run the forward pre-hooks of the expert linears, whose own forward never runs.
        Megatron's DDP waits there for the parameter all-gather of --overlap-param-gather (and
        dispatches the next bucket's); skipping them would read weights that are still being
        gathered."""
        for e in self.local_experts:
            for m in (e.linear_fc1, e.linear_fc2):
                for hook_id, hook in tuple(m._forward_pre_hooks.items()):
                    if hook_id in m._forward_pre_hooks_with_kwargs:
                        hook(m, (), {})
                    else:
                        hook(m, ())

    def _fc_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return ([e.linear_fc1.weight for e in self.local_experts],
                [e.linear_fc2.weight for e in self.local_experts])

    def pack_weights(self) -> bool:
        """Pack the fc1 and the fc2 weights, each into one storage (`pack_expert_weights`), so
        that every forward takes them as views; True when both are packed."""
        return all([pack_expert_weights(ws) for ws in self._fc_weights()])

    def weights_packed(self) -> bool:
        """Whether a forward reads the weights in place (else it copies them, see
        _StackExpertWeights): False after Megatron's distributed optimizer moved them into its
        parameter buffer."""
        return all(packed_expert_view(ws) is not None for ws in self._fc_weights())

    def _apply(self, fn, recurse=True):
        # .cuda() / .to(dtype) / .bfloat16() give each converted parameter its own tensor:
        # pack them again. A conversion that kept every address (a no-op, or one that moved
        # the shared storage as a whole) leaves the layout alone, in particular a layout that
        # Megatron's distributed optimizer owns (its parameter buffer).
        before = [w.data_ptr() for ws in self._fc_weights() for w in ws]
        out = super()._apply(fn, recurse)
        if ([w.data_ptr() for ws in self._fc_weights() for w in ws] != before
                and not self.weights_packed()):
            self.pack_weights()
        return out

    def forward(self, *args, **kwargs):
        raise RuntimeError("DistMoEExperts holds weights only; DistMoELayer computes the experts "
                           "with megatron_dist_moe.routed_experts")

    def stacked_weights(self, fuse_into_main_grad: bool = False, grads_accumulated: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E_local, 2F, D], w2 [E_local, D, F]) differentiable w.r.t. every expert weight."""
        fc1, fc2 = self._fc_weights()
        return (stack_expert_weights(fc1, fuse_into_main_grad, grads_accumulated),
                stack_expert_weights(fc2, fuse_into_main_grad, grads_accumulated))

    def main_grad_accumulators(self) -> tuple[list, list] | None:
        """(fc1 main_grads, fc2 main_grads) for routed_experts(wgrad_into=...), or None when
        the weights have no fp32 main_grad (no Megatron DDP)."""
        fc1 = main_grad_accumulators([e.linear_fc1.weight for e in self.local_experts])
        fc2 = main_grad_accumulators([e.linear_fc2.weight for e in self.local_experts])
        return None if fc1 is None or fc2 is None else (fc1, fc2)


def _grouped_to_sequential_keys(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                unexpected_keys, error_msgs) -> None:
    """Rename TEGroupedMLP keys `{prefix}linear_fc{1,2}.weight{i}` to SequentialMLP's."""
    for fc in ("linear_fc1", "linear_fc2"):
        for i in range(module.num_local_experts):
            src = f"{prefix}{fc}.weight{i}"
            if src in state_dict:
                dst = f"{prefix}local_experts.{i}.{fc}"
                state_dict[f"{dst}.weight"] = state_dict.pop(src)
                # Megatron's linears keep an always-None extra state (ignored on load).
                state_dict.setdefault(f"{dst}._extra_state", None)
        # TE's fp8 metadata has no counterpart in a bf16 ColumnParallelLinear.
        state_dict.pop(f"{prefix}{fc}._extra_state", None)


class DistMoELayer(MoELayer):
    """MoELayer whose routed experts run through megatron_dist_moe.routed_experts.

    Built by the dist_moe spec (spec.py) or, after install(), by any MoE spec whose config has
    moe_token_dispatcher_type='dist_moe'. Unsupported settings raise UnsupportedMegatronConfig
    here, at model construction.

    Args (as MoELayer):
        config:        TransformerConfig (dist_moe requirements: see config_map.check_supported)
        submodules:    MoESubmodules; `router` and `shared_experts` are used, `experts` is
                       ignored (weights live in DistMoEExperts)
        layer_number, pg_collection, is_mtp_layer, name: as MoELayer
        options:       DistMoEOptions; default: install(options=...), else Megatron-LM's
                       --dist-moe-* flags / YAML `dist_moe:` section, else DistMoEOptions()
    """

    is_dist_moe_layer = True

    def __init__(self, config: TransformerConfig, submodules: Optional[MoESubmodules] = None,
                 layer_number: Optional[int] = None, pg_collection=None,
                 is_mtp_layer: bool = False, name: str | None = None,
                 options: DistMoEOptions | None = None):
        megatron_args = megatron_args_or_none()
        self.dist_moe_options = (options or get_runtime().options
                                 or options_from_args(megatron_args))
        check_supported(config, self.dist_moe_options)   # UnsupportedMegatronConfig
        self.submodules = submodules if submodules is not None else MoESubmodules(experts=None)
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        # NOTE: MoELayer.__init__ would build a token dispatcher; only the base class runs here
        # and the attributes MoELayer's methods read are set below.
        BaseMoELayer.__init__(self, config=config, layer_number=layer_number,
                              pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        # "moe" recompute maps to Dist-MoE's own replay (config_map); never checkpoint here.
        self.moe_layer_recompute = False
        self.shared_experts_recompute = (config.recompute_granularity == "selective"
                                         and "shared_experts" in config.recompute_modules)
        self.tp_group = pg_collection.tp
        self.router = self.submodules.router(config=self.config, pg_collection=pg_collection,
                                             is_mtp_layer=is_mtp_layer)
        self.token_dispatcher = None
        self.experts = DistMoEExperts(self.num_local_experts, self.config,
                                      pg_collection=pg_collection,
                                      name=(name + ".experts") if name is not None else None)
        if self.use_shared_expert:
            assert self.submodules.shared_experts is not None, (
                "Shared experts builder is not provided in the module spec.")
            self.shared_experts = self.submodules.shared_experts(
                config=self.config, pg_collection=pg_collection,
                gate=self.config.moe_shared_expert_gate,
                name=(name + ".shared_experts") if name is not None else None)
        self.cudagraph_tensor_store = MoECudaGraphTensorStore()
        self.fwd_execution_map = ["route", "expert_compute", "postprocess"]
        self._delayed_wgrad_event = None
        self._delayed_wgrad_stream = None
        self._num_local_input_tokens = (self.dist_moe_options.num_local_input_tokens
                                        or tokens_per_rank_from_args(megatron_args))
        # Fail at model construction, not at the first step: shape multiples, precision, and
        # E divisible by EP (T is checked here too when Megatron-LM args give it).
        probe = dist_moe_config(self.config, options=self.dist_moe_options,
                                num_local_input_tokens=self._num_local_input_tokens or 1)
        dm.plan_memory(probe, ep_size=get_pg_size(self.ep_group))
        self._dm_config = probe if self._num_local_input_tokens else None
        self._weights_layout_logged = False
        # TransformerEngine's weight-cache flag: Megatron's set_is_first_microbatch() sets it
        # True on each step's first microbatch (when its config has fp8); the forward then
        # quantizes the fp8_block / mxfp8 expert weights once into the context's cache and
        # the step's later microbatches (and recomputations) reuse them. None: quantize in
        # every forward (nobody sets the flag).
        self.is_first_microbatch = None
        get_runtime().register_layer(self)

    # -- Dist-MoE plumbing ----------------------------------------------------------------
    def dm_config(self, num_tokens: int) -> dm.Config:
        """dm.Config for this layer; T from options / Megatron-LM args / the first input."""
        if self._dm_config is None:
            if self._num_local_input_tokens is None:
                self._num_local_input_tokens = num_tokens
            self._dm_config = dist_moe_config(
                self.config, num_local_input_tokens=self._num_local_input_tokens,
                options=self.dist_moe_options)
        return self._dm_config

    def dist_moe_experts(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                         routing_map: torch.Tensor) -> torch.Tensor:
        """Routed-expert output [.., D] for hidden_states [.., D] and the router's probs /
        routing_map [.., E] (same leading shape). Replaces MoELayer's preprocess, dispatch,
        routed_experts_compute, combine and postprocess, which need a token dispatcher."""
        shape = hidden_states.shape
        D = shape[-1]
        x_TD = hidden_states.reshape(-1, D)
        ids_TK, scores_TK = routing_map_to_topk(probs.reshape(-1, probs.shape[-1]),
                                                routing_map.reshape(-1, routing_map.shape[-1]),
                                                self.config.moe_router_topk)
        base = self.dm_config(x_TD.shape[0])
        T, T_max = x_TD.shape[0], base.num_local_input_tokens
        if T > T_max:
            raise ValueError(
                f"dist_moe layer {self.layer_number}: {T} token rows exceed the "
                f"num_local_input_tokens={T_max} the Dist-MoE buffers were sized for (seq_length x "
                "micro_batch_size / TP / CP); pass --dist-moe-num-local-input-tokens for "
                "variable-length batches")
        ctx = get_runtime().context_for(self, base, x_TD.device)
        # Under Megatron's DDP the WGRADs add their fp32 sums straight into the experts'
        # main_grad (DistMoEOptions.wgrad_dtype="fp32", the default): no bf16 rounding of a
        # microbatch's gradient, and no stacked gradient written, read and added afterwards.
        into = (self.experts.main_grad_accumulators()
                if self.dist_moe_options.wgrad_dtype == "fp32" and torch.is_grad_enabled()
                and not torch.compiler.is_compiling() else None)
        fuse = bool(self.config.gradient_accumulation_fusion)
        self.experts.run_weight_pre_hooks()
        if not self._weights_layout_logged:
            self._weights_layout_logged = True
            if not self.experts.weights_packed():
                logger.info(
                    "dist_moe layer %s: the expert weights are not packed in one storage "
                    "(Megatron's distributed optimizer keeps them in its own buffer), so every "
                    "forward copies them (E_local x 3 x F x D elements)", self.layer_number)
        w13, w2 = self.experts.stacked_weights(fuse_into_main_grad=fuse,
                                               grads_accumulated=into is not None)
        x_in = x_TD.to(w13.dtype)
        if T < T_max:
            # Every EP rank passes the same T: pad with rows whose routes are all inactive.
            pad = T_max - T
            x_in = torch.cat([x_in, x_in.new_zeros(pad, D)])
            ids_TK = torch.cat([ids_TK, ids_TK.new_full((pad, ids_TK.shape[1]), -1)])
            scores_TK = torch.cat([scores_TK, scores_TK.new_zeros(pad, scores_TK.shape[1])])
        first = self._weight_cache_flag()
        y_TD = dm.routed_experts(x_in.contiguous(), ids_TK, scores_TK, w13, w2, ctx,
                                 wgrad_into=into, is_first_microbatch=first)
        if first:
            self.is_first_microbatch = False
        return y_TD[:T].to(hidden_states.dtype).reshape(shape)

    def _weight_cache_flag(self):
        """What this forward passes as routed_experts(is_first_microbatch=): the flag, or None
        (quantize in this call) where a cached copy could go stale or never be found:
          * weights not packed: the cache is keyed by the weights' storage, and a per-call copy
            has a new one;
          * Megatron CUDA graphs (cuda_graph_impl / enable_cuda_graph) or any capture: a
            replay repeats the captured host decision, so a False captured once would never
            see the optimizer's updates;
          * disable_parameter_transpose_cache: the run asked for no weight copies (as TE's
            layers read it)."""
        cfg, w = self.config, self.experts.local_experts[0].linear_fc1.weight
        capturing = w.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if (not self.experts.weights_packed() or capturing
                or (getattr(cfg, "cuda_graph_impl", "none") or "none") != "none"
                or getattr(cfg, "enable_cuda_graph", False)
                or getattr(cfg, "disable_parameter_transpose_cache", False)):
            return None
        return self.is_first_microbatch

    # -- MoELayer API ---------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        """hidden_states [S, B, D] -> (output [S, B, D], None), as MoELayer.forward."""
        if intermediate_tensors is not None:
            raise NotImplementedError("dist_moe does not split the MoE layer into fine-grained "
                                      "callables (overlap_moe_expert_parallel_comm)")
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError("During training, MoE with tensor parallelism needs "
                             "--sequence-parallel (as Megatron's MoELayer)")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared_expert_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        output = self.dist_moe_experts(hidden_states, probs, routing_map)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output, None

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False):
        """Weight gradients are produced inside backward; only shared experts may be delayed."""
        if shared_experts and self.use_shared_expert:
            self.shared_experts.backward_dw()

    def set_for_recompute_pre_mlp_layernorm(self):
        if self.shared_experts is not None and not self.shared_experts_recompute:
            from megatron.core.extensions.transformer_engine import set_save_original_input

            set_save_original_input(self.shared_experts.linear_fc1)

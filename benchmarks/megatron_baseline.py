"""Baseline (b): Megatron-Core's alltoall token dispatcher with Megatron's own experts.

Megatron-Core's MoELayer is built for the benchmark's shape (T tokens per rank, D, F, K,
E_local experts per rank) with moe_token_dispatcher_type='alltoall' and the experts Megatron
picks for this install:

    TEGroupedMLP   when TransformerEngine imports (moe_grouped_gemm=True, TE grouped GEMMs);
    SequentialMLP  otherwise (Megatron-Core 0.19 has no non-TE GroupedMLP any more: one
                   ColumnParallelLinear / RowParallelLinear pair per local expert, in a loop).

Its router is bypassed: the caller's expert IDs and scores become Megatron's router output
(probs [T, E] with the scores at the routed experts, routing_map [T, E] bool) and go through
MoELayer's own preprocess -> dispatch -> routed_experts_compute -> combine -> postprocess, the
path MoELayer.forward takes after `route`. Everything runs through torch autograd, so y is
differentiable w.r.t. x, the scores and the expert weights.

Weights: our layout w13 [E_local, 2F, D] (gate rows, then up rows) and w2 [E_local, D, F] is
Megatron's per-expert layout already (linear_fc1 weight [2F, D] = [gate; up] with
gated_linear_unit, linear_fc2 weight [D, F]); `load_weights` copies them in,
`stacked_weight_grads` maps the parameters' gradients back.

Process groups: Megatron's parallel_state is initialised here (TP = PP = 1, EP = size of the
given group, which must be the whole world) unless the caller already did; on GPU the model
parallel CUDA RNG tracker is seeded when nobody seeded it (TE's modules fork it while they
are built).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["megatron_available", "MegatronA2AExperts", "destroy_megatron_state"]

_INITIALISED_HERE = False


def megatron_available() -> tuple[bool, str]:
    """(True, "") when Megatron-Core's MoE layer imports, else (False, why)."""
    try:
        import megatron.core  # noqa: F401
        from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: F401
    except Exception as e:   # ImportError, or a broken install raising something else
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def transformer_engine_available() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception:
        return False
    return bool(HAVE_TE)


def _ensure_parallel_state(group, device: torch.device) -> None:
    """Megatron's parallel_state with EP = the group (= world), TP = PP = 1, if not set up."""
    global _INITIALISED_HERE
    from megatron.core import parallel_state as ps

    ep = dist.get_world_size(group)
    if not ps.model_parallel_is_initialized():
        if ep != dist.get_world_size():
            raise ValueError(f"the EP group ({ep} ranks) must be the whole world "
                             f"({dist.get_world_size()} ranks) to initialise Megatron here")
        ps.initialize_model_parallel(tensor_model_parallel_size=1,
                                     pipeline_model_parallel_size=1,
                                     expert_model_parallel_size=ep,
                                     create_gloo_process_groups=False)
        _INITIALISED_HERE = True
    mine = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
    want = (list(range(dist.get_world_size())) if group is None
            else dist.get_process_group_ranks(group))
    if sorted(mine) != sorted(want):
        raise ValueError(f"Megatron's expert-parallel group {mine} is not the given EP group "
                         f"{want}")
    if ps.get_tensor_model_parallel_world_size() != 1 or \
            ps.get_expert_tensor_parallel_world_size() != 1:
        raise ValueError("the Megatron baseline needs tensor parallel size 1")
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import (
            get_cuda_rng_tracker,
            model_parallel_cuda_manual_seed,
        )

        if not get_cuda_rng_tracker().is_initialized():
            model_parallel_cuda_manual_seed(1234)


def destroy_megatron_state() -> None:
    """Undo the parallel_state set-up if this module did it (before destroy_process_group)."""
    global _INITIALISED_HERE
    if _INITIALISED_HERE:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        _INITIALISED_HERE = False


def routing_from_topk(ids_TK: torch.Tensor, scores_TK: torch.Tensor, num_experts: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's router output from top-k routes: (probs [T, E] fp32, routing_map [T, E] bool).

    probs holds each route's score at its expert (0 elsewhere) and is differentiable w.r.t.
    scores_TK; IDs must be distinct within a row. Inactive routes (-1) land in a dropped column.
    """
    T = ids_TK.shape[0]
    col = ids_TK.to(torch.int64) + 1                       # -1 -> column 0, dropped below
    probs = torch.zeros(T, num_experts + 1, dtype=torch.float32, device=scores_TK.device)
    probs = probs.scatter_add(1, col, scores_TK.to(torch.float32))[:, 1:].contiguous()
    routing_map = torch.zeros(T, num_experts + 1, dtype=torch.bool, device=ids_TK.device)
    routing_map = routing_map.scatter(1, col, True)[:, 1:].contiguous()
    return probs, routing_map


class MegatronA2AExperts:
    """Megatron-Core MoELayer (alltoall dispatcher + its experts) for one benchmark shape.

    Args:
        T, D, F, K, E_local: tokens per rank, hidden, expert intermediate size, top-k, experts
                             per rank (E = E_local * EP experts in all)
        dtype:               parameter / activation dtype (bf16 on GPU, fp32 in the CPU test)
        device:              where the parameters live
        group:               the EP process group (None: the world)
        use_te:              None = TEGroupedMLP when TransformerEngine imports; False forces
                             SequentialMLP
        swiglu_fusion:       Megatron's bias_activation_fusion (weighted SwiGLU kernel,
                             torch.compile'd); off by default

    Call it as y = layer(x_TD, ids_TK, scores_TK) (all routes active, IDs distinct per row).
    """

    def __init__(self, T: int, D: int, F: int, K: int, E_local: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
                 group=None, use_te: bool | None = None, swiglu_fusion: bool = False):
        import torch.nn.functional as Fn
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        device = torch.device(device)
        _ensure_parallel_state(group, device)
        EP = dist.get_world_size(group)
        te = transformer_engine_available() if use_te is None else use_te
        if te and not transformer_engine_available():
            raise ValueError("use_te=True but TransformerEngine does not import")
        if te and device.type != "cuda":
            raise ValueError("TransformerEngine experts need a GPU")
        self.T, self.D, self.F, self.K, self.E_local, self.EP = T, D, F, K, E_local, EP
        self.E = E_local * EP
        self.config = TransformerConfig(
            num_layers=1, hidden_size=D, num_attention_heads=1, ffn_hidden_size=F,
            num_moe_experts=self.E, moe_ffn_hidden_size=F, moe_router_topk=K,
            moe_token_dispatcher_type="alltoall", expert_model_parallel_size=EP,
            moe_grouped_gemm=te, moe_router_dtype="fp32",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            gated_linear_unit=True, activation_func=Fn.silu, add_bias_linear=False,
            bias_activation_fusion=swiglu_fusion, hidden_dropout=0.0, attention_dropout=0.0,
            params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            use_cpu_initialization=device.type != "cuda", perform_initialization=False,
            transformer_impl="transformer_engine" if te else "local",
        )
        spec = get_moe_module_spec(use_te=te, num_experts=self.E, moe_grouped_gemm=te)
        layer = spec(config=self.config, layer_number=1)
        self.layer = layer.to(device).train()   # parameters are already params_dtype
        self.experts_kind = type(self.layer.experts).__name__
        assert self.layer.num_local_experts == E_local, (self.layer.num_local_experts, E_local)
        self.fc1, self.fc2 = self._expert_weights()
        self.note = (f"megatron-core alltoall dispatcher + {self.experts_kind}"
                     f"{' (TE grouped GEMM)' if te else ' (no TransformerEngine)'}"
                     f"{', swiglu fusion' if swiglu_fusion else ''}")

    # -- weights ----------------------------------------------------------------------------
    def _expert_weights(self) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        """Per-local-expert (fc1 [2F, D], fc2 [D, F]) parameters, in local expert order."""
        ex = self.layer.experts
        if hasattr(ex, "local_experts"):                      # SequentialMLP
            fc1 = [e.linear_fc1.weight for e in ex.local_experts]
            fc2 = [e.linear_fc2.weight for e in ex.local_experts]
        else:                                                 # TEGroupedMLP
            fc1 = [getattr(ex.linear_fc1, f"weight{i}") for i in range(self.E_local)]
            fc2 = [getattr(ex.linear_fc2, f"weight{i}") for i in range(self.E_local)]
        for a, b in zip(fc1, fc2):
            assert tuple(a.shape) == (2 * self.F, self.D), a.shape
            assert tuple(b.shape) == (self.D, self.F), b.shape
        return fc1, fc2

    @torch.no_grad()
    def load_weights(self, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor) -> None:
        """Copy our w13 [E_local, 2F, D] (gate; up) and w2 [E_local, D, F] into the experts."""
        w13 = w13_E2FD.reshape(self.E_local, 2 * self.F, self.D)
        for i in range(self.E_local):
            self.fc1[i].copy_(w13[i])
            self.fc2[i].copy_(w2_EDF[i])

    def expert_params(self) -> list[torch.nn.Parameter]:
        """The expert weights, fc1 of every local expert then fc2 (for autograd.grad)."""
        return [*self.fc1, *self.fc2]

    def stacked_weight_grads(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """autograd.grad output for expert_params() -> (grad_w13 [E_local, 2F, D],
        grad_w2 [E_local, D, F]) in our layout."""
        E = self.E_local
        return torch.stack(list(grads[:E])), torch.stack(list(grads[E:]))

    # -- forward ----------------------------------------------------------------------------
    def __call__(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, scores_TK: torch.Tensor,
                 validate: bool = True) -> torch.Tensor:
        """y [T, D] = sum over routes of score * expert(x), through Megatron's modules.

        validate=True checks on the host that every route is active and IDs are distinct per
        row (the dropless alltoall dispatcher sizes its buffers as T*K); timed calls skip it.
        """
        if validate:
            ids = ids_TK.to(torch.int64)
            if bool((ids < 0).any()) or bool((ids >= self.E).any()):
                raise ValueError("the Megatron baseline needs every route active "
                                 f"(IDs in [0, {self.E}))")
            srt = ids.sort(dim=1).values
            if bool((srt[:, 1:] == srt[:, :-1]).any()):
                raise ValueError("expert IDs must be distinct within a token's routes")
        probs, routing_map = routing_from_topk(ids_TK, scores_TK, self.E)
        layer = self.layer
        # MoELayer.forward after `route` (no shared experts, no latent projection).
        hidden, probs = layer.preprocess(x_TD, probs, routing_map)
        hidden, probs = layer.dispatch(hidden, probs)
        out, bias = layer.routed_experts_compute(hidden, probs)
        assert bias is None
        out = layer.combine(out)
        return layer.postprocess(out, None)

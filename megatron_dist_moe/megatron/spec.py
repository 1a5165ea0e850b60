"""Layer specs that build DistMoELayer, for Megatron's `--spec` mechanism and for Python users.

Megatron builds a GPT layer's MLP from a spec; these functions take Megatron's own GPT specs and
swap the MoE builder (`partial(MoELayer, submodules=...)`) for `partial(DistMoELayer, ...)`,
keeping the router and shared-expert submodules Megatron chose for the backend (local or TE).
Dense layers are left alone.

Entry points:
    get_gpt_layer_spec_dist_moe(config, vp_stage=None, ...)
        Megatron-Core 0.19's GPTModelBuilder calls a `--spec` *function* with the model config
        (and vp_stage): this returns the decoder block spec for this pipeline stage, MoE layers
        following moe_layer_freq. Called with no config it returns one all-MoE layer ModuleSpec.
    dist_moe_layer_spec
        A ModuleSpec *object*, for Megatron-LM's gpt_builders.py, which passes `--spec` objects
        to GPTModel without calling them:
            --spec megatron_dist_moe.megatron.spec dist_moe_layer_spec
    get_dist_moe_module_spec(use_te=None)
        Just the MoE builder, for custom layer specs.

After `megatron_dist_moe.megatron.install()` none of this is needed:
`--moe-token-dispatcher-type dist_moe` turns Megatron's default MoE layers into DistMoELayer.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Optional

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from .layer import DistMoELayer

__all__ = [
    "get_gpt_layer_spec_dist_moe",
    "get_dist_moe_module_spec",
    "to_dist_moe_layer_spec",
    "dist_moe_layer_spec",
]


def _backend(use_te: bool):
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return LocalSpecProvider()


def _as_dist_moe_builder(mlp: Any) -> Any:
    """partial(MoELayer, submodules=S, ...) -> partial(DistMoELayer, submodules=S, ...)."""
    if isinstance(mlp, functools.partial) and mlp.func is MoELayer:
        return functools.partial(DistMoELayer, *mlp.args, **mlp.keywords)
    if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
        return ModuleSpec(module=DistMoELayer, params=dict(mlp.params),
                          submodules=mlp.submodules, metainfo=dict(mlp.metainfo))
    return mlp


def get_dist_moe_module_spec(use_te: Optional[bool] = None) -> Any:
    """MLP builder for a dist_moe MoE layer (router + shared experts from the backend)."""
    use_te = HAVE_TE if use_te is None else use_te
    moe = get_moe_module_spec_for_backend(backend=_backend(use_te), num_experts=1)
    return _as_dist_moe_builder(moe)


def to_dist_moe_layer_spec(layer_spec: Any) -> Any:
    """A copy of a TransformerLayer ModuleSpec (or block spec) with MoE MLPs -> DistMoELayer."""
    if isinstance(layer_spec, TransformerBlockSubmodules):
        out = copy.copy(layer_spec)
        out.layer_specs = [to_dist_moe_layer_spec(s) for s in layer_spec.layer_specs]
        return out
    if not isinstance(layer_spec, ModuleSpec) or layer_spec.submodules is None:
        return layer_spec
    mlp = getattr(layer_spec.submodules, "mlp", None)
    new_mlp = _as_dist_moe_builder(mlp)
    if new_mlp is mlp:
        return layer_spec
    submodules = copy.copy(layer_spec.submodules)
    submodules.mlp = new_mlp
    return ModuleSpec(module=layer_spec.module, params=dict(layer_spec.params),
                      submodules=submodules, metainfo=dict(layer_spec.metainfo))


def get_gpt_layer_spec_dist_moe(config: Any = None, vp_stage: Optional[int] = None, *,
                                use_transformer_engine: Optional[bool] = None,
                                normalization: Optional[str] = None,
                                qk_l2_norm: Optional[bool] = None,
                                pp_rank: Optional[int] = None) -> Any:
    """GPT decoder spec with dist_moe MoE layers.

    Args:
        config:   a TransformerConfig, or an object with `.transformer` (Megatron-Core 0.19's
                  GPTModelConfig, which is what GPTModelBuilder passes to a `--spec` function).
                  None: return a single all-MoE TransformerLayer ModuleSpec.
        vp_stage, pp_rank: pipeline position (as get_gpt_decoder_block_spec).
        use_transformer_engine: default: config.transformer_impl == "transformer_engine"
                  (no config: whether Transformer Engine is installed).
        normalization, qk_l2_norm: default: taken from the config.

    Returns:
        TransformerBlockSubmodules for this stage (with a config), else a ModuleSpec.
    """
    if config is None:
        use_te = HAVE_TE if use_transformer_engine is None else use_transformer_engine
        base = (get_gpt_layer_with_transformer_engine_spec(num_experts=1) if use_te
                else get_gpt_layer_local_spec(num_experts=1, normalization=normalization))
        return to_dist_moe_layer_spec(base)
    tc = getattr(config, "transformer", config)
    if use_transformer_engine is None:
        use_transformer_engine = getattr(tc, "transformer_impl", "local") == "transformer_engine"
    block = get_gpt_decoder_block_spec(
        tc, use_transformer_engine=use_transformer_engine,
        normalization=normalization if normalization is not None else tc.normalization,
        qk_l2_norm=qk_l2_norm if qk_l2_norm is not None else getattr(tc, "qk_l2_norm", False),
        vp_stage=vp_stage, pp_rank=pp_rank)
    return to_dist_moe_layer_spec(block)


# NOTE: an object, not a function: Megatron-LM's gpt_builders.py hands `--spec` objects to
# GPTModel uncalled. Local modules unless Transformer Engine is installed.
dist_moe_layer_spec = get_gpt_layer_spec_dist_moe()

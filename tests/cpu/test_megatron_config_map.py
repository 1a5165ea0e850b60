"""TransformerConfig -> megatron_dist_moe.Config, and start-up errors for unsupported settings."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch.nn.functional as F  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_dist_moe.megatron.config_map import (  # noqa: E402
    DistMoEOptions,
    UnsupportedMegatronConfig,
    check_supported,
    dist_moe_config,
    options_from_args,
    tokens_per_rank,
    tokens_per_rank_from_args,
)


def tc(**overrides) -> TransformerConfig:
    kw = dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256,
              moe_ffn_hidden_size=64, num_moe_experts=8, moe_router_topk=2,
              moe_token_dispatcher_type="alltoall", gated_linear_unit=True,
              activation_func=F.silu, add_bias_linear=False, bf16=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


def like(**overrides):
    """A TransformerConfig look-alike for settings this CPU machine cannot construct (fp8 needs
    Transformer Engine); the checks only read attributes."""
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(tc()), **overrides})


def tc_or_like(**overrides):
    try:
        return tc(**overrides)
    except (ValueError, AssertionError):   # Megatron's own validation needs TE / other flags
        return like(**overrides)


def test_shape_and_policy_mapping():
    cfg = dist_moe_config(tc(), num_local_input_tokens=4096)
    assert (cfg.num_local_input_tokens, cfg.hidden_dim, cfg.intermediate_dim, cfg.top_k,
            cfg.num_experts) == (4096, 128, 64, 2, 8)
    assert cfg.precision == "bf16" and not cfg.inference
    assert cfg.activation_slot_capacity_factor == 1.0
    assert cfg.backend == "auto" and cfg.wgrad_dtype == "fp32"


def test_mxfp8_recipe_runs_mxfp8_on_every_backend():
    """--fp8-recipe mxfp8 is precision mxfp8, which the reference and the CUDA backend run
    (dm.RUNS); the hybrid format (E5M2 gradients) is refused, naming the flag."""
    t = like(fp8="e4m3", fp8_recipe="mxfp8", moe_ffn_hidden_size=128)
    assert dist_moe_config(t, num_local_input_tokens=128).precision == "mxfp8"
    for backend in ("reference", "cuda"):
        cfg = dist_moe_config(t, num_local_input_tokens=128,
                              options=DistMoEOptions(backend=backend))
        assert cfg.precision == "mxfp8" and cfg.backend == backend
    with pytest.raises(UnsupportedMegatronConfig, match="fp8-format"):
        dist_moe_config(like(fp8="hybrid", fp8_recipe="mxfp8", moe_ffn_hidden_size=128),
                        num_local_input_tokens=128)


def test_mxfp8_recipe_object_is_checked():
    """A stand-in for TransformerEngine's MXFP8BlockScaling: E4M3 runs, HYBRID (E5M2
    gradients) is refused naming the setting."""
    from types import SimpleNamespace as NS
    from megatron_dist_moe.megatron.config_map import mxfp8_scaling
    t = like(fp8="e4m3", fp8_recipe="mxfp8", moe_ffn_hidden_size=128)
    fmt = lambda name: NS(name=name)  # noqa: E731  (an Enum member's .name)
    cfg = dist_moe_config(t, num_local_input_tokens=128, fp8_recipe=NS(fp8_format=fmt("E4M3")))
    assert cfg.precision == "mxfp8"
    assert mxfp8_scaling(None) == {}   # no TransformerEngine here: its default, E4M3
    with pytest.raises(UnsupportedMegatronConfig, match="fp8_format=HYBRID"):
        dist_moe_config(t, num_local_input_tokens=128, fp8_recipe=NS(fp8_format=fmt("HYBRID")))


def test_blockwise_recipe_runs_fp8_block_with_te_settings():
    """--fp8-format e4m3 --fp8-recipe blockwise: precision fp8_block, with the scaling settings
    of TransformerEngine's Float8BlockScaling (its defaults without TE, or a recipe object)."""
    from types import SimpleNamespace as NS
    from megatron_dist_moe.megatron.config_map import fp8_block_scaling
    t = like(fp8="e4m3", fp8_recipe="blockwise", moe_ffn_hidden_size=128)
    cfg = dist_moe_config(t, num_local_input_tokens=128)
    assert cfg.precision == "fp8_block"
    assert cfg.fp8_power_2_scales is True and cfg.fp8_amax_epsilon == 0.0
    q = lambda pow2, eps: NS(power_2_scale=pow2, amax_epsilon=eps)  # noqa: E731
    # a stand-in for TE's recipe object with FP32 scales (NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1)
    fp32 = NS(fp8_quant_fwd_inp=q(False, 0.0), fp8_quant_fwd_weight=q(False, 0.0),
              fp8_quant_bwd_grad=q(False, 0.0), x_block_scaling_dim=1, w_block_scaling_dim=2,
              grad_block_scaling_dim=1)
    cfg = dist_moe_config(t, num_local_input_tokens=128, fp8_recipe=fp32)
    assert cfg.fp8_power_2_scales is False
    mixed = NS(**{**vars(fp32), "fp8_quant_bwd_grad": q(True, 0.0)})
    with pytest.raises(UnsupportedMegatronConfig, match="differ between inputs, weights"):
        fp8_block_scaling(mixed)
    one_d = NS(**{**vars(fp32), "w_block_scaling_dim": 1})
    with pytest.raises(UnsupportedMegatronConfig, match="block dims"):
        fp8_block_scaling(one_d)
    with pytest.raises(UnsupportedMegatronConfig, match="--fp8-format hybrid"):
        dist_moe_config(like(fp8="hybrid", fp8_recipe="blockwise", moe_ffn_hidden_size=128),
                        num_local_input_tokens=128)


def test_recompute_moe_makes_every_layer_replay():
    cfg = dist_moe_config(tc(recompute_granularity="selective", recompute_modules=["moe"]),
                          num_local_input_tokens=128)
    assert cfg.activation_slot_capacity_factor == 0.0
    # "moe_act" needs nothing: Dist-MoE never saves the SwiGLU output
    cfg = dist_moe_config(like(recompute_granularity="selective", recompute_modules=["moe_act"]),
                          num_local_input_tokens=128)
    assert cfg.activation_slot_capacity_factor == 1.0
    # an explicit option wins
    cfg = dist_moe_config(tc(recompute_granularity="selective", recompute_modules=["moe"]),
                          num_local_input_tokens=128,
                          options=DistMoEOptions(activation_slot_capacity_factor=0.5))
    assert cfg.activation_slot_capacity_factor == 0.5


def test_tokens_per_rank():
    assert tokens_per_rank(4096, 2) == 8192
    assert tokens_per_rank(4096, 2, tensor_model_parallel_size=4, sequence_parallel=True) == 2048
    assert tokens_per_rank(4096, 2, tensor_model_parallel_size=4) == 8192   # no SP: replicated
    assert tokens_per_rank(4096, 1, context_parallel_size=2) == 2048
    with pytest.raises(UnsupportedMegatronConfig, match="not divisible"):
        tokens_per_rank(10, 1, context_parallel_size=4)
    args = dict(seq_length=1024, micro_batch_size=4, tensor_model_parallel_size=2,
                context_parallel_size=1, sequence_parallel=True)
    assert tokens_per_rank_from_args(args) == 2048
    assert tokens_per_rank_from_args(None) is None


def test_options_from_cli_and_yaml():
    from types import SimpleNamespace

    cli = SimpleNamespace(dist_moe_backend="reference", dist_moe_wgrad_dtype=None,
                          dist_moe_activation_slot_capacity_factor=0.25)
    assert options_from_args(cli) == DistMoEOptions(backend="reference",
                                                    activation_slot_capacity_factor=0.25)
    yaml_args = SimpleNamespace(dist_moe=SimpleNamespace(backend="cuda", wgrad_dtype="bf16"))
    assert options_from_args(yaml_args) == DistMoEOptions(backend="cuda", wgrad_dtype="bf16")
    with pytest.raises(ValueError, match="unknown dist_moe option"):
        options_from_args({"dist_moe": {"slots": 3}})
    with pytest.raises(ValueError, match="--dist-moe-backend"):
        DistMoEOptions(backend="nccl")


# Each unsupported setting: (TransformerConfig overrides, text the message must contain).
UNSUPPORTED = [
    (dict(expert_tensor_parallel_size=2), "--expert-tensor-parallel-size 1"),
    (dict(moe_expert_capacity_factor=1.25), "--moe-expert-capacity-factor"),
    (dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
     "--moe-pad-expert-input-to-capacity"),
    (dict(gated_linear_unit=False, activation_func=F.gelu), "--swiglu"),
    (dict(activation_func=F.gelu), "--swiglu"),
    (dict(add_bias_linear=True), "--disable-bias-linear"),
    (dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True,
          moe_token_dispatcher_type="alltoall"), "--moe-shared-expert-overlap"),
    (dict(fp8="e4m3", fp8_recipe="tensorwise"), "--fp8-recipe tensorwise: dist_moe quantizes"),
    (dict(fp8="e4m3", fp8_recipe="delayed"), "--fp8-recipe delayed: dist_moe quantizes"),
    (dict(bf16=False, fp16=True), "--bf16"),
    (dict(moe_router_topk=1, moe_apply_probs_on_input=True, moe_router_pre_softmax=True),
     "--moe-apply-probs-on-input"),
    (dict(delay_wgrad_compute=True), "delay_wgrad_compute"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router"]),
     "cuda_graph_modules"),
]


@pytest.mark.parametrize("overrides, needle", UNSUPPORTED,
                         ids=[next(iter(o)) + ("_" + str(list(o.values())[0]))
                              for o, _ in UNSUPPORTED])
def test_unsupported_settings_fail_with_a_fix(overrides, needle):
    config = tc_or_like(**overrides)
    with pytest.raises(UnsupportedMegatronConfig) as info:
        dist_moe_config(config, num_local_input_tokens=128)
    assert needle in str(info.value)
    assert "moe_token_dispatcher_type='dist_moe' cannot run" in str(info.value)


def test_all_problems_are_listed_at_once():
    with pytest.raises(UnsupportedMegatronConfig) as info:
        check_supported(tc(add_bias_linear=True, moe_expert_capacity_factor=1.0))
    assert len(info.value.problems) == 2


def test_reference_backend_with_cuda_graphs_is_rejected():
    with pytest.raises(UnsupportedMegatronConfig, match="--dist-moe-backend cuda"):
        check_supported(tc(cuda_graph_impl="local"), DistMoEOptions(backend="reference"))


def test_shape_errors_name_the_megatron_flag():
    with pytest.raises(UnsupportedMegatronConfig, match="--moe-ffn-hidden-size"):
        dist_moe_config(tc(moe_ffn_hidden_size=100), num_local_input_tokens=128)


def test_save_route_outputs_option_reaches_config_and_plan():
    import megatron_dist_moe as dm
    from types import SimpleNamespace

    opts = options_from_args(SimpleNamespace(dist_moe_save_route_outputs=1))
    assert opts.save_route_outputs == 1
    keep = dist_moe_config(tc(), num_local_input_tokens=256, options=opts)
    lean = dist_moe_config(tc(), num_local_input_tokens=256)   # the default
    assert keep.save_route_outputs is True and lean.save_route_outputs is False
    pk, pl = dm.plan_memory(keep, ep_size=2), dm.plan_memory(lean, ep_size=2)
    # the route outputs (T*K*D*2 bytes) leave the full state; the [T, K] fp32 scores and the
    # experts' score-gradient parts (one [T, K] fp32 slice per 32 columns of F) join the
    # symmetric routing region
    T, K, D, F = 256, keep.top_k, keep.hidden_dim, keep.intermediate_dim
    assert pk.layer.full_state(T * K) - pl.layer.full_state(T * K) == T * K * D * 2
    assert pl.routing_bytes - pk.routing_bytes == (1 + F // 32) * T * K * 4
    with pytest.raises(ValueError, match="--dist-moe-save-route-outputs"):
        DistMoEOptions(save_route_outputs="no")

"""From a Megatron-Core TransformerConfig (plus launch sizes) to a `megatron_dist_moe.Config`.

Two halves:

* `check_supported(tc)` lists every setting the dist_moe layer cannot run and raises one
  `UnsupportedMegatronConfig` naming, for each, the Megatron flag to change. It runs when a
  DistMoELayer is built, i.e. at model construction, before the first step.
* `dist_moe_config(tc, ...)` maps the shape and policy fields:

      hidden_size                     -> hidden_dim D
      moe_ffn_hidden_size             -> intermediate_dim F (per expert, gate and up each F)
      num_moe_experts                 -> num_experts E
      moe_router_topk                 -> top_k K
      seq_length x micro_batch_size   -> num_local_input_tokens T  (/ TP with sequence
                                         parallelism, / CP with context parallelism)
      fp8 / fp8_recipe                -> precision ("mxfp8" -> mxfp8, "blockwise" -> fp8_block)
      recompute_modules "moe"         -> activation_slot_capacity_factor 0 (every layer replays
                                         inside Dist-MoE instead of Megatron's checkpoint)
      recompute_modules "moe_act"     -> nothing to do: Dist-MoE never saves the SwiGLU output
      pipeline schedule               -> num_activation_slots, max_moe_layers_per_activation_slot
                                         (see pipeline_slots.py; set by the runtime)

  The EP group size comes from the process group the layer receives (pg_collection.ep).

Plugin-only knobs that have no TransformerConfig field travel in `DistMoEOptions`, filled from
`--dist-moe-*` flags (added by install()) or from a `dist_moe:` section of a Megatron YAML config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .. import BACKENDS, WGRAD_DTYPES, Config, ConfigError
from ..execution import runs_precision, what_runs

__all__ = [
    "UnsupportedMegatronConfig",
    "DistMoEOptions",
    "check_supported",
    "precision_from_transformer_config",
    "fp8_block_scaling",
    "tokens_per_rank",
    "dist_moe_config",
    "options_from_args",
    "megatron_args_or_none",
    "tokens_per_rank_from_args",
]

DISPATCHER_TYPE = "dist_moe"

# Config fields -> the Megatron flag a user changes to fix them.
_FLAG_OF_FIELD = {
    "hidden_dim": "--hidden-size",
    "intermediate_dim": "--moe-ffn-hidden-size",
    "top_k": "--moe-router-topk",
    "num_experts": "--num-experts",
    "num_local_input_tokens": "--seq-length / --micro-batch-size",
    "precision": "--fp8-format / --fp8-recipe",
}


class UnsupportedMegatronConfig(ValueError):
    """The Megatron configuration asks for something the dist_moe layer cannot run.

    `problems` holds one "what: how to fix" line per offending setting.
    """

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"moe_token_dispatcher_type='{DISPATCHER_TYPE}' cannot run this "
                         f"configuration:\n{lines}")


@dataclass(frozen=True)
class DistMoEOptions:
    """Dist-MoE settings with no TransformerConfig counterpart (flag: --dist-moe-<name>).

    backend                          "auto" | "reference" | "cuda"
    activation_slot_capacity_factor  None = automatic (1.0: balanced routing never replays;
                                     0.0 when recompute_modules contains "moe")
    device_scratch_capacity_factor   device scratch rows as a multiple of T x K
    host_scratch_capacity_factor     optional pinned-host overflow (total factor)
    wgrad_dtype                      "fp32" | "bf16" accumulation of the expert weight grads
    save_route_outputs               False: score gradients on the expert side, a third less
                                     saved state per layer (Config.save_route_outputs)
    num_local_input_tokens           override T (default: seq_length x micro_batch_size / TP / CP)
    """

    backend: str = "auto"
    activation_slot_capacity_factor: float | None = None
    device_scratch_capacity_factor: float = 2.0
    host_scratch_capacity_factor: float | None = None
    wgrad_dtype: str = "fp32"
    save_route_outputs: bool = False
    num_local_input_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--dist-moe-backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.wgrad_dtype not in WGRAD_DTYPES:
            raise ValueError(f"--dist-moe-wgrad-dtype must be one of {WGRAD_DTYPES}, got "
                             f"{self.wgrad_dtype!r}")
        if self.save_route_outputs not in (True, False):   # bool, or 0 / 1 from the flag
            raise ValueError(f"--dist-moe-save-route-outputs must be 0 or 1 (true/false), got "
                             f"{self.save_route_outputs!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "DistMoEOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown dist_moe option(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(data))


def _names(values: Any) -> list[str]:
    if values is None:
        return []
    out = []
    for v in (values if isinstance(values, (list, tuple, set)) else [values]):
        out.append(getattr(v, "name", None) or str(v))
    return out


def _is_silu(fn: Any) -> bool:
    import torch.nn.functional as F

    return fn is F.silu or getattr(fn, "__name__", "") == "silu"


# Megatron's --fp8-recipe -> dm.Config.precision (the block-scaled recipes the design names)
FP8_RECIPES = {"mxfp8": "mxfp8", "blockwise": "fp8_block"}


def _runnable_fp8_recipes() -> list[str]:
    return [r for r, p in FP8_RECIPES.items() if runs_precision(p)]


def precision_from_transformer_config(tc: Any) -> str:
    """dm.Config.precision for tc's fp8/fp4 settings; raises UnsupportedMegatronConfig, naming
    the flag, for a recipe dist_moe does not map or whose precision does not run yet."""
    fp8 = getattr(tc, "fp8", None)
    runnable = _runnable_fp8_recipes()
    alternatives = (" or ".join(f"--fp8-format e4m3 --fp8-recipe {r}" for r in runnable)
                    or "bf16 (drop --fp8-format)")
    if getattr(tc, "fp4", None):
        raise UnsupportedMegatronConfig([
            f"fp4 training (NVFP4 is inference-only in dist_moe): drop --fp4-format; use "
            f"{alternatives}"])
    if not fp8:
        return "bf16"
    recipe = getattr(getattr(tc, "fp8_recipe", None), "value", getattr(tc, "fp8_recipe", None))
    if recipe not in FP8_RECIPES:
        raise UnsupportedMegatronConfig([
            f"--fp8-recipe {recipe}: dist_moe quantizes with block scales only; use "
            f"{alternatives}"])
    precision = FP8_RECIPES[recipe]
    fmt = getattr(getattr(tc, "fp8", None), "value", fp8)
    if str(fmt).lower() not in ("e4m3", "true", "fp8format.e4m3"):
        raise UnsupportedMegatronConfig([
            f"--fp8-format {fmt}: dist_moe's {precision} quantizes activations, weights and "
            "gradients in E4M3 (TransformerEngine's default for both block-scaled recipes); "
            "use --fp8-format e4m3"])
    if recipe not in runnable:
        raise UnsupportedMegatronConfig([
            f"--fp8-recipe {recipe} maps to dist_moe precision {precision!r}, which does not "
            f"run yet (what runs: {what_runs()}); use {alternatives}"])
    return precision


def check_supported(tc: Any, options: DistMoEOptions | None = None) -> None:
    """Raise UnsupportedMegatronConfig listing every setting dist_moe cannot run."""
    p: list[str] = []
    g = lambda name, default=None: getattr(tc, name, default)  # noqa: E731

    if not g("num_moe_experts"):
        p.append("num_moe_experts is not set: dist_moe replaces MoE layers; set --num-experts")
    if (g("expert_tensor_parallel_size") or 1) > 1:
        p.append(f"expert_tensor_parallel_size={g('expert_tensor_parallel_size')}: experts are "
                 "not tensor-parallel in dist_moe; set --expert-tensor-parallel-size 1 (attention "
                 "may keep --tensor-model-parallel-size > 1 with --sequence-parallel)")
    if g("moe_expert_capacity_factor") is not None:
        p.append("moe_expert_capacity_factor (token dropping): dist_moe never drops tokens; "
                 "remove --moe-expert-capacity-factor")
    if g("moe_pad_expert_input_to_capacity"):
        p.append("moe_pad_expert_input_to_capacity: remove --moe-pad-expert-input-to-capacity")
    if g("moe_token_dropping"):
        p.append("moe_token_dropping: dist_moe never drops tokens; disable it")
    if not g("gated_linear_unit") or not _is_silu(g("activation_func")):
        p.append("experts must be SwiGLU (gated_linear_unit with silu): pass --swiglu "
                 "(YAML: activation_func: swiglu)")
    if g("add_bias_linear"):
        p.append("add_bias_linear: dist_moe experts have no bias; pass --disable-bias-linear")
    if g("moe_apply_probs_on_input"):
        p.append("moe_apply_probs_on_input: dist_moe applies router scores to the expert output; "
                 "remove --moe-apply-probs-on-input")
    if g("moe_latent_size"):
        p.append("moe_latent_size (latent MoE projections): not supported; "
                 "remove --moe-latent-size")
    if g("moe_shared_expert_overlap"):
        p.append("moe_shared_expert_overlap: there is no dispatcher communication to overlap "
                 "with; remove --moe-shared-expert-overlap")
    if g("overlap_moe_expert_parallel_comm"):
        p.append("overlap_moe_expert_parallel_comm: remove --overlap-moe-expert-parallel-comm "
                 "(the combined 1F1B schedule splits the layer at dispatcher boundaries)")
    if g("overlap_dispatch_backward_with_experts_wgrad") or g("delay_wgrad_compute"):
        p.append("delayed expert wgrad (overlap_dispatch_backward_with_experts_wgrad / "
                 "delay_wgrad_compute): remove these flags; dist_moe computes weight gradients "
                 "inside its backward")
    if g("moe_router_padding_for_quantization") or g("moe_router_padding_for_fp8"):
        p.append("moe_router_padding_for_quantization: dist_moe pads expert segments itself; "
                 "remove --moe-router-padding-for-quantization")
    if g("fp16"):
        p.append("fp16: dist_moe runs bf16 (or block-scaled fp8) experts; use --bf16")
    if g("transformer_impl") == "inference_optimized":
        p.append("transformer_impl=inference_optimized: uses Megatron's own inference "
                 "dispatchers; use --transformer-impl transformer_engine or local")
    if g("moe_paged_stash"):
        p.append("moe_paged_stash: dist_moe keeps saved state in its own activation slots; "
                 "disable --moe-paged-stash")
    if g("fine_grained_activation_offloading"):
        bad = [m for m in _names(g("offload_modules")) if m in ("expert_fc1", "moe_act",
                                                                "fused_group_mlp")]
        if bad:
            p.append(f"offload_modules {bad}: dist_moe keeps expert activations in its own "
                     "buffers; remove them from --offload-modules")
    graph_impl = g("cuda_graph_impl", "none") or "none"
    if graph_impl != "none":
        scopes = _names(g("cuda_graph_modules"))
        partial = [s for s in scopes if s in ("moe", "moe_router", "moe_preprocess")]
        if partial:
            p.append(f"cuda_graph_modules {partial}: these scopes split MoELayer at dispatcher "
                     "boundaries; capture whole layers (no --cuda-graph-modules) or 'attn' only")
        if options is not None and options.backend == "reference":
            p.append("CUDA graphs with --dist-moe-backend reference: the reference backend syncs "
                     "with the host; use --dist-moe-backend cuda (or auto on sm_90+)")
    if p:
        raise UnsupportedMegatronConfig(p)
    precision_from_transformer_config(tc)


def tokens_per_rank(seq_length: int, micro_batch_size: int, *, tensor_model_parallel_size: int = 1,
                    context_parallel_size: int = 1, sequence_parallel: bool = False) -> int:
    """Token rows one rank feeds each MoE layer: S x B / CP, further / TP with sequence parallel."""
    T = seq_length * micro_batch_size
    for name, div in (("context_parallel_size", context_parallel_size),
                      ("tensor_model_parallel_size", tensor_model_parallel_size if sequence_parallel
                       else 1)):
        if T % div:
            raise UnsupportedMegatronConfig([
                f"seq_length x micro_batch_size = {T} is not divisible by {name}={div}"])
        T //= div
    return T


def fp8_block_scaling(recipe: Any = None) -> dict:
    """Config fields (fp8_power_2_scales, fp8_amax_epsilon) of --fp8-recipe blockwise.

    From TransformerEngine's `Float8BlockScaling` recipe object (`recipe`, or a default one when
    TransformerEngine is importable), else TE's defaults (power-of-two scales, amax epsilon 0).
    The recipe's quantizer settings must be the ones dist_moe implements: the same QParams for
    inputs, weights and gradients, 1 x 128 activation / gradient blocks, 128 x 128 weights."""
    if recipe is None:
        try:
            from transformer_engine.common.recipe import Float8BlockScaling
        except Exception:   # no TransformerEngine: its defaults
            return dict(fp8_power_2_scales=True, fp8_amax_epsilon=0.0)
        recipe = Float8BlockScaling()
    qps = [getattr(recipe, n) for n in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight",
                                         "fp8_quant_bwd_grad")]
    settings = {(bool(q.power_2_scale), float(q.amax_epsilon)) for q in qps}
    problems = []
    if len(settings) != 1:
        problems.append(f"Float8BlockScaling quantizer settings differ between inputs, weights "
                        f"and gradients ({sorted(settings)}); dist_moe applies one setting")
    dims = (getattr(recipe, "x_block_scaling_dim", 1), getattr(recipe, "w_block_scaling_dim", 2),
            getattr(recipe, "grad_block_scaling_dim", 1))
    if tuple(dims) != (1, 2, 1):
        problems.append(f"Float8BlockScaling block dims (x, w, grad) = {dims}; dist_moe "
                        "implements (1, 2, 1): 1 x 128 activations and gradients, 128 x 128 weights")
    if problems:
        raise UnsupportedMegatronConfig(problems)
    pow2, eps = settings.pop()
    return dict(fp8_power_2_scales=pow2, fp8_amax_epsilon=eps)


def mxfp8_scaling(recipe: Any = None) -> dict:
    """Config fields of --fp8-recipe mxfp8 (none: dist_moe's MXFP8 has no knob), after checking
    TransformerEngine's `MXFP8BlockScaling` recipe object (`recipe`, or a default one when
    TransformerEngine is importable) asks for what dist_moe implements: E4M3 everywhere (its
    `fp8_format`; HYBRID's E5M2 gradients are not implemented)."""
    if recipe is None:
        try:
            from transformer_engine.common.recipe import MXFP8BlockScaling
        except Exception:   # no TransformerEngine: its default, E4M3
            return {}
        recipe = MXFP8BlockScaling()
    fmt = getattr(recipe, "fp8_format", None)
    name = str(getattr(fmt, "name", fmt)).upper()
    if name not in ("E4M3", "NONE"):
        raise UnsupportedMegatronConfig([
            f"MXFP8BlockScaling(fp8_format={name}): dist_moe's mxfp8 quantizes activations, "
            "weights and gradients in E4M3 (TransformerEngine's default); use Format.E4M3"])
    return {}


def dist_moe_config(tc: Any, *, num_local_input_tokens: int, options: DistMoEOptions | None = None,
                    num_activation_slots: int = 1, max_moe_layers_per_activation_slot: int = 1,
                    inference: bool = False, fp8_recipe: Any = None) -> Config:
    """The dm.Config of tc's MoE layers (validated; errors name the Megatron flag to change).
    fp8_recipe: TransformerEngine's recipe object of the run, if the caller has it
    (`fp8_block_scaling`, `mxfp8_scaling`)."""
    options = options or DistMoEOptions()
    check_supported(tc, options)
    capacity = options.activation_slot_capacity_factor
    if capacity is None:
        recompute_moe = (getattr(tc, "recompute_granularity", None) == "selective"
                         and "moe" in _names(getattr(tc, "recompute_modules", None)))
        capacity = 0.0 if recompute_moe else 1.0
    precision = precision_from_transformer_config(tc)
    scaling = (fp8_block_scaling(fp8_recipe) if precision == "fp8_block"
               else mxfp8_scaling(fp8_recipe) if precision == "mxfp8" else {})
    try:
        return Config(
            num_local_input_tokens=num_local_input_tokens,
            hidden_dim=tc.hidden_size,
            intermediate_dim=tc.moe_ffn_hidden_size or tc.ffn_hidden_size,
            top_k=tc.moe_router_topk,
            num_experts=tc.num_moe_experts,
            precision=precision,
            inference=inference,
            num_activation_slots=0 if inference else num_activation_slots,
            max_moe_layers_per_activation_slot=max_moe_layers_per_activation_slot,
            activation_slot_capacity_factor=None if inference else capacity,
            device_scratch_capacity_factor=options.device_scratch_capacity_factor,
            host_scratch_capacity_factor=options.host_scratch_capacity_factor,
            wgrad_dtype=options.wgrad_dtype,
            save_route_outputs=bool(options.save_route_outputs),
            backend=options.backend,
            **scaling,
        )
    except ConfigError as e:
        flag = _FLAG_OF_FIELD.get(e.field)
        hint = f" (Megatron flag: {flag})" if flag else ""
        raise UnsupportedMegatronConfig([f"{e}{hint}"]) from e


# -- reading Megatron-LM's global args (optional: megatron.training may be absent) -------------

def megatron_args_or_none() -> Any:
    """megatron.training's parsed args when a Megatron-LM launcher initialized them, else None."""
    try:
        from megatron.training import global_vars
    except Exception:   # megatron-core only, or megatron.training fails to import
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def _get(args: Any, name: str, default: Any = None) -> Any:
    if isinstance(args, Mapping):
        return args.get(name, default)
    return getattr(args, name, default)


def options_from_args(args: Any) -> DistMoEOptions:
    """DistMoEOptions from `--dist-moe-*` flags or a YAML `dist_moe:` section (either may be
    missing; defaults fill the rest)."""
    if args is None:
        return DistMoEOptions()
    values: dict[str, Any] = {}
    section = _get(args, "dist_moe")
    if section is not None:
        values.update(section if isinstance(section, Mapping) else vars(section))
    for f in dataclasses.fields(DistMoEOptions):
        v = _get(args, f"dist_moe_{f.name}")
        if v is not None:
            values[f.name] = v
    return DistMoEOptions.from_mapping(values)


def tokens_per_rank_from_args(args: Any) -> int | None:
    """T from Megatron-LM args (seq_length, micro_batch_size, TP/CP, sequence_parallel)."""
    if args is None:
        return None
    seq, mbs = _get(args, "seq_length"), _get(args, "micro_batch_size")
    if not seq or not mbs:
        return None
    return tokens_per_rank(seq, mbs,
                           tensor_model_parallel_size=_get(args, "tensor_model_parallel_size", 1),
                           context_parallel_size=_get(args, "context_parallel_size", 1),
                           sequence_parallel=bool(_get(args, "sequence_parallel", False)))

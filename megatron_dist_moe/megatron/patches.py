"""The minimal, undoable patches that make Megatron accept moe_token_dispatcher_type='dist_moe'.

Where Megatron-Core 0.19 / Megatron-LM decide on the dispatcher type, and what we do there:

1. `TransformerConfig.moe_token_dispatcher_type: Literal['allgather', 'alltoall', 'flex']`.
   Megatron-LM's argparse flag is generated from this annotation (ArgumentGroupFactory turns a
   Literal into `choices`), so the field's annotation gains 'dist_moe'. TransformerConfig's
   __post_init__ never rejects unknown values itself; its checks only reserve features for
   alltoall/flex (shared-expert overlap, EP comm overlap), which dist_moe rejects with its own
   message (config_map.check_supported).
2. `megatron.training.arguments.add_megatron_arguments`: wrapped to add 'dist_moe' to the flag's
   choices when an older Megatron-LM hard-codes them, and to add the `--dist-moe-*` options.
   The YAML path (--yaml-cfg) builds TransformerConfig directly, so (1) covers it.
3. `MoELayer.__init__` raises "Unsupported token dispatcher type" for unknown types. Rather than
   touching every spec helper that builds `partial(MoELayer, ...)`, the wrapped `__init__` turns
   a MoELayer whose config asks for dist_moe into a DistMoELayer before anything is built (only
   for MoELayer itself; subclasses are left alone), so every GPT/hybrid/MTP spec path builds
   dist_moe layers.
4. `megatron.core.pipeline_parallel.schedules`: forward_step/backward_step and the three
   forward_backward_* functions are wrapped by pipeline_slots.SlotHooks (activation slots).

Each wrapper keeps the original as `__wrapped__`; install() is idempotent and uninstall()
restores every attribute it changed, in reverse order.
"""

from __future__ import annotations

import functools
import logging
import typing
from dataclasses import dataclass
from typing import Any

from .config_map import DISPATCHER_TYPE, DistMoEOptions

__all__ = ["install", "uninstall", "is_installed", "add_dist_moe_arguments"]

logger = logging.getLogger(__name__)

_MISSING = object()


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any   # _MISSING when the attribute did not exist in owner.__dict__


_PATCHES: list[_Patch] = []
_HOOKS = None


def is_installed() -> bool:
    return bool(_PATCHES)


def _set(owner: Any, name: str, value: Any) -> None:
    original = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    _PATCHES.append(_Patch(owner, name, original))
    setattr(owner, name, value)


# -- 1. the Literal annotation ------------------------------------------------------------------

class _FieldTypePatch:
    """Swap a dataclass field's annotation (Field.type and __annotations__) and back."""

    def __init__(self, cls: type, field_name: str, new_type: Any):
        self.field = cls.__dataclass_fields__[field_name]
        self.cls, self.field_name, self.new_type = cls, field_name, new_type
        self.old_type = self.field.type
        self.old_annotation = cls.__dict__.get("__annotations__", {}).get(field_name, _MISSING)

    def apply(self) -> None:
        self.field.type = self.new_type
        if self.old_annotation is not _MISSING:
            self.cls.__annotations__[self.field_name] = self.new_type

    def undo(self) -> None:
        self.field.type = self.old_type
        if self.old_annotation is not _MISSING:
            self.cls.__annotations__[self.field_name] = self.old_annotation


_FIELD_PATCHES: list[_FieldTypePatch] = []


def _extend_dispatcher_literal() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
    choices = typing.get_args(field.type)
    if typing.get_origin(field.type) is not typing.Literal or DISPATCHER_TYPE in choices:
        return
    patch = _FieldTypePatch(TransformerConfig, "moe_token_dispatcher_type",
                            typing.Literal[(*choices, DISPATCHER_TYPE)])
    patch.apply()
    _FIELD_PATCHES.append(patch)


# -- 2. Megatron-LM argument parser ---------------------------------------------------------------

def add_dist_moe_arguments(parser):
    """Add 'dist_moe' to --moe-token-dispatcher-type's choices and the --dist-moe-* options."""
    for action in parser._actions:
        if action.dest == "moe_token_dispatcher_type" and action.choices is not None:
            if DISPATCHER_TYPE not in action.choices:
                action.choices = (*action.choices, DISPATCHER_TYPE)
    if any(a.dest == "dist_moe_backend" for a in parser._actions):
        return parser
    group = parser.add_argument_group(title="dist_moe (megatron_dist_moe plugin)")
    d = DistMoEOptions()
    group.add_argument("--dist-moe-backend", choices=["auto", "reference", "cuda"], default=None,
                       help=f"Dist-MoE backend (default {d.backend}: cuda on sm_90+, else "
                            "reference)")
    group.add_argument("--dist-moe-activation-slot-capacity-factor", type=float, default=None,
                       help="activation slot size between inputs-only (0) and balanced full "
                            "state (1); default 1, or 0 with --recompute-modules moe")
    group.add_argument("--dist-moe-device-scratch-capacity-factor", type=float, default=None,
                       help=f"device scratch rows as a multiple of T x K (default "
                            f"{d.device_scratch_capacity_factor})")
    group.add_argument("--dist-moe-host-scratch-capacity-factor", type=float, default=None,
                       help="total (device + pinned host) scratch factor for routing skew")
    group.add_argument("--dist-moe-wgrad-dtype", choices=["fp32", "bf16"], default=None,
                       help=f"expert weight-gradient accumulation dtype (default {d.wgrad_dtype})")
    group.add_argument("--dist-moe-save-route-outputs", type=int, choices=[0, 1], default=None,
                       help="0 (default): the experts compute the score gradients, a third "
                            "less saved state per layer; 1: a full-save layer keeps its route "
                            "outputs for them")
    group.add_argument("--dist-moe-num-local-input-tokens", type=int, default=None,
                       help="token rows per rank per MoE layer (default seq_length x "
                            "micro_batch_size / CP, / TP with --sequence-parallel)")
    return parser


def _wrap_add_megatron_arguments() -> None:
    try:
        from megatron.training import arguments
    except Exception as e:   # megatron-core only: no Megatron-LM training loop to patch
        logger.debug("dist_moe: megatron.training unavailable (%s); skipping argparse patch", e)
        return
    original = arguments.add_megatron_arguments

    @functools.wraps(original)
    def add_megatron_arguments(parser, *args, **kwargs):
        return add_dist_moe_arguments(original(parser, *args, **kwargs))

    _set(arguments, "add_megatron_arguments", add_megatron_arguments)


# -- 3. MoELayer construction -----------------------------------------------------------------

def _redirect_moe_layer() -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original = MoELayer.__init__

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if type(self) is MoELayer and getattr(config, "moe_token_dispatcher_type",
                                              None) == DISPATCHER_TYPE:
            from .layer import DistMoELayer

            # The instance is still empty: make it a DistMoELayer (a subclass, same layout) and
            # build it as one. Patching __init__ rather than __new__ keeps uninstall() exact
            # (CPython cannot restore a class's original tp_new once __new__ was assigned).
            self.__class__ = DistMoELayer
            DistMoELayer.__init__(self, config, *args, **kwargs)
            return
        original(self, config, *args, **kwargs)

    _set(MoELayer, "__init__", __init__)


# -- 4. pipeline schedules --------------------------------------------------------------------

def _wrap_schedules() -> None:
    global _HOOKS
    from megatron.core.pipeline_parallel import schedules

    from .pipeline_slots import SlotHooks
    from .runtime import get_runtime

    _HOOKS = SlotHooks(get_runtime())
    _set(schedules, "forward_step", _HOOKS.wrap_forward_step(schedules.forward_step))
    _set(schedules, "backward_step", _HOOKS.wrap_backward_step(schedules.backward_step))
    for name, kind in (("forward_backward_no_pipelining", "no_pipelining"),
                       ("forward_backward_pipelining_without_interleaving", "1f1b"),
                       ("forward_backward_pipelining_with_interleaving", "interleaved")):
        _set(schedules, name, _HOOKS.wrap_schedule(getattr(schedules, name), kind))


def slot_hooks():
    """The SlotHooks instance installed into Megatron's schedules (None when not installed)."""
    return _HOOKS


# -- install / uninstall ----------------------------------------------------------------------

def install(options: DistMoEOptions | None = None) -> None:
    """Apply every patch once (idempotent). Imports Megatron-Core; see the module docstring.

    `options` (DistMoEOptions) become the default of every dist_moe layer built afterwards,
    taking precedence over Megatron-LM's --dist-moe-* flags.
    """
    from .runtime import get_runtime

    if options is not None:
        get_runtime().options = options
    if _PATCHES or _FIELD_PATCHES:
        return
    try:
        _extend_dispatcher_literal()
        _wrap_add_megatron_arguments()
        _redirect_moe_layer()
        _wrap_schedules()
    except BaseException:
        uninstall()
        raise
    logger.info("megatron_dist_moe: moe_token_dispatcher_type='%s' installed", DISPATCHER_TYPE)


def uninstall() -> None:
    """Undo install(): restore every patched attribute; close the plugin's contexts."""
    global _HOOKS
    while _PATCHES:
        p = _PATCHES.pop()
        if p.original is _MISSING:
            delattr(p.owner, p.name)
        else:
            setattr(p.owner, p.name, p.original)
    while _FIELD_PATCHES:
        _FIELD_PATCHES.pop().undo()
    _HOOKS = None
    from .runtime import get_runtime

    get_runtime().close_all()
    get_runtime().options = None


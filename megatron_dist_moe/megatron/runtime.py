"""The process-wide owner of the Dist-MoE contexts used by DistMoELayer instances.

One Context serves every dist_moe layer of the same shape on the same EP group: all MoE layers
of a model chunk stack their saved state in one activation slot, and the pipeline hooks pick
the slot per (virtual stage, microbatch). Contexts are created lazily at a layer's first forward
(a collective over the EP group: every EP rank runs the same layer at the same step) and
re-created, again at a layer forward, when the pipeline schedule needs more slots or more layers
per slot than the existing context was built for.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from .. import Config

__all__ = ["DistMoERuntime", "get_runtime"]

logger = logging.getLogger(__name__)


class DistMoERuntime:
    """Contexts, slot plan and slot selection shared by all dist_moe layers of this process."""

    def __init__(self) -> None:
        self._layers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._contexts: dict[tuple, Any] = {}
        self._planned_slots = 1
        self._planned_layers: int | None = None
        self._selection: tuple[int, int] | None = None
        self.options = None   # DistMoEOptions set by install(options=...), else None

    # -- layers ---------------------------------------------------------------------------
    def register_layer(self, layer: Any) -> None:
        self._layers.add(layer)

    @staticmethod
    def count_layers(module: Any) -> int:
        """dist_moe layers inside `module` (a model chunk, maybe wrapped by DDP/Float16Module)."""
        if module is None or not hasattr(module, "modules"):
            return 0
        return sum(1 for m in module.modules() if getattr(m, "is_dist_moe_layer", False))

    def _layers_on_group(self, group: Any) -> int:
        return sum(1 for layer in self._layers if layer.ep_group is group)

    # -- slot plan and selection (driven by pipeline_slots.SlotHooks) ------------------------
    def plan(self, num_slots: int, max_layers: int) -> None:
        """Require at least `num_slots` slots of `max_layers` layers from now on.

        Call only between schedules (no live slot): contexts that are too small are closed here
        and re-created at the next layer forward.
        """
        self._planned_slots = max(1, num_slots)
        self._planned_layers = max(1, max_layers)
        for key, ctx in list(self._contexts.items()):
            if not self._fits(ctx.config):
                logger.info("dist_moe: re-creating context for %d slot(s) x %d layer(s)",
                            self._planned_slots, self._planned_layers)
                ctx.close()
                del self._contexts[key]

    def _fits(self, cfg: Config) -> bool:
        return (cfg.num_activation_slots >= self._planned_slots
                and (self._planned_layers is None
                     or cfg.max_moe_layers_per_activation_slot >= self._planned_layers))

    def select(self, slot: int, num_layers: int) -> None:
        self._selection = (slot, num_layers)
        for ctx in self._contexts.values():
            if not ctx.config.inference:
                ctx.select_activation_slot(slot, num_layers)

    def reset(self) -> None:
        """Rewind every context's slots (after an aborted schedule)."""
        self._selection = None
        for ctx in self._contexts.values():
            if not ctx.closed:
                ctx.reset()

    # -- contexts -------------------------------------------------------------------------
    def context_for(self, layer: Any, base: Config, device: torch.device) -> Any:
        """The context serving `layer` for the shape in `base` (slots/layers filled in here)."""
        import megatron_dist_moe as dm

        key = (id(layer.ep_group), device, base.replace(num_activation_slots=1,
                                                        max_moe_layers_per_activation_slot=1))
        ctx = self._contexts.get(key)
        if ctx is not None and not ctx.closed and self._fits(ctx.config):
            return ctx
        if ctx is not None and not ctx.closed:
            ctx.close()
        layers = self._planned_layers or self._layers_on_group(layer.ep_group) or 1
        cfg = base.replace(num_activation_slots=self._planned_slots,
                           max_moe_layers_per_activation_slot=layers)
        ctx = dm.create_context(group=layer.ep_group, config=cfg, device=device)
        self._contexts[key] = ctx
        if self._selection is not None:
            slot, n = self._selection
            ctx.select_activation_slot(slot, min(n, layers))
        return ctx

    def contexts(self) -> list[Any]:
        return list(self._contexts.values())

    def close_all(self) -> None:
        """Free every context (after training; the next forward creates new ones)."""
        for ctx in self._contexts.values():
            ctx.close()
        self._contexts.clear()
        self._selection = None
        self._planned_slots, self._planned_layers = 1, None


_RUNTIME = DistMoERuntime()


def get_runtime() -> DistMoERuntime:
    return _RUNTIME

"""Context: the reusable per-EP-group state of Dist-MoE (buffers, planner state, backend).

A Context owns the memory plan, the planner state (slot cursors) and one backend instance
(reference or CUDA) that owns the actual buffers. Creation is collective over the EP group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .config import Config, ConfigError
from .memory_plan import MemoryPlan, plan_memory
from .planner import PlannerState

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = ["Context", "create_context", "resolve_backend"]


def resolve_backend(config: Config, device: torch.device) -> str:
    """'reference' or 'cuda' for this config and device ('auto' picks cuda on sm_90+)."""
    if config.backend != "auto":
        if config.backend == "cuda" and device.type != "cuda":
            raise ConfigError("backend", f"backend='cuda' needs a CUDA device, got {device}")
        return config.backend
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        return "cuda"
    return "reference"


class Context:
    """Per-EP-group state. Use through create_context(); close() (or `with`) frees everything.

    Attributes:
        config, plan, group, rank, ep_size, device, num_local_experts
        planner: PlannerState (device tensors: cursors, saved bytes, positions, selector)
        backend: the backend instance serving routed_experts on this context
    """

    def __init__(self, group, config: Config, device: torch.device, plan: MemoryPlan,
                 backend_name: str):
        self.group = group
        self.config = config
        self.device = device
        self.plan = plan
        self.rank = dist.get_rank(group)
        self.ep_size = dist.get_world_size(group)
        self.num_local_experts = plan.num_local_experts
        self.planner = PlannerState.create(plan, device)
        self._closed = False
        if backend_name == "reference":
            from .backends.reference import ReferenceBackend
            self.backend: Backend = ReferenceBackend(self)
        else:
            from .backends.cuda import CudaBackend
            self.backend = CudaBackend(self)

    # -- slots ------------------------------------------------------------------------------
    def select_activation_slot(self, slot: int, num_moe_layers_in_slot: int) -> None:
        """Make `slot` the one the next layer forwards save into, planned for that many layers.

        The framework (e.g. the Megatron pipeline hooks) calls this before each (stage,
        microbatch) forward. Backwards do not need it: each forward keeps its own slot id.
        """
        self._check_open()
        N = self.config.num_activation_slots
        L = self.config.max_moe_layers_per_activation_slot
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < N:
            raise ValueError(f"select_activation_slot(slot): {slot!r} is not in [0, "
                             f"num_activation_slots={N})")
        if (isinstance(num_moe_layers_in_slot, bool) or not isinstance(num_moe_layers_in_slot, int)
                or not 1 <= num_moe_layers_in_slot <= L):
            raise ValueError(f"select_activation_slot(num_moe_layers_in_slot): "
                             f"{num_moe_layers_in_slot!r} is not in [1, "
                             f"max_moe_layers_per_activation_slot={L}]")
        self.planner.select(slot, num_moe_layers_in_slot)

    def reset(self) -> None:
        """Rewind every slot cursor (after an aborted schedule, once no backward owns state)."""
        self._check_open()
        self.planner.reset(self.plan)
        self.backend.reset()

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Free every buffer. Call after all execution and graph replays have finished."""
        if self._closed:
            return
        self.backend.close()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Dist-MoE context is closed")

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Context(backend={self.backend.name}, rank={self.rank}/{self.ep_size}, "
                f"device={self.device}, E_local={self.num_local_experts})")


def create_context(group=None, config: Config | None = None,
                   device: torch.device | str | int | None = None) -> Context:
    """Create a Dist-MoE context on the EP process group `group` (collective).

    Args:
        group:  EP process group (None = the default group).
        config: the layer family's Config.
        device: torch device for buffers and inputs (default: the current CUDA device when one is
                present, else CPU).
    """
    if not isinstance(config, Config):
        raise TypeError(f"create_context(config): expected a megatron_dist_moe.Config, got "
                        f"{type(config).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("create_context: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first")
    if group is None:
        group = dist.group.WORLD
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ep = dist.get_world_size(group)
    plan = plan_memory(config, ep_size=ep)
    return Context(group, config, device, plan, resolve_backend(config, device))

"""Context: the reusable per-EP-group state of Dist-MoE (buffers, planner state, backend).

A Context owns the memory plan, the planner state (slot cursors) and one backend instance
(reference or CUDA) that owns the actual buffers. Creation is collective over the EP group.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .config import Config, ConfigError
from .memory_plan import MemoryPlan, plan_memory
from .planner import PlannerState

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = ["Context", "create_context", "resolve_backend", "context_from_id"]

# Open contexts by Context.id, so registered ops (library.py) can name a context with an int.
# Weak: the registry never keeps a context alive; close() unregisters eagerly.
_CONTEXTS: "weakref.WeakValueDictionary[int, Context]" = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)


def context_from_id(ctx_id: int) -> "Context":
    """The open Context whose `id` is ctx_id (this process only).

    Raises RoutedExpertsInputError naming `ctx` when it was closed or never existed here.
    """
    ctx = _CONTEXTS.get(int(ctx_id))
    if ctx is None or ctx.closed:
        from .ops import RoutedExpertsInputError

        raise RoutedExpertsInputError(
            "ctx", f"no open Dist-MoE context has id {ctx_id} in this process (it was closed, "
            "or the id comes from another process); create a new context")
    return ctx


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
        id:      int unique in this process; the registered ops (library.py) name the context
                 by it (graphs traced with make_fx hold this int, not the object)
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
        # routed_experts(wgrad_into=...): set right before the forward op, taken by it (library)
        self._pending_wgrad_into = None
        # Saved state of training forwards awaiting their backward: saved id -> (token, saved).
        # See _stash_saved / _pop_saved; the lock guards against finalizers on other threads.
        self._saved: dict[int, tuple[object, Any]] = {}
        self._saved_lock = threading.Lock()
        self._last_stashed: tuple[weakref.ref, int] | None = None
        self.id = next(_NEXT_ID)
        if backend_name == "reference":
            from .backends.reference import ReferenceBackend
            self.backend: Backend = ReferenceBackend(self)
        else:
            from .backends.cuda import CudaBackend
            self.backend = CudaBackend(self)
        _CONTEXTS[self.id] = self

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
        """Rewind every slot cursor (after an aborted schedule, once no backward owns state).

        Also drops every saved state still waiting for a backward: such a backward would fail.
        """
        self._check_open()
        self.planner.reset(self.plan)
        self.backend.reset()
        with self._saved_lock:
            self._saved.clear()
            self._last_stashed = None

    # -- saved state of training forwards (used by library.py) --------------------------------
    @property
    def num_pending_backwards(self) -> int:
        """Training forwards whose saved state still waits for its backward."""
        return len(self._saved)

    def _stash_saved(self, saved: Any) -> torch.Tensor:
        """Keep a training forward's `saved` object; return its saved id: a 0-d int64 CPU tensor.

        Ids are the lowest free integers (like file descriptors), so equal call sequences give
        equal ids. The entry leaves the table when a backward pops it, on reset()/close(), or
        when the returned tensor is freed without a backward (e.g. an autograd graph dropped
        before backward): the saved state then dies with its graph, as autograd state would.
        The planner cursor of such a forward stays advanced; ctx.reset() rewinds it.
        """
        token = object()
        with self._saved_lock:
            sid = 0
            while sid in self._saved:
                sid += 1
            self._saved[sid] = (token, saved)
        saved_id = torch.tensor(sid, dtype=torch.int64)
        weakref.finalize(saved_id, _release_saved, weakref.ref(self), sid, token)
        self._last_stashed = (weakref.ref(saved_id), sid)
        return saved_id

    def _pop_saved(self, sid: int) -> Any:
        """Remove and return the saved object of saved id `sid` (RuntimeError when absent)."""
        with self._saved_lock:
            entry = self._saved.pop(sid, None)
        if entry is None:
            raise RuntimeError(
                f"routed_experts: no saved state with id {sid} on this context: backward ran "
                "twice through the same graph (saved state is released after the first "
                "backward), or ctx.reset() dropped it")
        return entry[1]

    def _take_last_stashed(self, saved_id: torch.Tensor) -> Any:
        """The saved object stashed with exactly this saved-id tensor (None otherwise)."""
        last, self._last_stashed = self._last_stashed, None
        if last is None or last[0]() is not saved_id:
            return None
        entry = self._saved.get(last[1])
        return None if entry is None else entry[1]

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Free every buffer. Call after all execution and graph replays have finished."""
        if self._closed:
            return
        self.backend.close()
        self._closed = True
        _CONTEXTS.pop(self.id, None)
        with self._saved_lock:
            self._saved.clear()
            self._last_stashed = None

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


def _release_saved(ctx_ref: "weakref.ref[Context]", sid: int, token: object) -> None:
    """Finalizer of a saved-id tensor: drop its entry unless a backward already popped it (the
    token check keeps a later forward that reused the same id safe)."""
    ctx = ctx_ref()
    if ctx is None:
        return
    with ctx._saved_lock:
        entry = ctx._saved.get(sid)
        if entry is not None and entry[0] is token:
            del ctx._saved[sid]


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

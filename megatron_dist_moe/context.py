"""Context: the reusable per-EP-group state of Dist-MoE (buffers, planner state, backend).

A Context owns the memory plan, the planner state (slot cursors) and one backend instance
(reference or CUDA) that owns the actual buffers. Creation is collective over the EP group.
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .config import Config, ConfigError
from .execution import Execution
from .memory_plan import MemoryPlan, check_plan_fits, plan_memory
from .planner import PlannerState
from .weight_cache import WeightCache

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = ["Context", "create_context", "context_from_id", "check_same_config"]

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
        from .errors import RoutedExpertsInputError

        raise RoutedExpertsInputError(
            "ctx", f"no open Dist-MoE context has id {ctx_id} in this process (it was closed, "
            "or the id comes from another process); create a new context")
    return ctx


def _index_arg(value, name: str) -> int:
    """An integer argument of select_activation_slot as a Python int: any integer type
    (numpy's, a 0-d integer tensor) through __index__, never a bool or a float."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"select_activation_slot({name}): expected an integer, got "
                         f"{type(value).__name__} {value!r}") from None


class Context:
    """Per-EP-group state. Use through create_context(); close() (or `with`) frees everything.

    Attributes:
        config, plan, group, rank, ep_size, device, num_local_experts
        execution: how this context runs (execution.Execution), decided at creation
        id:      int unique in this process; the registered ops (library.py) name the context
                 by it (graphs traced with make_fx hold this int, not the object)
        planner: PlannerState (device tensors: cursors, saved bytes, positions, selector)
        backend: the backend instance serving routed_experts on this context
        weight_cache: WeightCache, the quantized expert weights that routed_experts(
                 is_first_microbatch=True) keeps for later False calls (weight_cache.py);
                 emptied by close()
    """

    def __init__(self, group, config: Config, device: torch.device, plan: MemoryPlan,
                 execution: Execution):
        self.group = group
        self.config = config
        self.device = device
        self.plan = plan
        self.rank = dist.get_rank(group)
        self.ep_size = dist.get_world_size(group)
        self.num_local_experts = plan.num_local_experts
        self.execution = execution
        self.planner = PlannerState.create(plan, device)
        # quantized expert weights kept across calls (routed_experts(is_first_microbatch=...))
        self.weight_cache = WeightCache(execution.precision)
        self._closed = False
        # Saved state of training forwards awaiting their backward: saved id -> (token, saved).
        # See _stash_saved / _pop_saved; the lock guards against finalizers on other threads.
        self._saved: dict[int, tuple[object, Any]] = {}
        self._saved_lock = threading.Lock()
        self._last_stashed: tuple[weakref.ref, int] | None = None
        self.id = next(_NEXT_ID)
        from .backends import make_backend

        self.backend: Backend = make_backend(self, execution)
        _CONTEXTS[self.id] = self

    # -- slots ------------------------------------------------------------------------------
    def select_activation_slot(self, slot: int, num_moe_layers_in_slot: int) -> None:
        """Make `slot` the one the next layer forwards save into, planned for that many layers.

        The framework (e.g. the Megatron pipeline hooks) calls this before each (stage,
        microbatch) forward. Backwards do not need it: each forward keeps its own slot id.
        """
        self._check_open("select_activation_slot")
        N = self.config.num_activation_slots
        L = self.config.max_moe_layers_per_activation_slot
        slot = _index_arg(slot, "slot")
        if not 0 <= slot < N:
            raise ValueError(f"select_activation_slot(slot): {slot!r} is not in [0, "
                             f"num_activation_slots={N})")
        num_moe_layers_in_slot = _index_arg(num_moe_layers_in_slot, "num_moe_layers_in_slot")
        if not 1 <= num_moe_layers_in_slot <= L:
            raise ValueError(f"select_activation_slot(num_moe_layers_in_slot): "
                             f"{num_moe_layers_in_slot!r} is not in [1, "
                             f"max_moe_layers_per_activation_slot={L}]")
        self.planner.select(slot, num_moe_layers_in_slot)

    def reset(self) -> None:
        """Rewind every slot cursor (after an aborted schedule, once no backward owns state).

        Also drops every saved state still waiting for a backward: such a backward would fail.
        """
        self._check_open("reset")
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
        self.weight_cache.clear()
        self._closed = True
        _CONTEXTS.pop(self.id, None)
        with self._saved_lock:
            self._saved.clear()
            self._last_stashed = None

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, method: str) -> None:
        # a ValueError naming the call, as routed_experts(ctx) raises on a closed context
        if self._closed:
            raise ValueError(f"{method}(ctx): this Dist-MoE context is closed; create a new one")

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def explain(self) -> str:
        """The memory plan and how this context executes (what runs, which kernels)."""
        ex, cfg = self.execution, self.config
        tiles = None
        if ex.backend == "cuda":
            from .kernels.grouped_gemm.choice import gemm_tiles
            tiles = gemm_tiles(ex, self.plan.total_scratch_rows, self.num_local_experts,
                               cfg.hidden_dim, cfg.intermediate_dim, self.device)
        return f"{self.plan.explain()}\n\n{ex.explain(tiles)}"

    def __repr__(self) -> str:
        ex = self.execution
        extra = f", pipeline={ex.pipeline}" if ex.backend == "cuda" else ""
        return (f"Context(backend={ex.backend}, precision={ex.precision}{extra}, "
                f"{'inference' if ex.inference else 'training'}, rank={self.rank}/"
                f"{self.ep_size}, device={self.device}, E_local={self.num_local_experts})")


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


def check_same_config(config: Config, group) -> None:
    """Raise ConfigError on every rank when the ranks of `group` hold different Configs, naming
    the differing fields and each rank's value (collective, host-side: at context creation)."""
    mine = config.to_dict()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    differ = sorted({k for d in everyone for k in mine if d.get(k) != mine.get(k)}
                    | {k for d in everyone for k in d if k not in mine})
    if not differ:
        return
    parts = []
    for k in differ[:6]:
        values = ", ".join(f"rank {r}: {d.get(k)!r}" for r, d in enumerate(everyone))
        parts.append(f"{k} ({values})")
    more = f" and {len(differ) - 6} more" if len(differ) > 6 else ""
    raise ConfigError(differ[0], "every rank of the EP group must pass the same Config; they "
                      f"differ in {'; '.join(parts)}{more}")


def _device_total_bytes(device: torch.device) -> int | None:
    """The device's memory in all (None for a CPU device: the host allocator decides)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def create_context(group=None, config: Config | None = None,
                   device: torch.device | str | int | None = None, *,
                   execution_overrides: dict | None = None) -> Context:
    """Create a Dist-MoE context on the EP process group `group` (collective).

    Args:
        group:  EP process group (None = the default group).
        config: the layer family's Config; every rank must pass the same one (checked).
        device: torch device for buffers and inputs (default: the current CUDA device when one is
                present, else CPU).
        execution_overrides: development only: select the CUDA backend's plain-torch twins
                (execution.OVERRIDES, e.g. {"gemm_engine": "torch"}); see execution.py.
    """
    if not isinstance(config, Config):
        raise TypeError(f"create_context(config): expected a megatron_dist_moe.Config, got "
                        f"{type(config).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("create_context: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first")
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"create_context(group): expected a torch.distributed ProcessGroup or "
                        f"None (the default group), got {type(group).__name__} {group!r}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ep = dist.get_world_size(group)
    if ep > 1:
        check_same_config(config, group)
    plan = plan_memory(config, ep_size=ep)
    # every rank's device memory in all against the plan, so that every rank raises alike (-1:
    # a rank that could not read it, which raises its own error after the exchange)
    try:
        mine, error = _device_total_bytes(device), None
    except (RuntimeError, AssertionError, ValueError) as e:
        mine, error = -1, e
    everyone = [mine]
    if ep > 1:
        everyone = [None] * ep
        dist.all_gather_object(everyone, mine, group=group)
    if error is not None:
        raise error
    if -1 in everyone:
        raise RuntimeError(f"create_context: rank(s) {[r for r, b in enumerate(everyone) if b == -1]}"
                           " could not read their device's memory (their own errors say why)")
    check_plan_fits(plan, everyone)
    from .kernels.grouped_gemm import nvfp4_decode
    from .kernels import quant_fp8_cuda
    from .kernels.grouped_gemm_sm90 import fp8_gemm_loads
    execution = Execution.resolve(config, device, execution_overrides,
                                  cutlass_loads=fp8_gemm_loads, nvfp4_loads=nvfp4_decode.loads,
                                  fp8_quant_loads=quant_fp8_cuda.loads, ep_size=ep)
    if ep > 1:
        from .execution import agree_engines
        execution = agree_engines(execution, group)
    return Context(group, config, device, plan, execution)

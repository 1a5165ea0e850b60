"""Activation slots for pipeline-parallel schedules: pure slot assignment and Megatron hooks.

A Dist-MoE context keeps the saved state of the MoE layers of one (virtual stage, microbatch)
forward in one *activation slot* until that microbatch's backward has run. A pipeline schedule
keeps several forwards in flight, so each lifetime [forward, backward] needs its own slot while
it overlaps another. Assigning slots is interval colouring on the schedule's action order: a
forward takes the lowest slot whose previous owner has finished its backward. The number of
slots to allocate is the peak number of live lifetimes.

Pure part (no torch, no Megatron): `Action`, `assign_slots`, `peak_live_slots` and generators
that reproduce, for one pipeline rank, the order in which Megatron-Core 0.19 runs forward and
backward steps:

    schedule_no_pipelining(M)                       forward_backward_no_pipelining
    schedule_1f1b(M, pp_size, pp_rank)              forward_backward_pipelining_without_interleaving
    schedule_interleaved_1f1b(M, pp_size, pp_rank, vp_size, group_size)
                                                    forward_backward_pipelining_with_interleaving

Hook part: `SlotHooks` wraps Megatron's `schedules.forward_step` / `schedules.backward_step` and
the three schedule functions (installed by `megatron_dist_moe.megatron.install()`): it plans the
slot count before a schedule runs, selects a slot before every forward (and before every backward,
so activation recomputation inside backward saves into the right slot), releases it after the
backward, and resets every slot when a schedule raises.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Sequence

__all__ = [
    "Action",
    "SlotAssignment",
    "ScheduleError",
    "assign_slots",
    "peak_live_slots",
    "peak_live_microbatches",
    "SlotMemory",
    "slot_memory",
    "schedule_no_pipelining",
    "schedule_1f1b",
    "schedule_interleaved_1f1b",
    "schedule_for_rank",
    "SlotAllocator",
    "SlotHooks",
]

logger = logging.getLogger(__name__)


class ScheduleError(ValueError):
    """A schedule is malformed (backward before forward, a lifetime run twice, ...)."""


@dataclass(frozen=True)
class Action:
    """One step of a pipeline rank's schedule.

    kind:        "F" (forward) or "B" (backward)
    vstage:      model chunk (virtual pipeline stage) index on this rank, 0-based
    microbatch:  microbatch index within the chunk, 0-based
    """

    kind: Literal["F", "B"]
    vstage: int
    microbatch: int

    @property
    def lifetime(self) -> tuple[int, int]:
        return (self.vstage, self.microbatch)

    def __str__(self) -> str:
        return f"{self.kind}{self.vstage}.{self.microbatch}"


def F(vstage: int, microbatch: int) -> Action:
    return Action("F", vstage, microbatch)


def B(vstage: int, microbatch: int) -> Action:
    return Action("B", vstage, microbatch)


@dataclass(frozen=True)
class SlotAssignment:
    """Result of `assign_slots`.

    slots:         {(vstage, microbatch): slot} for every lifetime of the schedule
    peak:          the largest number of lifetimes alive at once (= slots to allocate)
    live_after:    live lifetimes after each action, aligned with the schedule
    """

    slots: dict[tuple[int, int], int]
    peak: int
    live_after: tuple[int, ...]

    @property
    def num_slots(self) -> int:
        """Distinct slots used; equals `peak` for lowest-free colouring of intervals."""
        return 1 + max(self.slots.values()) if self.slots else 0


class SlotAllocator:
    """Online lowest-free slot allocation; what the hooks run step by step.

    `assign_slots` is this allocator run over a whole schedule, so the pure function and the
    hooks agree by construction.
    """

    def __init__(self) -> None:
        self._owner: dict[tuple[int, int], int] = {}   # lifetime -> slot
        self._free: list[int] = []                     # freed slots below the high-water mark
        self._next = 0                                 # high-water mark
        self.peak = 0

    @property
    def live(self) -> int:
        return len(self._owner)

    def owner_slot(self, lifetime: tuple[int, int]) -> int | None:
        return self._owner.get(lifetime)

    def acquire(self, lifetime: tuple[int, int]) -> int:
        if lifetime in self._owner:
            raise ScheduleError(f"forward of (vstage, microbatch)={lifetime} while its previous "
                                f"forward still holds slot {self._owner[lifetime]}")
        if self._free:
            self._free.sort()
            slot = self._free.pop(0)
        else:
            slot = self._next
            self._next += 1
        self._owner[lifetime] = slot
        self.peak = max(self.peak, len(self._owner))
        return slot

    def release(self, lifetime: tuple[int, int]) -> int:
        if lifetime not in self._owner:
            raise ScheduleError(f"backward of (vstage, microbatch)={lifetime} has no forward "
                                "holding a slot")
        slot = self._owner.pop(lifetime)
        self._free.append(slot)
        return slot

    def reset(self) -> None:
        self._owner.clear()
        self._free.clear()
        self._next = 0


def assign_slots(schedule: Iterable[Action]) -> SlotAssignment:
    """Colour the [forward, backward] lifetimes of `schedule` with the lowest free slot.

    Every lifetime must appear as exactly one "F" followed later by exactly one "B". Raises
    ScheduleError otherwise, and when a lifetime is still live at the end of the schedule.
    """
    alloc = SlotAllocator()
    slots: dict[tuple[int, int], int] = {}
    live_after = []
    seen_backward: set[tuple[int, int]] = set()
    for step, action in enumerate(schedule):
        if action.kind == "F":
            if action.lifetime in slots:
                raise ScheduleError(f"step {step} ({action}): lifetime {action.lifetime} "
                                    "forwarded twice")
            slots[action.lifetime] = alloc.acquire(action.lifetime)
        elif action.kind == "B":
            if action.lifetime in seen_backward:
                raise ScheduleError(f"step {step} ({action}): lifetime {action.lifetime} "
                                    "backwarded twice")
            if action.lifetime not in slots:
                raise ScheduleError(f"step {step} ({action}): backward before forward")
            alloc.release(action.lifetime)
            seen_backward.add(action.lifetime)
        else:
            raise ScheduleError(f"step {step}: unknown action kind {action.kind!r}")
        live_after.append(alloc.live)
    if alloc.live:
        pending = sorted(set(slots) - seen_backward)
        raise ScheduleError(f"lifetimes {pending} are forwarded but never backwarded")
    return SlotAssignment(slots=slots, peak=alloc.peak, live_after=tuple(live_after))


def peak_live_slots(schedule: Iterable[Action]) -> int:
    """The number of activation slots `schedule` needs (peak live lifetimes)."""
    return assign_slots(schedule).peak


def peak_live_microbatches(schedule: Iterable[Action]) -> int:
    """Peak number of whole-microbatch lifetimes alive at once: microbatch m is live from the
    first forward of any of its local stages to the last backward of its local stages."""
    actions = list(schedule)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for step, a in enumerate(actions):
        if a.kind == "F":
            first.setdefault(a.microbatch, step)
        else:
            last[a.microbatch] = step
    peak = 0
    for step in range(len(actions)):
        live = sum(1 for m in first if first[m] <= step < last.get(m, len(actions)))
        peak = max(peak, live)
    return peak


@dataclass(frozen=True)
class SlotMemory:
    """Saved-state capacity one pipeline rank needs under the two slot policies (guide §06)."""

    stage_slots: int                 # peak live (virtual stage, microbatch) lifetimes
    stage_slot_layers: int           # MoE layers one stage slot holds
    microbatch_slots: int            # peak live whole-microbatch lifetimes
    microbatch_slot_layers: int      # MoE layers one whole-microbatch slot holds
    bytes_per_layer: int

    @property
    def stage_bytes(self) -> int:
        return self.stage_slots * self.stage_slot_layers * self.bytes_per_layer

    @property
    def microbatch_bytes(self) -> int:
        return self.microbatch_slots * self.microbatch_slot_layers * self.bytes_per_layer


def slot_memory(num_microbatches: int, pp_size: int, pp_rank: int, vp_size: int,
                moe_layers_per_stage: int, bytes_per_layer: int) -> SlotMemory:
    """Compare stage-microbatch slots with whole-microbatch slots for one rank's schedule.

    Budget = peak live slots x layers per slot x saved bytes per layer. A stage slot holds one
    virtual stage's MoE layers; a whole-microbatch slot holds every local stage's layers, so it
    can need less memory in total even though stage slots are more numerous.
    """
    sched = schedule_for_rank(num_microbatches, pp_size, pp_rank,
                              vp_size if vp_size > 1 else None)
    return SlotMemory(stage_slots=peak_live_slots(sched), stage_slot_layers=moe_layers_per_stage,
                      microbatch_slots=peak_live_microbatches(sched),
                      microbatch_slot_layers=moe_layers_per_stage * max(vp_size, 1),
                      bytes_per_layer=bytes_per_layer)


# -- Megatron-Core schedule generators (one pipeline rank) -------------------------------------

def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def schedule_no_pipelining(num_microbatches: int) -> list[Action]:
    """forward_backward_no_pipelining: F m, B m for every microbatch, one chunk."""
    _check_positive("num_microbatches", num_microbatches)
    out: list[Action] = []
    for m in range(num_microbatches):
        out += [F(0, m), B(0, m)]
    return out


def schedule_1f1b(num_microbatches: int, pp_size: int, pp_rank: int) -> list[Action]:
    """forward_backward_pipelining_without_interleaving on pipeline rank `pp_rank`.

    Warmup: min(pp_size - pp_rank - 1, M) forwards; steady state: (F, B) pairs with the oldest
    outstanding microbatch backwarded first; cooldown: the remaining backwards.
    """
    _check_positive("num_microbatches", num_microbatches)
    _check_positive("pp_size", pp_size)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside [0, pp_size={pp_size})")
    M = num_microbatches
    warmup = min(pp_size - pp_rank - 1, M)
    out = [F(0, m) for m in range(warmup)]
    next_b = 0
    for i in range(M - warmup):
        out.append(F(0, warmup + i))
        out.append(B(0, next_b))
        next_b += 1
    out += [B(0, m) for m in range(next_b, M)]
    return out


def _interleaved_table(num_microbatches: int, num_chunks: int,
                       group_size: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) per virtual microbatch id, as Megatron's get_schedule_table builds it."""
    table = []
    for first in range(0, num_microbatches, group_size):
        last = num_microbatches if first + group_size >= num_microbatches else first + group_size
        table += [(m, c) for c in range(num_chunks) for m in range(first, last)]
    return table


def schedule_interleaved_1f1b(num_microbatches: int, pp_size: int, pp_rank: int, vp_size: int,
                              microbatch_group_size_per_vp_stage: int | None = None
                              ) -> list[Action]:
    """forward_backward_pipelining_with_interleaving on pipeline rank `pp_rank` with `vp_size`
    model chunks.

    Virtual microbatch k runs the forward of (chunk, microbatch) = table[k] and the backward of
    chunk (vp_size - 1 - table[k].chunk); a chunk's backwards follow its forwards in FIFO order.
    Warmup is (pp_size - pp_rank - 1) * 2 + (vp_size - 1) * group_size forwards (capped at
    M * vp_size); the steady state alternates F then B.
    """
    _check_positive("num_microbatches", num_microbatches)
    _check_positive("pp_size", pp_size)
    _check_positive("vp_size", vp_size)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside [0, pp_size={pp_size})")
    M = num_microbatches
    G = microbatch_group_size_per_vp_stage
    if G is None:
        G = pp_size
    if not pp_size <= G <= M:
        raise ValueError(f"microbatch_group_size_per_vp_stage={G} must lie in [pp_size={pp_size}, "
                         f"num_microbatches={M}] (Megatron raises the same)")
    if 0 < M % G < pp_size:
        raise ValueError(f"num_microbatches={M} % microbatch_group_size_per_vp_stage={G} must be 0 "
                         f"or >= pp_size={pp_size} (Megatron raises the same)")
    table = _interleaved_table(M, vp_size, G)
    total = M * vp_size
    warmup = min((pp_size - pp_rank - 1) * 2 + (vp_size - 1) * G, total)

    next_backward = [0] * vp_size   # FIFO cursor per chunk (Megatron pops input_tensors[c][0])

    def fwd(k: int) -> Action:
        m, c = table[k]
        return F(c, m)

    def bwd(k: int) -> Action:
        c = vp_size - 1 - table[k][1]
        m = next_backward[c]
        next_backward[c] += 1
        return B(c, m)

    out = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        out.append(fwd(k + warmup))
        out.append(bwd(k))
    out += [bwd(k) for k in range(total - warmup, total)]
    return out


def schedule_for_rank(num_microbatches: int, pp_size: int = 1, pp_rank: int = 0,
                      vp_size: int | None = None,
                      microbatch_group_size_per_vp_stage: int | None = None) -> list[Action]:
    """The schedule Megatron's get_forward_backward_func() picks for these sizes."""
    if pp_size > 1 and vp_size is not None and vp_size > 1:
        return schedule_interleaved_1f1b(num_microbatches, pp_size, pp_rank, vp_size,
                                         microbatch_group_size_per_vp_stage)
    if pp_size > 1:
        return schedule_1f1b(num_microbatches, pp_size, pp_rank)
    return schedule_no_pipelining(num_microbatches)


# -- hooks around Megatron's schedules ----------------------------------------------------------

class SlotHooks:
    """Drives activation-slot selection from inside Megatron's pipeline schedules.

    `runtime` is the object that owns the Dist-MoE contexts (megatron/runtime.py); it provides
    `plan(num_slots, max_layers)`, `select(slot, num_layers)`, `reset()` and
    `count_layers(module)`. Keeping it an argument keeps this class testable with a fake runtime.

    Lifetimes are identified by the output tensor object Megatron's forward_step returns: the
    schedules hand that same object back to backward_step, so no knowledge of the order is needed
    at run time; the generators above are used only to size the slots before a schedule starts.
    """

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.allocator = SlotAllocator()
        # id(forward output) -> ((vstage, microbatch), MoE layers in that chunk)
        self._by_output: dict[int, tuple[tuple[int, int], int]] = {}
        self._forward_only = False
        self._layers_per_chunk: dict[int, int] = {}
        self._anonymous = 0

    # -- schedule level -------------------------------------------------------------------
    def begin_schedule(self, kind: str, model: Any, num_microbatches: int, forward_only: bool,
                       pp_size: int, pp_rank: int, group_size: int | None) -> None:
        """Size the slots for this rank's schedule and clear any state an aborted run left."""
        if self.allocator.live or self._by_output:
            logger.warning("dist_moe: %d activation slot(s) were still live when a new schedule "
                           "started (a previous schedule was interrupted); resetting",
                           self.allocator.live)
            self.reset()
        self._forward_only = forward_only
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self._layers_per_chunk = {id(c): self.runtime.count_layers(c) for c in chunks}
        max_layers = max(self._layers_per_chunk.values(), default=0)
        if max_layers == 0 or forward_only:
            return
        vp = len(chunks) if kind == "interleaved" else None
        schedule = schedule_for_rank(num_microbatches, pp_size if kind != "no_pipelining" else 1,
                                     pp_rank if kind != "no_pipelining" else 0, vp, group_size)
        self.runtime.plan(num_slots=peak_live_slots(schedule), max_layers=max_layers)

    def end_schedule(self) -> None:
        if self.allocator.live:
            logger.warning("dist_moe: schedule finished with %d live activation slot(s); "
                           "resetting", self.allocator.live)
            self.reset()
        self.allocator.reset()

    def reset(self) -> None:
        """Forget every lifetime and rewind every context's slots (after an aborted schedule)."""
        self.allocator.reset()
        self._by_output.clear()
        self.runtime.reset()

    # -- step level -----------------------------------------------------------------------
    def before_forward(self, model: Any, vstage: int | None, microbatch: int | None,
                       grad_enabled: bool) -> tuple[tuple[int, int], int] | None:
        layers = self._layers_per_chunk.get(id(model))
        if layers is None:
            layers = self.runtime.count_layers(model)
        if not layers or self._forward_only or not grad_enabled:
            return None
        if microbatch is None:
            # Older schedules do not pass current_microbatch; any unique key works because
            # backward finds its lifetime through the output tensor.
            self._anonymous += 1
            microbatch = -self._anonymous
        lifetime = (vstage or 0, microbatch)
        slot = self.allocator.acquire(lifetime)
        self.runtime.select(slot, layers)
        return lifetime, layers

    def after_forward(self, token: tuple[tuple[int, int], int] | None, output: Any) -> None:
        if token is None:
            return
        out = output[0] if isinstance(output, (list, tuple)) else output
        requires_grad = getattr(out, "requires_grad", False)
        if out is None or not requires_grad:
            # Nothing will call backward on this lifetime (e.g. loss without grad): free it now.
            self.allocator.release(token[0])
            return
        self._by_output[id(out)] = token

    def before_backward(self, output_tensor: Any) -> tuple[int, int] | None:
        out = output_tensor[0] if isinstance(output_tensor, (list, tuple)) else output_tensor
        token = self._by_output.pop(id(out), None)
        if token is None:
            return None
        lifetime, layers = token
        slot = self.allocator.owner_slot(lifetime)
        if slot is not None:
            # Recomputation inside backward (full / selective recompute) saves into this slot.
            self.runtime.select(slot, layers)
        return lifetime

    def after_backward(self, lifetime: tuple[int, int] | None) -> None:
        if lifetime is not None:
            self.allocator.release(lifetime)

    # -- wrappers (installed onto megatron.core.pipeline_parallel.schedules) ----------------
    def wrap_forward_step(self, forward_step: Callable) -> Callable:
        hooks = self

        @functools.wraps(forward_step)
        def forward_step_with_dist_moe_slot(forward_step_func, data_iterator, model, *args,
                                            **kwargs):
            import torch

            token = hooks.before_forward(model, kwargs.get("vp_stage"),
                                         kwargs.get("current_microbatch"),
                                         torch.is_grad_enabled())
            result = forward_step(forward_step_func, data_iterator, model, *args, **kwargs)
            hooks.after_forward(token, result[0])
            return result

        return forward_step_with_dist_moe_slot

    def wrap_backward_step(self, backward_step: Callable) -> Callable:
        hooks = self

        @functools.wraps(backward_step)
        def backward_step_with_dist_moe_slot(input_tensor, output_tensor, output_tensor_grad,
                                             config, *args, **kwargs):
            lifetime = hooks.before_backward(output_tensor)
            result = backward_step(input_tensor, output_tensor, output_tensor_grad, config,
                                   *args, **kwargs)
            hooks.after_backward(lifetime)
            return result

        return backward_step_with_dist_moe_slot

    def wrap_schedule(self, schedule_fn: Callable, kind: str) -> Callable:
        """Wrap one of Megatron's forward_backward_* functions (keyword-only arguments)."""
        hooks = self

        @functools.wraps(schedule_fn)
        def schedule_with_dist_moe_slots(*args, **kwargs):
            pp_size, pp_rank, group_size = _pipeline_position(kwargs, kind)
            hooks.begin_schedule(kind, kwargs.get("model"), kwargs.get("num_microbatches", 1),
                                 bool(kwargs.get("forward_only", False)), pp_size, pp_rank,
                                 group_size)
            try:
                result = schedule_fn(*args, **kwargs)
            except BaseException:
                hooks.reset()
                raise
            hooks.end_schedule()
            return result

        return schedule_with_dist_moe_slots


def _pipeline_position(kwargs: dict, kind: str) -> tuple[int, int, int | None]:
    """(pp_size, pp_rank, microbatch_group_size_per_vp_stage) for a schedule call."""
    if kind == "no_pipelining":
        return 1, 0, None
    comm = kwargs.get("p2p_communicator")
    if comm is not None and getattr(comm, "pp_group", None) is not None:
        pp_size, pp_rank = comm.pp_group.size(), comm.pp_group.rank()
    else:
        from megatron.core import parallel_state

        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    group_size = None
    model = kwargs.get("model")
    if kind == "interleaved" and model is not None:
        from megatron.core.utils import get_model_config

        first = model[0] if isinstance(model, (list, tuple)) else model
        group_size = getattr(get_model_config(first), "microbatch_group_size_per_vp_stage", None)
    return pp_size, pp_rank, group_size


def format_schedule(schedule: Sequence[Action], assignment: SlotAssignment | None = None) -> str:
    """One line per action, with its slot when `assignment` is given (for docs and debugging)."""
    lines = []
    for a in schedule:
        slot = "" if assignment is None else f"  slot {assignment.slots[a.lifetime]}"
        lines.append(f"{a}{slot}")
    return "\n".join(lines)

"""The per-call scratch layout: where one call's temporaries live, written once for every backend.

A routed-experts call needs temporaries for the R rows its experts receive (gathered rows,
intermediates, gradients). They live in the context's scratch region, laid out per call for
the actual R and anchored at the arena END: the layout of R rows occupies
[end - total(R), end), so a call whose rows fit the device tier touches device pages only even
when a VMM arena backs lower addresses with host memory (guide §03).

    call_layout(mode, R, D, F, precision) -> CallLayout: every region's offset (bytes from the
    layout's base, end - total) and size, each align128-rounded.

Modes (what one call of that kind keeps in scratch; bf16):

    inference       x_g [R, D] | h1 [R, 2F] | h2 [R, F]
    train_forward   x_g | h1 | h2      x_g and h1 go to the activation slot instead when the
                                       planner keeps the full state (the scratch copies are
                                       then unused)
    backward        h2 [R, F] | g3 [R, D]      a layer whose full state is in its slot: h2 is
                                       rebuilt from h1 (and scaled by the route's score), g3
                                       holds the gathered output gradients
    replay          x_g | h1 | h2 | g3         a layer that kept only its input: the forward is
                                       replayed into scratch first
    (The SwiGLU backward writes grad_h1 over h1 in place, wherever h1 lives.)

Within one mode every region is live at the same time, so regions never overlap. Who uses it:
`memory_plan.plan_memory` sizes the scratch as the largest layout over the modes a context
runs at its row bound (`scratch_bytes`), the reference backend takes its scratch views from it,
and the CUDA backend's bookkeeping kernel (`kernels/bookkeeping.py`, `_call_layout`) is its
twin on the device; tests/cpu/test_layout.py holds the three equal.

Every function here takes host ints or int64 tensors for R (elementwise), so the same code runs
on the host, on CPU tensors and on device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MODES", "TRAINING_MODES", "INFERENCE_MODES", "Region", "CallLayout", "call_layout",
           "scratch_bytes", "modes_of", "region_widths"]

MODES = ("inference", "train_forward", "backward", "replay")
TRAINING_MODES = ("train_forward", "backward", "replay")
INFERENCE_MODES = ("inference",)

# (region name, width as a function of (D, F), bytes per element), in address order
_BF16_REGIONS: dict[str, tuple[tuple[str, Any, int], ...]] = {
    "inference": (("x_g", lambda D, F: D, 2), ("h1", lambda D, F: 2 * F, 2),
                  ("h2", lambda D, F: F, 2)),
    "train_forward": (("x_g", lambda D, F: D, 2), ("h1", lambda D, F: 2 * F, 2),
                      ("h2", lambda D, F: F, 2)),
    "backward": (("h2", lambda D, F: F, 2), ("g3", lambda D, F: D, 2)),
    "replay": (("x_g", lambda D, F: D, 2), ("h1", lambda D, F: 2 * F, 2),
               ("h2", lambda D, F: F, 2), ("g3", lambda D, F: D, 2)),
}
_REGIONS = {"bf16": _BF16_REGIONS}


def _align128(n):
    return -(-n // 128) * 128


def modes_of(training: bool) -> tuple[str, ...]:
    """The modes a training (or an inference) context runs."""
    return TRAINING_MODES if training else INFERENCE_MODES


def region_widths(mode: str, D: int, F: int, precision: str = "bf16"
                  ) -> tuple[tuple[str, int, int], ...]:
    """(name, elements per row, bytes per element) of each region of `mode`, in address order."""
    if precision not in _REGIONS:
        raise ValueError(f"no per-call layout for precision {precision!r}; known: "
                         f"{sorted(_REGIONS)}")
    table = _REGIONS[precision]
    if mode not in table:
        raise ValueError(f"unknown layout mode {mode!r}; expected one of {MODES}")
    return tuple((name, width(D, F), size) for name, width, size in table[mode])


@dataclass(frozen=True)
class Region:
    name: str
    offset: Any       # bytes from the layout base (host int or int64 tensor)
    nbytes: Any


@dataclass(frozen=True)
class CallLayout:
    """One call's scratch regions for R rows; base = end - total."""

    mode: str
    precision: str
    regions: tuple[Region, ...]
    total: Any

    def __getitem__(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"layout mode {self.mode!r} has no region {name!r} "
                       f"(regions: {[r.name for r in self.regions]})")

    def __contains__(self, name: str) -> bool:
        return any(r.name == name for r in self.regions)

    def address(self, name: str, end):
        """Absolute address (or arena offset) of region `name` for a scratch ending at `end`."""
        return end - self.total + self[name].offset


def call_layout(mode: str, R, D: int, F: int, precision: str = "bf16") -> CallLayout:
    """The scratch layout of one call of `mode` for R received rows (host int or int64 tensor)."""
    regions, off = [], 0
    for name, width, size in region_widths(mode, D, F, precision):
        nbytes = _align128(R * width * size)
        regions.append(Region(name, off, nbytes))
        off = off + nbytes
    return CallLayout(mode, precision, tuple(regions), off)


def scratch_bytes(R, D: int, F: int, training: bool, precision: str = "bf16"):
    """Scratch bytes a context needs for R rows: the largest layout over the modes it runs."""
    totals = [call_layout(m, R, D, F, precision).total for m in modes_of(training)]
    out = totals[0]
    for t in totals[1:]:
        out = _max(out, t)
    return out


def _max(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    import torch

    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))

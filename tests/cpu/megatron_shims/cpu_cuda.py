"""Stand-ins for the CUDA calls Megatron-Core makes on its MoE/GPT training path, for CPU tests.

Megatron-Core 0.19 creates CUDA streams/events in the alltoall dispatcher, allocates router
buffers on `torch.cuda.current_device()` and forks the CUDA RNG tracker. On a CPU-only CI
machine these calls fail, so `apply()` swaps them for host equivalents *inside a spawned test
rank* (never in the pytest parent process) and returns an undo function.

The stand-ins only make the calls succeed; they do not pretend to be asynchronous. Every
numerical op still runs through torch on CPU, which is what the equivalence tests compare.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["apply"]


class _FakeStream:
    """A stream that is always idle: waits and syncs are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _FakeEvent()

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _FakeStream)

    def __hash__(self) -> int:
        return 0


class _FakeEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM = _FakeStream()


class _TorchOnCpu:
    """The torch module, except that zeros(..., device=...) allocates on CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, **kwargs)


def apply() -> "callable":
    """Patch torch.cuda's stream/event/device helpers to CPU no-ops; returns an undo callable."""
    saved = {}

    def patch(obj, name, value):
        saved[(obj, name)] = getattr(obj, name)
        setattr(obj, name, value)

    patch(torch.cuda, "Stream", _FakeStream)
    patch(torch.cuda, "Event", _FakeEvent)
    patch(torch.cuda, "current_stream", lambda device=None: _STREAM)
    patch(torch.cuda, "stream", lambda s=None: contextlib.nullcontext())
    patch(torch.cuda, "synchronize", lambda device=None: None)
    patch(torch.cuda, "current_device", lambda: "cpu")

    # The alltoall dispatcher hands its split sizes to all_to_all_single as numpy arrays only
    # after a device-to-host copy; on CPU the copy is skipped and torch rejects the tensors.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original_move = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    patch(moe_utils, "maybe_move_tensor_to_cpu", move_to_cpu)
    patch(token_dispatcher, "maybe_move_tensor_to_cpu", move_to_cpu)

    # Attention dropout forks the CUDA RNG tracker (a registry of CUDA generator states). The
    # tests run without dropout, so a fork that keeps the CPU generator is enough.
    from megatron.core.tensor_parallel import random as mp_random

    patch(mp_random.CudaRNGStatesTracker, "fork",
          lambda self, name=None: contextlib.nullcontext())

    # The schedules count tokens in `torch.zeros([], device="cuda")`: give them a torch whose
    # zeros() ignores the device (everything else is the real torch module).
    from megatron.core.pipeline_parallel import schedules

    patch(schedules, "torch", _TorchOnCpu())

    def undo():
        for (obj, name), value in saved.items():
            setattr(obj, name, value)

    return undo

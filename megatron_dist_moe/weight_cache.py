"""Quantized expert weights kept across calls: TransformerEngine's `is_first_microbatch` protocol.

fp8_block and mxfp8 GEMMs read quantized copies of the expert weights (fp8_block: E4M3 qdata
with 128 x 128 block scales, both orientations for a backward; mxfp8: the bf16 copy of the
32 x 32 tile quantization). Without a cache every forward makes them (and its backward reuses
that forward's copies). With `routed_experts(..., is_first_microbatch=...)`:

    None    quantize in this call (the default; nothing kept)
    True    quantize into this context's cache entry for these weight tensors (allocated by the
            first such call, rewritten in place by later ones: fixed addresses, so a CUDA graph
            that captured the call refreshes the entry on every replay), then run on it
    False   run on the cache entry the last True call wrote for these tensors, whatever the
            weights hold now (the weights must not have changed since: within one optimizer
            step, as TE assumes; a call without an entry raises before anything is written)

A weight version therefore is quantized once per optimizer step instead of once per microbatch.
The cache is keyed by the weight tensors' addresses and sizes, so one context serves many
layers (one entry each); each entry also holds weak references to the tensors' storages, so
a different tensor that reuses a freed address (a per-call copy from the caching allocator)
never meets another's entry: it counts as having none, and the dead entry is dropped.
Precisions without quantized weights (bf16; nvfp4's weights are already prepared) ignore the
argument. No version counter is consulted: Megatron's optimizers
write weights through `.data`, which none sees (docs/decisions.md).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .errors import RoutedExpertsInputError

__all__ = ["WeightCache", "CACHED_PRECISIONS", "weight_cache_mode"]

CACHED_PRECISIONS = ("fp8_block", "mxfp8")


def weight_cache_mode(is_first_microbatch) -> Optional[bool]:
    """The argument checked: None, True or False (a clear error for anything else)."""
    if is_first_microbatch is None or isinstance(is_first_microbatch, bool):
        return is_first_microbatch
    raise RoutedExpertsInputError(
        "is_first_microbatch", f"must be None, True or False, got {is_first_microbatch!r}")


def _identity(w13: torch.Tensor, w2: torch.Tensor) -> tuple:
    return tuple((StorageWeakRef(w.untyped_storage()), w.storage_offset()) for w in (w13, w2))


def _same(identity: tuple, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether an entry's weak references still name these tensors' live storages."""
    return all(not ref.expired() and ref.cdata == StorageWeakRef(w.untyped_storage()).cdata
               and off == w.storage_offset() for (ref, off), w in zip(identity, (w13, w2)))


def _key(w13: torch.Tensor, w2: torch.Tensor) -> tuple:
    # numel, not shape: routed_experts sees w13 as [E, 2, F, D] or [E, 2F, D], the backend as
    # the latter (a view at the same address)
    return (w13.data_ptr(), w13.numel(), w13.dtype, w2.data_ptr(), w2.numel(), w2.dtype,
            str(w13.device))


class WeightCache:
    """One context's entries: what `make` built from a weight pair, by the pair's addresses."""

    def __init__(self, precision: str):
        self.enabled = precision in CACHED_PRECISIONS
        self.precision = precision
        self._entries: dict[tuple, Any] = {}
        self.fills = 0          # True calls served (tests, explain)
        self.hits = 0           # False calls served

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, w13: torch.Tensor, w2: torch.Tensor):
        """The live entry of these tensors, or None (an entry whose tensors are gone or are
        other tensors at the same addresses is dropped)."""
        key = _key(w13, w2)
        found = self._entries.get(key)
        if found is not None and not _same(found[0], w13, w2):
            del self._entries[key]
            found = None
        return None if found is None else found[1]

    def check(self, w13: torch.Tensor, w2: torch.Tensor, mode: Optional[bool]):
        """Raise (naming is_first_microbatch) where a reuse call has no entry to reuse; return
        that entry otherwise (None where mode is not False). routed_experts runs it with the
        other checks, before anything is written, and again the registered op, for calls that
        reach it directly or through a traced graph."""
        if not self.enabled or mode is not False:
            return None
        entry = self._entry(w13, w2)
        if entry is None:
            raise RoutedExpertsInputError(
                "is_first_microbatch",
                f"is False, but no call with is_first_microbatch=True quantized these "
                f"{self.precision} expert weights (w13 {tuple(w13.shape)} at "
                f"{w13.data_ptr():#x}) on this context: pass True on each step's first "
                "microbatch (or None to quantize in every call)")
        return entry

    def resolve(self, w13: torch.Tensor, w2: torch.Tensor, mode: Optional[bool],
                make: Callable[[Any], Any]):
        """The cached weights this call runs on, or None where it quantizes its own (mode None,
        or a precision without quantized weights). True: the entry refreshed in place by
        make(entry) (make(None) allocates the first); False: the entry as the last True left it."""
        if not self.enabled or mode is None:
            return None
        if not mode:
            entry = self.check(w13, w2, mode)
            self.hits += 1
            return entry
        self._drop_dead()
        entry = make(self._entry(w13, w2))
        self._entries[_key(w13, w2)] = (_identity(w13, w2), entry)
        self.fills += 1
        return entry

    def _drop_dead(self) -> None:
        """Drop the entries whose weight tensors were freed (rebuilt or re-packed models)."""
        for key in [k for k, (ident, _) in self._entries.items()
                    if any(ref.expired() for ref, _ in ident)]:
            del self._entries[key]

    def clear(self) -> None:
        self._entries.clear()

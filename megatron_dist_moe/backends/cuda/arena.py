"""The activation arena of a CUDA context: saved-state slots followed by the shared scratch.

Kernels address the arena only through integer addresses (host ints or device int64 tensors),
so it need not be a torch tensor. Two backings behind one interface (`base`, `nbytes`, `close`):

    DeviceArena   one cudaMalloc'd tensor: [slots | device scratch]
    VmmArena      one contiguous virtual range mapped with the CUDA driver's VMM API:
                  [slots: device pages | overflow scratch: pinned host pages | hot scratch suffix:
                  device pages]. Scratch is laid out from the high end down (see
                  experts.scratch_pointers), so calls whose received rows fit the device scratch
                  bound touch device pages only; larger ones spill into host pages (correct, slower).
                  Pages are mapped at creation and stay in their tier.
"""

from __future__ import annotations

import torch

from ...memory_plan import MemoryPlan

__all__ = ["DeviceArena", "VmmArena", "make_arena"]


class DeviceArena:
    def __init__(self, nbytes: int, device: torch.device):
        self._buf = torch.empty(max(nbytes, 128), dtype=torch.uint8, device=device)
        self.base = self._buf.data_ptr()
        self.nbytes = nbytes
        self.host_bytes = 0

    def close(self) -> None:
        self._buf = None


def _check(result):
    err = result[0]
    from cuda.bindings import driver as cu
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"CUDA driver call failed: {name.decode() if name else err}")
    return result[1] if len(result) == 2 else result[1:]


class VmmArena:
    """[slots (device) | host overflow scratch (pinned host) | device scratch suffix]."""

    def __init__(self, slot_bytes: int, host_bytes: int, device_scratch_bytes: int,
                 device: torch.device):
        try:
            from cuda.bindings import driver as cu
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise RuntimeError("Config.host_scratch_capacity_factor needs the `cuda-bindings` "
                               "package (CUDA driver VMM API)") from e
        torch.cuda.init()
        dev = device.index if device.index is not None else torch.cuda.current_device()

        def prop(location_type, loc_id):
            p = cu.CUmemAllocationProp()
            p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            p.location.type = location_type
            p.location.id = loc_id
            return p

        dprop = prop(cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, dev)
        hprop = prop(cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA, 0)
        gran = max(
            _check(cu.cuMemGetAllocationGranularity(
                dprop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)),
            _check(cu.cuMemGetAllocationGranularity(
                hprop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))

        def up(n):
            return -(-max(n, 1) // gran) * gran

        # Pieces are rounded to the mapping granularity; the device suffix is rounded so that
        # the arena END stays exactly where the plan expects it relative to the scratch start.
        self._sizes = [(up(slot_bytes) if slot_bytes else 0, dprop), (up(host_bytes), hprop),
                       (up(device_scratch_bytes), dprop)]
        total = sum(s for s, _ in self._sizes)
        self._va = int(_check(cu.cuMemAddressReserve(total, gran, 0, 0)))
        self._handles, self._mapped = [], []
        off = 0
        for size, p in self._sizes:
            if size == 0:
                continue
            h = _check(cu.cuMemCreate(size, p, 0))
            self._handles.append(h)
            _check((cu.cuMemMap(self._va + off, size, 0, h, 0)[0], None))
            self._mapped.append((self._va + off, size))
            off += size
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = dev
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check((cu.cuMemSetAccess(self._va, total, [access], 1)[0], None))
        self._cu = cu
        self._total = total
        # Slots start at the plan's offset 0; scratch is anchored at the END of the range.
        slot_region = self._sizes[0][0]
        self.base = self._va
        self.nbytes = total
        self.slot_region_bytes = slot_region
        self.host_bytes = self._sizes[1][0]

    def close(self) -> None:
        cu = self._cu
        if cu is None:
            return
        torch.cuda.synchronize()
        for va, size in self._mapped:
            cu.cuMemUnmap(va, size)
        for h in self._handles:
            cu.cuMemRelease(h)
        cu.cuMemAddressFree(self._va, self._total)
        self._cu = None


def make_arena(plan: MemoryPlan, device: torch.device):
    """The arena a plan asks for: VMM with host pages when it has host overflow scratch."""
    if plan.host_scratch_bytes > 0:
        return VmmArena(plan.num_slots * plan.slot_bytes, plan.host_scratch_bytes,
                        plan.device_scratch_bytes, device)
    return DeviceArena(plan.activation_buffer_bytes, device)

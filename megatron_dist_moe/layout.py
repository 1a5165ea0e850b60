"""The per-call scratch layout and the saved-state layout, written once for every backend.

A routed-experts call needs temporaries for the R rows its experts receive (gathered rows,
intermediates, gradients, their quantized bundles). They live in the context's scratch region,
laid out per call for the actual R and anchored at the arena END: the layout of R rows occupies
[end - total(R), end), so a call whose rows fit the device tier touches device pages only even
when a VMM arena backs lower addresses with host memory (guide §03).

Every region is a table row (`RegionSpec`): bytes = align128(per_row * R + per_padded_row * Rp +
tail), Rp = `padded_rows(R, E_local)` (column bundles pad each expert's rows to a multiple of
128). An inference call's bf16 GEMM A operands (below: "+ tail") keep GEMM_A_TAIL_ROWS rows past
R, so that the GEMMs' TMA descriptors can span them: a tile's box that reaches past R then reads
rows whose results are never stored, instead of taking TMA's out-of-bounds path, which costs
more the more of a box lies outside (one H200, guide experts, W13 + W2 at 1 row per expert:
264 -> 215 µs; docs/decisions.md).

    call_layout(mode, R, D, F, precision, E_local) -> CallLayout: every region's offset (bytes
        from the layout's base, end - total) and size
    saved_regions(...) -> the full state a training forward keeps in its activation slot, in
        slot order (the route outputs follow when Config.save_route_outputs)

bf16 (2 bytes per element):

    saved           x_g [R, D] | h1 [R, 2F]
    inference       x_g + tail | h2 [R, F] + tail
                                           no h1: nothing reads it after the W13 epilogue
    train_forward   x_g | h1 | h2          x_g and h1 go to the activation slot instead when the
                                           planner keeps the full state (the scratch copies are
                                           then unused)
    backward        h2 | g3 [R, D]         h2 is rebuilt from h1 (and scaled by the route's
                                           score), g3 holds the gathered output gradients; the
                                           SwiGLU backward writes grad_h1 over h1 in place
    replay          x_g | h1 | h2 | g3     a layer that kept only its input replays its forward
                                           into scratch first

fp8_block (quant/fp8_block.py; a bundle `b` is its E4M3 data `b` then its fp32 scales `b_s`,
one per 128 values):

    saved           x_c (x_g column bundle, for the W13 WGRAD) | h1q (h1 row bundle: the SwiGLU
                    input, DeepSeek-V3's choice; h2 is rebuilt from it)
    inference       x_g | xq (x_g row bundle) | h1 (bf16) | h2q (h2 row bundle)
    train_forward   x_g | xq | x_c | h1 | h1q | h2q        (x_c and h1q: slot or scratch)
    backward        g3 | g3q | g3c | gh1 (grad_h1, bf16) | gh1q | gh1c | h2 (bf16) | h2c
                    (g3 is dead once quantized: the CUTLASS W13 DGRAD stores its dense rows
                    there; h2 first holds the W2 DGRAD's u = g3 W2)
                    x_g and g3 hold the bf16 fan-out copies the quantizer reads at EP > 1; at
                    EP = 1 the quantizer reads the token rows in place (Execution.fp8_gather),
                    and x_g holds the W2 FPROP's dense rows for the combine instead, g3 the
                    W13 DGRAD's for the route reduction (Execution.fp8_combine)
    replay          the train_forward regions, then the backward ones

mxfp8 (quant/mxfp8.py; bundles hold E8M0 bytes per 32 values: the same bytes as fp8_block's).
The GEMMs run in bf16 on the dequantized MXFP8 values, which bf16 holds exactly, so the GEMM
operands are bf16 regions holding quantized-then-dequantized values ("fake" below): rows in
place of the bf16 rows they quantize, the WGRAD operands (columns) token-major (`*_wg`):

    saved           x_c (column bundle) | h1q (row bundle), as fp8_block
    inference       x_g (fake rows after the quantization) + tail | h1 | h2q (h2's fake rows,
                    bf16) + tail
    train_forward   x_g | x_c | h1 | h1q | h2q
    backward        g3 (fake rows) | g3_wg | gh1 (h1 from h1q, then grad_h1, then its fake rows)
                    | gh1_wg | h2 | h2_wg | x_wg (from x_c)
    replay          the train_forward regions, then the backward ones

nvfp4 (inference only; quant/nvfp4.py): a row of K values is one byte row of
`nvfp4_row_bytes(K)` = align16(K/2 packed E2M1 bytes | K/16 E4M3 block scales | the row's fp32
inverse global scale), the form the source rank publishes and the experts read:

    inference       x_g (nvfp4 rows) | h1 (bf16; the dense GEMM's bf16 h2 [R, F] instead) | h2q
                    (nvfp4 rows of h2) | a16 (fp16 values of x_g, then of h2q, before their rows'
                    global scales: each GEMM's A operand decoded once). The CUDA pipeline
                    stores only each x_g and h2q row's S_dec (all its GEMMs read a16 and S_dec)

Within one mode every region is live at the same time, so regions never overlap. Who uses it:
`memory_plan.plan_memory` sizes the scratch as the largest layout over the modes a context
runs at its row bound (a training context also runs inference forwards: under no_grad and in
checkpoint recomputation) (`scratch_bytes`) and the full state from `saved_regions`; the reference
backend takes its views from it; the CUDA backend's bookkeeping kernel (kernels/bookkeeping.py)
receives these tables (`region_table`) and computes the same addresses on the device.
tests/cpu/test_layout.py holds them equal.

Every function takes host ints or int64 tensors for R (elementwise), so the same code runs on
the host, on CPU tensors and on device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MODES", "TRAINING_MODES", "INFERENCE_MODES", "RegionSpec", "Region", "CallLayout",
           "call_layout", "scratch_bytes", "modes_of", "region_specs", "saved_regions",
           "saved_offsets", "saved_bytes", "padded_rows", "nvfp4_row_bytes", "precision_modes",
           "tail_rows", "GEMM_A_TAIL_ROWS", "PRECISIONS_WITH_LAYOUT"]

MODES = ("inference", "train_forward", "backward", "replay")
TRAINING_MODES = ("train_forward", "backward", "replay")
INFERENCE_MODES = ("inference",)
BLOCK = 128   # rows per column-bundle block (quant/fp8_block.py)
# rows an inference call's bf16 GEMM A regions keep past R. What is safe is set by the GEMMs'
# descriptors (R + these rows, all inside the region); with block_m <= 128 (every tile of
# kernels/grouped_gemm/config.py) no box also needs TMA's out-of-bounds path
GEMM_A_TAIL_ROWS = 128


@dataclass(frozen=True)
class RegionSpec:
    """One region: align128(per_row * R + per_padded_row * Rp + tail) bytes."""

    name: str
    per_row: int
    per_padded_row: int = 0
    tail: int = 0

    def nbytes(self, R, Rp):
        return _align128(self.per_row * R + self.per_padded_row * Rp + self.tail)


def _bf16(name: str, width: int, tail_rows: int = 0) -> tuple[RegionSpec, ...]:
    return (RegionSpec(name, 2 * width, 0, 2 * width * tail_rows),)


def _gemm_a(name: str, width: int) -> tuple[RegionSpec, ...]:
    """A bf16 GEMM A operand of an inference call: GEMM_A_TAIL_ROWS rows of tail."""
    return _bf16(name, width, GEMM_A_TAIL_ROWS)


def _rows(name: str, width: int) -> tuple[RegionSpec, ...]:
    """An fp8 row bundle: E4M3 [R, width] and fp32 [R, width / 128]."""
    return (RegionSpec(name, width), RegionSpec(name + "_s", width // BLOCK * 4))


def _cols(name: str, width: int) -> tuple[RegionSpec, ...]:
    """An fp8 column bundle: E4M3 [width, Rp] and fp32 [Rp / 128, width]."""
    return (RegionSpec(name, 0, width), RegionSpec(name + "_s", 0, width * 4 // BLOCK))


def _bf16_specs(D: int, F: int) -> dict:
    x_g, h1, h2, g3 = _bf16("x_g", D), _bf16("h1", 2 * F), _bf16("h2", F), _bf16("g3", D)
    return dict(saved=x_g + h1, modes=dict(
        inference=_gemm_a("x_g", D) + _gemm_a("h2", F), train_forward=x_g + h1 + h2,
        backward=h2 + g3,
        replay=x_g + h1 + h2 + g3))


def _fp8_block_specs(D: int, F: int) -> dict:
    fwd_common = _bf16("x_g", D) + _rows("xq", D)
    fwd = fwd_common + _cols("x_c", D) + _bf16("h1", 2 * F) + _rows("h1q", 2 * F) + _rows("h2q", F)
    bwd = (_bf16("g3", D) + _rows("g3q", D) + _cols("g3c", D) + _bf16("gh1", 2 * F)
           + _rows("gh1q", 2 * F) + _cols("gh1c", 2 * F) + _bf16("h2", F) + _cols("h2c", F))
    return dict(saved=_cols("x_c", D) + _rows("h1q", 2 * F), modes=dict(
        inference=fwd_common + _bf16("h1", 2 * F) + _rows("h2q", F), train_forward=fwd,
        backward=bwd, replay=fwd + bwd))


def _mxfp8_specs(D: int, F: int) -> dict:
    # a bundle's E8M0 bytes (one per 32 values) take the bytes of fp8_block's fp32 scales (one
    # per 128), so _rows / _cols count both
    fwd = (_bf16("x_g", D) + _cols("x_c", D) + _bf16("h1", 2 * F) + _rows("h1q", 2 * F)
           + _bf16("h2q", F))
    bwd = (_bf16("g3", D) + _bf16("g3_wg", D) + _bf16("gh1", 2 * F) + _bf16("gh1_wg", 2 * F)
           + _bf16("h2", F) + _bf16("h2_wg", F) + _bf16("x_wg", D))
    return dict(saved=_cols("x_c", D) + _rows("h1q", 2 * F), modes=dict(
        inference=_gemm_a("x_g", D) + _bf16("h1", 2 * F) + _gemm_a("h2q", F), train_forward=fwd,
        backward=bwd, replay=fwd + bwd))


def nvfp4_row_bytes(K: int) -> int:
    """Bytes of one NVFP4 row of K values: packed values, block scales, inverse global scale,
    padded to 16 (rows stay 16-byte aligned for vector loads)."""
    return -(-(K // 2 + K // 16 + 4) // 16) * 16


def _nvfp4_specs(D: int, F: int) -> dict:
    return dict(saved=(), modes=dict(inference=(
        RegionSpec("x_g", nvfp4_row_bytes(D)),) + _bf16("h1", 2 * F) + (
        RegionSpec("h2q", nvfp4_row_bytes(F)),) + _bf16("a16", max(D, F))))


_SPECS = {"bf16": _bf16_specs, "fp8_block": _fp8_block_specs, "mxfp8": _mxfp8_specs,
          "nvfp4": _nvfp4_specs}
PRECISIONS_WITH_LAYOUT = tuple(_SPECS)


def _align128(n):
    return -(-n // 128) * 128


def padded_rows(R, num_experts: int):
    """Rows of a column bundle: each expert's rows padded to a multiple of 128, bounded by
    R + 127 E and rounded up to 128 (quant/fp8_block.padded_rows)."""
    return (R + (BLOCK - 1) * num_experts + BLOCK - 1) // BLOCK * BLOCK


def modes_of(training: bool) -> tuple[str, ...]:
    """The modes a training (or an inference) context runs: a training context runs inference
    forwards too (under no_grad, and in checkpoint recomputation)."""
    return TRAINING_MODES + INFERENCE_MODES if training else INFERENCE_MODES


def _specs(precision: str, D: int, F: int) -> dict:
    if precision not in _SPECS:
        raise ValueError(f"no per-call layout for precision {precision!r}; known: "
                         f"{sorted(_SPECS)}")
    return _SPECS[precision](D, F)


def precision_modes(precision: str) -> tuple[str, ...]:
    """The modes `precision` has a layout for (an inference-only precision: inference)."""
    return tuple(m for m in MODES if m in _specs(precision, 128, 128)["modes"])


def region_specs(mode: str, D: int, F: int, precision: str = "bf16") -> tuple[RegionSpec, ...]:
    """The regions of `mode`, in address order."""
    modes = _specs(precision, D, F)["modes"]
    if mode not in modes:
        raise ValueError(f"no layout mode {mode!r} for precision {precision!r}; it has "
                         f"{tuple(modes)} (all modes: {MODES})")
    return modes[mode]


def tail_rows(mode: str, D: int, F: int, precision: str = "bf16") -> dict:
    """{region name: rows past R} of `mode`'s regions that keep a tail (a GEMM may read those
    rows and never uses what it computes from them)."""
    return {s.name: s.tail // s.per_row for s in region_specs(mode, D, F, precision) if s.tail}


def saved_regions(D: int, F: int, precision: str = "bf16") -> tuple[RegionSpec, ...]:
    """The full state a training forward keeps in its slot, in slot order (every name is also
    a region of train_forward and replay, where a replaying layer puts it instead)."""
    return _specs(precision, D, F)["saved"]


def saved_offsets(R, D: int, F: int, precision: str = "bf16", num_experts: int = 1) -> dict:
    """{name: byte offset from the layer's slot start} of the saved regions, and "end"."""
    Rp = padded_rows(R, num_experts)
    out, off = {}, 0
    for spec in saved_regions(D, F, precision):
        out[spec.name] = off
        off = off + spec.nbytes(R, Rp)
    out["end"] = off
    return out


def saved_bytes(R, D: int, F: int, precision: str = "bf16", num_experts: int = 1):
    """Bytes of the saved regions for R rows (the full state without the route outputs)."""
    return saved_offsets(R, D, F, precision, num_experts)["end"]


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

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions)

    def address(self, name: str, end):
        """Absolute address (or arena offset) of region `name` for a scratch ending at `end`."""
        return end - self.total + self[name].offset


def call_layout(mode: str, R, D: int, F: int, precision: str = "bf16",
                num_experts: int = 1) -> CallLayout:
    """The scratch layout of one call of `mode` for R received rows (host int or int64 tensor)
    over num_experts local experts (column bundles pad per expert)."""
    Rp = padded_rows(R, num_experts)
    regions, off = [], 0
    for spec in region_specs(mode, D, F, precision):
        nbytes = spec.nbytes(R, Rp)
        regions.append(Region(spec.name, off, nbytes))
        off = off + nbytes
    return CallLayout(mode, precision, tuple(regions), off)


def scratch_bytes(R, D: int, F: int, training: bool, precision: str = "bf16",
                  num_experts: int = 1):
    """Scratch bytes a context needs for R rows: the largest layout over the modes it runs."""
    totals = [call_layout(m, R, D, F, precision, num_experts).total for m in modes_of(training)]
    out = totals[0]
    for t in totals[1:]:
        out = _max(out, t)
    return out


def _max(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    import torch

    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))

"""plan_memory(): the pure byte arithmetic behind every Dist-MoE allocation.

No CUDA call, no process group: the same numbers size the reference backend's buffers, the GPU
backend's symmetric and activation buffers, and what `python -m megatron_dist_moe plan` prints.

Notation (per rank): T input token rows, D width, F intermediate width, K routes per token,
E_local local experts, EP ranks, R routed rows received. All byte counts are align128-rounded per
tensor. The BF16 formulas follow the design guide §03-§04:

    scratch                  the largest per-call layout (layout.py) over the modes a context
                             runs, at the row bound:
                               training forward              x_g[R,D] + h1[R,2F] + h2[R,F]
                                                             = 2R(D + 3F)
                               inference forward             x_g + h2 (no h1), each with 128
                                                             rows of tail (layout.GEMM_A_TAIL_ROWS)
                                                             = 2R(D + F) + 256(D + F)
                               backward replay               x_g + h1 + h2 + g3[R,D]
                                                             = 2R(2D + 3F)
                             (g3 = gathered output gradients; the SwiGLU backward writes grad_h1
                             over h1 in place; a training context runs inference forwards too,
                             under no_grad, so its scratch holds every one of the three)
    full saved state         align(R·D·2) + align(R·2F·2) + align(T·K·D·2)    (x_g, h1, h3 routes)
                             (without the routes term when Config.save_route_outputs is False)
    mandatory saved input    align(T·D·2)                                      (x, for replay)

fp8_block (layout.py has every region): the full state is the x_g column bundle and the h1 row
bundle, (D + 2F)(1 + 1/32) bytes per row (plus each expert's padding to 128 rows in the column
bundle), about half of bf16's 2(D + 2F); the scratch holds the bf16 intermediates and their
row / column bundles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import Config, ConfigError
from .layout import call_layout, saved_bytes, scratch_bytes

__all__ = ["MemoryPlan", "plan_memory", "align128", "LayerBytes", "score_parts_count",
           "SCORE_PART_COLS", "MAX_PLAN_BYTES", "largest_field", "check_plan_fits"]

ROUTING_HEADER_BYTES = 128
# Expert-side score gradients arrive as one fp32 part per route and per W2-DGRAD n-tile; no tile
# is narrower than this, so score_parts_count(F) part slots per route always suffice.
SCORE_PART_COLS = 32


def score_parts_count(F: int) -> int:
    """fp32 part slots per route for the expert-side score gradients (see SCORE_PART_COLS)."""
    return -(-F // SCORE_PART_COLS)


# nvfp4 inference from this many rows per expert (the row bound over the local experts) decodes
# the weights once per call into fp16 (kernels/grouped_gemm/nvfp4_dense.py), in groups of
# experts within NVFP4_WEIGHT_SCRATCH_BYTES (one expert's largest weight at least): there the
# MMAs, not the weight read, set the time (docs/decisions.md)
NVFP4_DENSE_MIN_ROWS_PER_EXPERT = 768
NVFP4_WEIGHT_SCRATCH_BYTES = 256 * 2 ** 20


def nvfp4_dense(max_rows: int, num_local_experts: int) -> bool:
    """Whether nvfp4 inference at this row bound decodes the weights once per call (at least
    NVFP4_DENSE_MIN_ROWS_PER_EXPERT rows per local expert)."""
    return (num_local_experts >= 1
            and -(-max_rows // num_local_experts) >= NVFP4_DENSE_MIN_ROWS_PER_EXPERT)


def nvfp4_dense_experts(N: int, K: int, E: int) -> int:
    """Experts whose [N, K] weights are decoded (fp16) at once within the scratch bound."""
    return max(1, min(E, NVFP4_WEIGHT_SCRATCH_BYTES // (2 * N * K)))


def nvfp4_weight_scratch_bytes(config: Config, num_local_experts: int, max_rows: int) -> int:
    """Bytes of the CUDA backend's decoded-weight scratch: nvfp4 inference at a row bound of at
    least NVFP4_DENSE_MIN_ROWS_PER_EXPERT rows per local expert (else 0), one scratch serving
    W13 [E, 2F, D] and W2 [E, D, F]."""
    E, D, F = num_local_experts, config.hidden_dim, config.intermediate_dim
    if config.precision != "nvfp4" or not config.inference or not nvfp4_dense(max_rows, E):
        return 0
    return max(2 * nvfp4_dense_experts(N, K, E) * N * K for N, K in ((2 * F, D), (D, F)))


def weight_cache_bytes(config: Config, num_local_experts: int) -> int:
    """Bytes of one layer's weight cache entry (weight_cache.py): fp8_block E4M3 W13 and W2
    with fp32 128 x 128 block scales (a training context's entry holds both orientations, for
    the backward); mxfp8 their bf16 copies of the 32 x 32 tile quantization. (What the CUDA
    backend keeps; the reference backend's entry is a bf16 copy of the weights, which its
    math quantizes per call.)"""
    E, D, F = num_local_experts, config.hidden_dim, config.intermediate_dim
    mats = ((2 * F, D), (D, F))
    if config.precision == "fp8_block":
        one = sum(align128(E * n * k) + align128(E * (n // 128) * (k // 128) * 4)
                  for n, k in mats)
        return one * (1 if config.inference else 2)
    if config.precision == "mxfp8":
        return sum(align128(E * n * k * 2) for n, k in mats)
    return 0


def align128(n):
    """Round a byte count up to a multiple of 128 (a host int, or an int64 tensor elementwise)."""
    return -(-n // 128) * 128


def _fmt(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class LayerBytes:
    """Byte sizes of one layer's tensors, functions of the received rows R (host ints).

    The planner has a tensor twin of `full_state` (planner.full_state_bytes) that must agree with
    this one; tests check both on the same rows.
    """

    precision: str
    T: int
    D: int
    F: int
    K: int
    num_local_experts: int
    training: bool
    save_routes: bool = True

    # -- per-layer totals -------------------------------------------------------------------
    def input_bytes(self) -> int:
        """The mandatory saved layer input x [T, D] bf16 kept for replay."""
        return align128(self.T * self.D * 2)

    def routes_bytes(self) -> int:
        """Route outputs h3 [T, K, D] bf16 of this rank's tokens, kept for the score gradients
        (0 when Config.save_route_outputs is False: the expert side computes them)."""
        return align128(self.T * self.K * self.D * 2) if self.save_routes else 0

    def full_state(self, R: int) -> int:
        """Saved bytes when a layer keeps its full state instead of replaying: the saved
        regions of the layout (layout.saved_regions) and the route outputs."""
        return saved_bytes(R, self.D, self.F, self.precision,
                           self.num_local_experts) + self.routes_bytes()

    def forward_scratch(self, R: int) -> int:
        """Scratch of one forward call (layout.py: inference / train_forward)."""
        mode = "train_forward" if self.training else "inference"
        return call_layout(mode, R, self.D, self.F, self.precision, self.num_local_experts).total

    def inference_scratch(self, R: int) -> int:
        """Scratch of one inference forward (layout.py: inference), which a training context
        also runs under no_grad."""
        return call_layout("inference", R, self.D, self.F, self.precision,
                           self.num_local_experts).total

    def backward_peak(self, R: int) -> int:
        """Scratch of one backward call, the replayed forward included (layout.py)."""
        return max(call_layout(m, R, self.D, self.F, self.precision,
                               self.num_local_experts).total for m in ("backward", "replay"))

    def scratch(self, R: int) -> int:
        """Scratch for R rows: the largest per-call layout over the modes this context runs."""
        return scratch_bytes(R, self.D, self.F, self.training, self.precision,
                             self.num_local_experts)


@dataclass(frozen=True)
class MemoryPlan:
    """Every byte count a context allocates, derived from a Config and the EP size."""

    @property
    def route_scores_offset(self) -> int:
        """Byte offset in the routing region of the owner's published scores [T, K] fp32; the
        experts' score-gradient parts [score_parts_count(F), T, K] fp32 follow at
        + route_score_grads_delta, one slice every score_part_stride bytes. Only with
        Config.save_route_outputs False."""
        c = self.config
        return ROUTING_HEADER_BYTES + align128(c.num_local_input_tokens * c.top_k * 2)

    @property
    def route_score_grads_delta(self) -> int:
        c = self.config
        return align128(c.num_local_input_tokens * c.top_k * 4)

    @property
    def score_part_stride(self) -> int:
        """Bytes between one route's consecutive score-gradient parts (a [T, K] fp32 slice)."""
        c = self.config
        return align128(c.num_local_input_tokens * c.top_k * 4)

    @property
    def score_parts(self) -> int:
        return score_parts_count(self.config.intermediate_dim)

    config: Config
    ep_size: int
    num_local_experts: int
    layer: LayerBytes
    balanced_rows: int           # T·K
    topology_max_rows: int       # T·EP·min(K, E_local)
    device_scratch_rows: int
    total_scratch_rows: int
    input_bytes: int
    balanced_full_state_bytes: int
    slot_min_bytes: int
    slot_balanced_bytes: int
    slot_max_useful_bytes: int
    slot_bytes: int
    slot_policy: str
    device_scratch_bytes: int
    total_scratch_bytes: int
    host_scratch_bytes: int
    activation_buffer_bytes: int     # device part: slots + device scratch
    routing_bytes: int
    dispatch_bytes: int
    combine_bytes: int
    symmetric_bytes: int
    total_device_bytes: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    # what one layer's entry of the weight cache holds (routed_experts(is_first_microbatch=...),
    # weight_cache.py): allocated on the first True call for that layer's weights, not part
    # of total_device_bytes; 0 for precisions without quantized weights
    weight_cache_bytes_per_layer: int = 0
    # nvfp4 at large row bounds: the CUDA backend's decoded weights (nvfp4_weight_scratch_bytes),
    # allocated once per context, not part of total_device_bytes
    weight_scratch_bytes: int = 0

    # -- layout -----------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.config.num_activation_slots

    def slot_base(self, slot: int) -> int:
        """Byte offset of `slot` from the activation buffer base."""
        return slot * self.slot_bytes

    @property
    def scratch_offset(self) -> int:
        """Byte offset of the shared device scratch (after every slot)."""
        return self.num_slots * self.slot_bytes

    def slot_ends(self) -> list[int]:
        """buffer_offsets' initial values: each slot's base, then the scratch end."""
        return [self.slot_base(s) for s in range(self.num_slots)] + [
            self.scratch_offset + self.device_scratch_bytes]

    def explain(self) -> str:
        c = self.config
        L = c.max_moe_layers_per_activation_slot
        rows = [
            ("shape", f"T={c.num_local_input_tokens} D={c.hidden_dim} F={c.intermediate_dim} "
                      f"K={c.top_k} E={c.num_experts} (E_local={self.num_local_experts}, EP={self.ep_size})"),
            ("precision / pipeline", f"{c.precision} / {c.pipeline} / "
                                     f"{'inference' if c.inference else 'training'}"),
            ("received rows", f"balanced R=T·K={self.balanced_rows:,}; device scratch bound "
                              f"{self.device_scratch_rows:,}; total bound {self.total_scratch_rows:,}; "
                              f"topology max {self.topology_max_rows:,}"),
        ]
        out = ["Dist-MoE memory plan", "=" * 20]
        w = max(len(k) for k, _ in rows)
        out += [f"{k:<{w}}  {v}" for k, v in rows]
        out.append("")
        out.append("per layer")
        out.append(f"  saved input x[T,D]            {self.input_bytes:>16,} B  ({_fmt(self.input_bytes)})")
        out.append(f"  full state at balanced R      {self.balanced_full_state_bytes:>16,} B  "
                   f"({_fmt(self.balanced_full_state_bytes)})")
        out.append(f"  forward scratch at device R   {self.layer.forward_scratch(self.device_scratch_rows):>16,} B")
        if not c.inference:
            out.append(f"  backward peak at device R     {self.layer.backward_peak(self.device_scratch_rows):>16,} B")
            nograd = self.layer.inference_scratch(self.device_scratch_rows)
            out.append(f"  no_grad forward at device R   {nograd:>16,} B")
        if self.weight_cache_bytes_per_layer:
            b = self.weight_cache_bytes_per_layer
            out.append(f"  weight cache entry            {b:>16,} B  ({_fmt(b)}; with "
                       "is_first_microbatch, per cached layer)")
        if self.weight_scratch_bytes:
            b = self.weight_scratch_bytes
            out.append(f"  decoded-weight scratch        {b:>16,} B  ({_fmt(b)}; nvfp4 on the CUDA "
                       "backend, per context)")
        out.append("")
        if not c.inference:
            out.append(f"activation slot ({L} layer(s) per slot, {self.num_slots} slot(s), "
                       f"policy: {self.slot_policy})")
            out.append(f"  minimum (inputs only)         {self.slot_min_bytes:>16,} B  ({_fmt(self.slot_min_bytes)})")
            out.append(f"  balanced full save            {self.slot_balanced_bytes:>16,} B  "
                       f"({_fmt(self.slot_balanced_bytes)})")
            out.append(f"  maximum useful                {self.slot_max_useful_bytes:>16,} B  "
                       f"({_fmt(self.slot_max_useful_bytes)})")
            out.append(f"  chosen                        {self.slot_bytes:>16,} B  ({_fmt(self.slot_bytes)})")
            out.append("")
        out.append("allocations (per rank)")
        items = [
            ("activation slots", self.num_slots * self.slot_bytes),
            ("device scratch", self.device_scratch_bytes),
            ("host overflow scratch (VMM)", self.host_scratch_bytes),
            ("routing (symmetric)", self.routing_bytes),
            ("dispatch (symmetric)", self.dispatch_bytes),
            ("combine (symmetric)", self.combine_bytes),
            ("total device", self.total_device_bytes),
        ]
        for k, v in items:
            out.append(f"  {k:<28}  {v:>16,} B  ({_fmt(v)})")
        for n in self.notes:
            out.append(f"note: {n}")
        return "\n".join(out)


def plan_memory(config: Config, ep_size: int) -> MemoryPlan:
    """Derive every buffer size for `config` on an EP group of `ep_size` ranks (pure)."""
    if not isinstance(config, Config):
        raise TypeError(f"config must be a megatron_dist_moe.Config, got {type(config).__name__}")
    E_local = config.num_local_experts(ep_size)
    T, D, F, K = (config.num_local_input_tokens, config.hidden_dim, config.intermediate_dim,
                  config.top_k)
    training = not config.inference
    layer = LayerBytes(config.precision, T, D, F, K, E_local, training,
                       save_routes=config.save_route_outputs)
    notes: list[str] = []

    balanced = T * K
    topo = T * ep_size * min(K, E_local)
    dev_rows = min(math.ceil(config.device_scratch_capacity_factor * balanced), topo)
    if config.host_scratch_capacity_factor is not None:
        total_rows = min(math.ceil(config.host_scratch_capacity_factor * balanced), topo)
    else:
        total_rows = dev_rows
    total_rows = max(total_rows, dev_rows)

    input_bytes = layer.input_bytes()
    L = config.max_moe_layers_per_activation_slot
    if training:
        full_bal = layer.full_state(balanced)
        slot_min = L * input_bytes
        slot_bal = L * full_bal
        slot_max = L * layer.full_state(total_rows)
        if config.activation_slot_bytes is not None:
            slot = align128(config.activation_slot_bytes)
            policy = f"explicit {config.activation_slot_bytes:,} B"
            if slot < slot_min:
                raise ConfigError("activation_slot_bytes",
                                  f"{config.activation_slot_bytes:,} B is below the minimum slot "
                                  f"{slot_min:,} B ({L} layer input(s) of {input_bytes:,} B each, "
                                  f"kept for replay)")
        elif config.activation_slot_capacity_factor is not None:
            f = config.activation_slot_capacity_factor
            slot = align128(math.ceil(slot_min + f * (slot_bal - slot_min)))
            policy = f"factor {f}"
        else:
            slot = slot_min
            policy = "minimum (every layer replays)"
        if slot > slot_max:
            notes.append(f"slot {slot:,} B exceeds the maximum useful {slot_max:,} B: the excess "
                         "can never hold saved state")
    else:
        full_bal = 0
        slot_min = slot_bal = slot_max = slot = 0
        policy = "inference (no saved state)"

    dev_scratch = align128(layer.scratch(dev_rows))
    total_scratch = align128(layer.scratch(total_rows))
    host_scratch = total_scratch - dev_scratch
    act = config.num_activation_slots * slot + dev_scratch

    routing = ROUTING_HEADER_BYTES + align128(T * K * 2)
    if training and not config.save_route_outputs:
        # [T, K] fp32 scores published by the owner for the experts, and the experts' score-
        # gradient parts [score_parts_count(F), T, K] fp32 (MemoryPlan.route_scores_offset)
        routing += (1 + score_parts_count(F)) * align128(T * K * 4)
    dispatch = align128((T * K if training else T) * D * 2)
    combine = align128(T * K * D * 2)
    symmetric = routing + dispatch + combine
    if dev_rows < balanced:
        notes.append(f"device scratch holds {dev_rows:,} rows, below balanced T·K={balanced:,}: "
                     "even balanced routing will overflow")

    plan = MemoryPlan(
        config=config, ep_size=ep_size, num_local_experts=E_local, layer=layer,
        balanced_rows=balanced, topology_max_rows=topo, device_scratch_rows=dev_rows,
        total_scratch_rows=total_rows, input_bytes=input_bytes,
        balanced_full_state_bytes=full_bal, slot_min_bytes=slot_min, slot_balanced_bytes=slot_bal,
        slot_max_useful_bytes=slot_max, slot_bytes=slot, slot_policy=policy,
        device_scratch_bytes=dev_scratch, total_scratch_bytes=total_scratch,
        host_scratch_bytes=host_scratch, activation_buffer_bytes=act, routing_bytes=routing,
        dispatch_bytes=dispatch, combine_bytes=combine, symmetric_bytes=symmetric,
        total_device_bytes=act + symmetric, notes=tuple(notes),
        weight_cache_bytes_per_layer=weight_cache_bytes(config, E_local),
        weight_scratch_bytes=nvfp4_weight_scratch_bytes(config, E_local, total_rows),
    )
    if plan.total_device_bytes >= MAX_PLAN_BYTES:
        raise ConfigError(largest_field(plan), f"the plan needs {plan.total_device_bytes:,} B on "
                          f"each device ({_parts(plan)}), past the {MAX_PLAN_BYTES:,} B that the "
                          "planner's int64 byte offsets address")
    return plan


# The device planner computes byte offsets in int64 tensors (sums of a slot's layers included)
MAX_PLAN_BYTES = 2 ** 62


def _parts(plan: MemoryPlan) -> str:
    return (f"activation slots {plan.num_slots} x {_fmt(plan.slot_bytes)}, scratch "
            f"{_fmt(plan.device_scratch_bytes)}, symmetric buffers {_fmt(plan.symmetric_bytes)}")


def largest_field(plan: MemoryPlan) -> str:
    """The Config field that sizes the plan's largest part: the activation slots or the scratch
    (its capacity factor) or the token count (the symmetric buffers)."""
    cfg = plan.config
    slots = plan.num_slots * plan.slot_bytes
    if slots >= max(plan.device_scratch_bytes, plan.symmetric_bytes):
        if cfg.activation_slot_bytes is not None:
            return "activation_slot_bytes"
        if cfg.activation_slot_capacity_factor is not None:
            return "activation_slot_capacity_factor"
        return "num_activation_slots"
    if plan.device_scratch_bytes >= plan.symmetric_bytes:
        return "device_scratch_capacity_factor"
    return "num_local_input_tokens"


def check_plan_fits(plan: MemoryPlan, device_bytes: list) -> None:
    """ConfigError (on every rank: `device_bytes` holds every rank's total device memory, None
    for a CPU device) when the plan's buffers exceed some rank's device memory in all."""
    short = [(r, b) for r, b in enumerate(device_bytes) if b is not None
             and plan.total_device_bytes > b]
    if short:
        r, b = short[0]
        raise ConfigError(largest_field(plan), f"the plan needs {_fmt(plan.total_device_bytes)} "
                          f"on each device ({_parts(plan)}); rank {r}'s device has {_fmt(b)} in "
                          "all (`python -m megatron_dist_moe plan` shows where the bytes go)")

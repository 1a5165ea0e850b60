"""Device-side checks: failure codes, the one place their messages are written, bounded waits.

What the host cannot check without a synchronisation (routing values, the per-call layout, a
peer that never arrives) is checked on the device. A failed check prints its cause and the
numbers and then traps, which ends the CUDA context (and the job) with that message instead of
a wrong result or a hang. In the CPU interpreter, which cannot trap, kernels leave the verdict
in a status word instead (`(code, a, b)`; a wait's: `(code, what, rank, polls)`); the tests
read it.

    trap_on_code(code, a, b)      print the message of `code` with its numbers, then trap
    device_check(codes, a, b)     one launch: trap on the first codes[i] != 0
    wait_until_at_least(...)      spin (acquire) until a counter reaches a value, giving up
                                  after a bounded number of ~1 us polls; the verdict
                                  (CHECK_WAIT_TIMEOUT) goes to a status word
    check_status(status)          one launch after a kernel that waits: trap with the message
                                  of a status word's code

A kernel that waits does not trap itself: the printf and trap code in a GEMM's loop cost it
~0.23 ms at the guide's shapes (the claimed W13 and W2 DGRAD, docs/decisions.md), so it records
the timeout and ends, and `check_status`, stream-ordered after it, traps. Giving up is sticky:
once any program recorded a timeout, a wait that is past its busy polls stops too, so a
systemic fault ends the kernel in about one timeout, not one per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["CHECK_UNEQUAL_T", "CHECK_SCRATCH_OVERFLOW", "CHECK_BAD_EXPERT_ID",
           "CHECK_INACTIVE_SCORE", "CHECK_PEER_REJECTED", "CHECK_LAYOUT_OUTSIDE_ARENA",
           "CHECK_WAIT_TIMEOUT", "CHECK_SCHEDULE_MISMATCH", "WAIT_CLAIM_SLICES", "WAIT_MEGA_READY",
           "WAIT_STREAMK_PARTIAL", "MESSAGES",
           "trap_on_code",
           "device_check", "wait_until_at_least", "max_polls", "trap", "check_status",
           "STATUS_WORDS"]

CHECK_UNEQUAL_T = 1
CHECK_SCRATCH_OVERFLOW = 2
CHECK_BAD_EXPERT_ID = 3
CHECK_INACTIVE_SCORE = 4
CHECK_PEER_REJECTED = 5      # a peer's header says T = -1: its own input validation failed
CHECK_LAYOUT_OUTSIDE_ARENA = 6
CHECK_WAIT_TIMEOUT = 7
# a peer's routing header holds another schedule word: training or not, and for a training
# forward the selected activation slot and its planned layer count (rows.schedule_word)
CHECK_SCHEDULE_MISMATCH = 8

# What a timed-out wait was waiting for (the `a` number of CHECK_WAIT_TIMEOUT, times 2**32,
# plus the index of the thing waited on)
WAIT_CLAIM_SLICES = 1     # the claimed copy of an m-tile (claim.py)
WAIT_MEGA_READY = 2       # the W13 tiles of an m-tile, in the Mega forward (mega.py)
# a lower block's partial sum of a tile, in the NVFP4 stream-K GEMM (csrc/nvfp4_wgmma_mm.cu;
# the tile is the index, and the block waited for takes the rank's place)
WAIT_STREAMK_PARTIAL = 3

# The host-side text of each code (tests and error messages); the device prints the same words.
MESSAGES = {
    CHECK_UNEQUAL_T: "unequal token counts across EP ranks: peer rank, T",
    CHECK_SCRATCH_OVERFLOW: "scratch overflow: rows required, rows available",
    CHECK_BAD_EXPERT_ID: "expert id out of range: flat route index, id",
    CHECK_INACTIVE_SCORE: "nonzero score on inactive route: flat route index, score bits",
    CHECK_PEER_REJECTED: ("a peer rank rejected its inputs (its own error names the argument): "
                          "peer rank, its T marker"),
    CHECK_LAYOUT_OUTSIDE_ARENA: ("the per-call layout does not fit the arena: bytes needed, "
                                 "bytes available, rows"),
    CHECK_WAIT_TIMEOUT: ("a device wait timed out: what (claim slices = 1, Mega W13 tiles = 2, "
                         "NVFP4 stream-K partial sum = 3) x 2^32 + m-tile (3: tile), rank (3: "
                         "the block waited for), polls (about one microsecond each)"),
    CHECK_SCHEDULE_MISMATCH: ("EP ranks differ in grad mode or in select_activation_slot before "
                              "this forward: peer rank, its schedule word (-1: no training "
                              "forward; else slot x (max layers + 1) + layers)"),
}


@triton.jit
def trap():
    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


BUSY_POLLS = 256   # polls before a waiting program starts to sleep ~1 us between polls


def max_polls(timeout_s: float) -> int:
    """Polls of `wait_until_at_least` that last at least about timeout_s."""
    return BUSY_POLLS + max(1, int(timeout_s * 1e6))


@triton.jit
def _nanosleep(SLEEP: tl.constexpr):
    """Sleep about a microsecond (GPU only: the interpreter has no inline asm)."""
    if SLEEP:
        tl.inline_asm_elementwise("nanosleep.u32 1000; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def trap_on_code(code, a, b, c=0):
    """code != 0: print the failed check's cause and its numbers, then trap. Shared by every
    device check, so the messages are written once (the same words as MESSAGES)."""
    if code != 0:
        if code == 1:
            tl.device_print("dist_moe TRAP: unequal token counts across EP ranks: peer rank, T:",
                            a, b)
        elif code == 2:
            tl.device_print("dist_moe TRAP: scratch overflow: rows required, rows available:",
                            a, b)
        elif code == 3:
            tl.device_print("dist_moe TRAP: expert id out of range: flat route index, id:", a, b)
        elif code == 5:
            tl.device_print("dist_moe TRAP: a peer rank rejected its inputs (its own error "
                            "names the argument): peer rank, its T marker:", a, b)
        elif code == 6:
            tl.device_print("dist_moe TRAP: the per-call layout does not fit the arena: bytes "
                            "needed, bytes available, rows:", a, b, c)
        elif code == 7:
            tl.device_print("dist_moe TRAP: a device wait timed out: what (claim slices = 1, "
                            "Mega W13 tiles = 2, NVFP4 stream-K partial sum = 3) x 2^32 + "
                            "m-tile (3: tile), rank (3: the block waited for), polls (about one "
                            "microsecond each):", a, b, c)
        elif code == 8:
            tl.device_print("dist_moe TRAP: EP ranks differ in grad mode or in "
                            "select_activation_slot before this forward: peer rank, its schedule "
                            "word (-1: no training forward; else slot x (max layers + 1) + "
                            "layers):", a, b)
        else:
            tl.device_print("dist_moe TRAP: nonzero score on inactive route: "
                            "flat route index, score bits:", a, b)
        trap()


@triton.jit
def _device_check_kernel(codes_ptr, a_ptr, b_ptr, n):
    # codes[i] != 0 names a failed condition; a[i], b[i] are the numbers it reports.
    for i in range(n):
        code = tl.load(codes_ptr + i)
        if code != 0:
            trap_on_code(code, tl.load(a_ptr + i), tl.load(b_ptr + i))


def device_check(codes: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """Trap (after printing the cause and the two numbers) if any codes[i] != 0. No host sync."""
    _device_check_kernel[(1,)](codes, a, b, codes.numel(), num_warps=1)


STATUS_WORDS = 4   # (code, what, rank, polls)


@triton.jit
def wait_until_at_least(ptr, target, polls_max, what, rank, status_ptr, SLEEP: tl.constexpr):
    """Spin with acquire loads until *ptr >= target; returns the value seen.

    After BUSY_POLLS polls a waiting program sleeps about a microsecond between polls (SLEEP, on
    the GPU), and it gives up after polls_max polls (`max_polls(timeout_s)`). The decision
    depends only on the poll count and the loaded value, the same in every thread of the
    program (a per-thread clock read could differ between threads and split the loop). Past
    its busy polls a wait also stops when the status word already holds a verdict. A wait
    that gives up records (CHECK_WAIT_TIMEOUT, what, rank, polls) in status_ptr [STATUS_WORDS]
    int64 and returns, so the kernel ends with whatever it has; `check_status` after it traps
    (on the GPU) or the caller reads the word (the interpreter)."""
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    polls = tl.full((), 0, tl.int64)
    while (v < target) & (polls < polls_max):
        if polls >= 256:   # BUSY_POLLS
            _nanosleep(SLEEP)
            if tl.load(status_ptr, volatile=True) != 0:   # another wait gave up: so does this
                polls = polls - polls + (polls_max - 1)      # stays int64
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    if v < target:
        tl.store(status_ptr + 1, what.to(tl.int64))
        tl.store(status_ptr + 2, rank.to(tl.int64))
        tl.store(status_ptr + 3, polls)
        tl.atomic_xchg(status_ptr + 0, tl.full((), 7, tl.int64), sem="release", scope="gpu")
    return v


@triton.jit
def _check_status_kernel(status_ptr):
    code = tl.atomic_add(status_ptr + 0, 0, sem="acquire", scope="gpu")
    trap_on_code(code, tl.load(status_ptr + 1), tl.load(status_ptr + 2), tl.load(status_ptr + 3))


def check_status(status: torch.Tensor) -> None:
    """Trap with the message of status[0] (a check code; 0: nothing) and its numbers
    status[1:4]. GPU only (the interpreter cannot trap: read the word instead). No host sync."""
    assert status.numel() >= STATUS_WORDS and status.dtype == torch.int64
    _check_status_kernel[(1,)](status, num_warps=1)

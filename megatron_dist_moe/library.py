"""Registered ops (torch.library): the graph boundary of routed_experts.

    dist_moe::routed_experts_fwd(Tensor x, Tensor expert_ids, Tensor scores, Tensor w13,
                                 Tensor w2, SymInt ctx_id, bool training,
                                 Tensor[] wgrad_into_w13, Tensor[] wgrad_into_w2,
                                 SymInt weight_cache)
        -> (Tensor y, Tensor saved_id)
    dist_moe::routed_experts_bwd(Tensor grad_y, Tensor saved_id, SymInt ctx_id, SymInt top_k,
                                 SymInt[] w13_shape, SymInt[] w2_shape)
        -> (Tensor grad_x, Tensor grad_scores, Tensor grad_w13, Tensor grad_w2)

Both have fake implementations, and register_autograd connects them, so make_fx, AOTAutograd
and torch.utils.checkpoint see two opaque, well-described nodes instead of the collectives and
GEMMs inside. ops.routed_experts() validates the arguments and calls routed_experts_fwd.
`wgrad_into_w13` / `wgrad_into_w2` are routed_experts(wgrad_into=...)'s fp32 accumulators (empty
lists without): the forward only keeps them in its saved record, and the backward of that
record adds the weight gradients into them.

State. The backends keep per-call state outside the arguments: the planner cursors and the
activation arena of the Context (ctx_id names it, see context.context_from_id), and the
`saved` object of a training forward, kept in the context's table under a small integer. That
integer comes back as `saved_id`, a 0-d int64 tensor on the CPU (so reading it never syncs a
device), and routed_experts_bwd pops the entry: every training forward is matched by exactly
one backward, which rewinds the planner. `mutates_args=()` is honest about the arguments (no
argument is written); the hidden state is why the ops must not be reordered, deduplicated or
run speculatively (a compiler must treat them as side-effecting).

Shapes and dtypes (T tokens, K routes, D hidden, F intermediate, E_local local experts):
    x [T, D] bf16/fp32/fp64, expert_ids [T, K] int, scores [T, K] fp32/bf16(/fp64 with fp64 x),
    w13 [E_local, 2F, D] and w2 [E_local, D, F] in x's dtype; y [T, D] in x's dtype.
    grad_x [T, D] in grad_y's dtype; grad_scores [T, K] fp32 (fp64 for fp64 grad_y), cast to
    the scores' dtype by the autograd formula; grad_w13 [E_local, 2F, D] and grad_w2
    [E_local, D, F] in grad_y's dtype (= the weights' dtype; weight gradients accumulated in
    Config.wgrad_dtype are rounded to it here, as autograd would do anyway).

Activation checkpointing (torch.utils.checkpoint). The planner is Dist-MoE's own activation
checkpointing: a layer's saved state lives in a preallocated activation slot, and the planner
already chose to keep the full state or only x for replay. So inside a checkpointed region:
  * non-reentrant (use_reentrant=False): the first pass is a normal training forward (it
    advances the slot cursor and keeps its state in the slot). The routed-experts node saves no
    tensor through autograd, so checkpoint never drops anything of it. If the recomputation
    during backward re-runs routed_experts (to rebuild inputs of other ops), that call is a
    *stateless* forward (like torch.no_grad: scratch only, planner untouched, no saved entry),
    and the backward uses the first pass's snapshot: "a checkpoint recomputation cannot
    redirect the backward". Gradients are bit-identical to the un-checkpointed ones and every
    cursor advance is matched by one rewind. Detection: in_checkpoint_recompute() below.
  * reentrant (use_reentrant=True, Megatron's CheckpointFunction): the first pass runs under
    no_grad, so it is stateless by the usual rule; the recomputation in backward is a normal
    training forward immediately followed by its backward (one advance, one rewind), into the
    slot selected *at that moment*: a schedule must select a slot with a free layer position
    before such a backward.
  * selective checkpointing (context_fn=create_selective_checkpoint_contexts) may mark
    routed_experts_fwd MUST_SAVE: the recomputation then reuses its outputs without a call.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Sequence

import torch

from .context import context_from_id

__all__ = ["routed_experts_fwd", "routed_experts_bwd", "in_checkpoint_recompute",
           "untraced", "is_tracing", "is_fake_tensor"]


def _score_grad_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- forward ----------------------------------------------------------------------------------
@torch.library.custom_op("dist_moe::routed_experts_fwd", mutates_args=())
def routed_experts_fwd(x: torch.Tensor, expert_ids: torch.Tensor, scores: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, ctx_id: int, training: bool,
                       wgrad_into_w13: Sequence[torch.Tensor], wgrad_into_w2: Sequence[torch.Tensor],
                       weight_cache: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y [T, D] and saved_id (0-d int64, CPU; -1 when not training). Arguments must already be
    validated (ops.routed_experts does it); w13 is [E_local, 2F, D]. weight_cache: the
    is_first_microbatch argument as -1 (None), 0 (False), 1 (True)."""
    ctx = context_from_id(ctx_id)
    mode = None if weight_cache < 0 else bool(weight_cache)
    # routed_experts checked this already (collectively); a direct call of the op, or one
    # traced with fake tensors, is checked here, still before the backend writes anything
    ctx.weight_cache.check(w13, w2, mode)
    y, saved = ctx.backend.forward(x, expert_ids, scores, w13, w2, training=training,
                                   weight_cache=mode)
    if not training:
        return y, torch.tensor(-1, dtype=torch.int64)
    saved.wgrad_into = (list(wgrad_into_w13), list(wgrad_into_w2)) if wgrad_into_w13 else None
    return y, ctx._stash_saved(saved)


@routed_experts_fwd.register_fake
def _routed_experts_fwd_fake(x, expert_ids, scores, w13, w2, ctx_id, training,
                             wgrad_into_w13, wgrad_into_w2, weight_cache):
    return x.new_empty(x.shape), torch.empty((), dtype=torch.int64, device="cpu")


# -- backward ---------------------------------------------------------------------------------
@torch.library.custom_op("dist_moe::routed_experts_bwd", mutates_args=())
def routed_experts_bwd(grad_y: torch.Tensor, saved_id: torch.Tensor, ctx_id: int, top_k: int,
                       w13_shape: Sequence[int], w2_shape: Sequence[int]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_scores, grad_w13, grad_w2) of the forward named by saved_id, whose entry
    it consumes (a second call with the same saved_id raises)."""
    ctx = context_from_id(ctx_id)
    saved = ctx._pop_saved(int(saved_id))
    grad_x, grad_scores, grad_w13, grad_w2 = ctx.backend.backward(grad_y.contiguous(), saved)
    dt = grad_y.dtype
    if grad_w13 is None:
        # routed_experts(wgrad_into=...): the weight gradients were added into the caller's
        # fp32 tensors; the weights get zeros (stride-0: nothing is written)
        return (grad_x.to(dt).contiguous(), grad_scores.to(_score_grad_dtype(dt)).contiguous(),
                grad_y.new_zeros(()).expand(list(w13_shape)),
                grad_y.new_zeros(()).expand(list(w2_shape)))
    # Declared metadata (what the fake promises) whatever the backend's internal choices.
    T = grad_y.shape[0]
    assert tuple(grad_x.shape) == tuple(grad_y.shape), "backend grad_x shape differs from grad_y"
    assert tuple(grad_scores.shape) == (T, top_k), "backend grad_scores shape is not [T, K]"
    assert tuple(grad_w13.shape) == tuple(w13_shape), "backend grad_w13 shape differs from w13"
    assert tuple(grad_w2.shape) == tuple(w2_shape), "backend grad_w2 shape differs from w2"
    return (grad_x.to(dt).contiguous(), grad_scores.to(_score_grad_dtype(dt)).contiguous(),
            grad_w13.to(dt).contiguous(), grad_w2.to(dt).contiguous())


@routed_experts_bwd.register_fake
def _routed_experts_bwd_fake(grad_y, saved_id, ctx_id, top_k, w13_shape, w2_shape):
    dt = grad_y.dtype
    return (grad_y.new_empty(grad_y.shape),
            grad_y.new_empty((grad_y.shape[0], top_k), dtype=_score_grad_dtype(dt)),
            grad_y.new_empty(list(w13_shape)), grad_y.new_empty(list(w2_shape)))


# -- autograd ---------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    x, expert_ids, scores, w13, w2, ctx_id, training = inputs[:7]
    _, saved_id = output
    ctx.mark_non_differentiable(saved_id)
    # No zero gradient for the integer saved_id output (it would be a graph node of its own).
    ctx.set_materialize_grads(False)
    ctx.y_meta = (tuple(x.shape), x.dtype, x.device)
    ctx.saved_id = saved_id          # a Python attribute, not save_for_backward: see module doc
    ctx.ctx_id = ctx_id
    ctx.training = training
    ctx.score_dtype = scores.dtype
    ctx.top_k = expert_ids.shape[1]
    ctx.w13_shape = tuple(w13.shape)
    ctx.w2_shape = tuple(w2.shape)
    ctx.n_into = (len(inputs[7]), len(inputs[8]))   # wgrad_into lists: no gradient flows to them
    # The backend's saved object, for introspection (tests read grad_fn.saved.record); found
    # without reading saved_id (no dispatch, so nothing extra lands in a traced graph).
    ctx.saved = None
    if training and type(saved_id) is torch.Tensor:
        try:
            ctx.saved = context_from_id(ctx_id)._take_last_stashed(saved_id)
        except ValueError:
            pass


def _backward(ctx, grad_y, _grad_saved_id):
    saved_id = ctx.saved_id
    if saved_id is None:
        raise RuntimeError("routed_experts: backward ran twice through the same graph; "
                           "saved state is released after the first backward")
    ctx.saved_id = None
    ctx.saved = None
    if grad_y is None:       # not reached through autograd (y is the only differentiable output)
        shape, dtype, device = ctx.y_meta
        grad_y = torch.zeros(shape, dtype=dtype, device=device)
    if not ctx.training:
        raise RuntimeError(
            "routed_experts: this forward kept no state for backward: it ran as an activation-"
            "checkpoint recomputation (whose own graph autograd never differentiates) or was "
            "called with training=False")
    grad_x, grad_scores, grad_w13, grad_w2 = torch.ops.dist_moe.routed_experts_bwd(
        grad_y, saved_id, ctx.ctx_id, ctx.top_k, ctx.w13_shape, ctx.w2_shape)
    # one entry per input; weight_cache has no default: torch 2.11 drops a trailing argument
    # that equals its default from the inputs the backward's structure is checked against
    return (grad_x, None, grad_scores.to(ctx.score_dtype), grad_w13, grad_w2, None, None,
            [None] * ctx.n_into[0], [None] * ctx.n_into[1], None)


routed_experts_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- tracing helpers --------------------------------------------------------------------------
def is_fake_tensor(t) -> bool:
    """True for FakeTensors (and functional wrappers of them): metadata without values."""
    if type(t) is torch.Tensor:     # fast path: plain tensors are real
        return False
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:     # pragma: no cover - every supported torch has it
        return False
    return isinstance(t, torch.Tensor) and is_fake(t)


def is_tracing() -> bool:
    """True while make_fx (or torch.compile's AOT tracing) records ops into a graph."""
    get_mode = getattr(torch._C, "_get_dispatch_mode", None)
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "PROXY", None)
    return not (get_mode is not None and key is not None and get_mode(key) is None)


def untraced():
    """Context manager: run host-side logic (argument checks that read values, the cross-rank
    agreement collective) eagerly, without recording it into a make_fx graph."""
    if not is_tracing():
        return contextlib.nullcontext()      # not tracing: nothing to hide
    try:
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    except ImportError:     # pragma: no cover
        return contextlib.nullcontext()
    return disable_proxy_modes_tracing()


# -- activation-checkpoint detection ----------------------------------------------------------
# NOTE: torch.utils.checkpoint exposes no "recomputing" flag. Its non-reentrant recomputation
# pushes `_recomputation_hook` saved-tensor hooks (also the class name in Transformer Engine's
# copy of it), and it is started from the first pass's `_checkpoint_hook` unpack hook. Names
# checked on torch 2.6-2.14; tests/cpu/test_registered_ops.py fails if they change.
_RECOMPUTE_PACK = "_recomputation_hook.__init__.<locals>.pack_hook"
_FIRST_PASS_UNPACK = ("_checkpoint_hook.__init__.<locals>.unpack_hook",
                      "_checkpoint_hook.__init__.<locals>.unpack_hook_with_error_cb")
_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def _top_saved_tensors_hooks():
    get = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if get is None:
        return "unknown"
    try:
        return get(False)
    except TypeError:       # older signature without ignore_is_tracing
        return get()


def _recompute_frame_on_stack() -> bool:
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        qual = getattr(code, "co_qualname", None)
        if qual is not None:
            if qual in _FIRST_PASS_UNPACK:
                return True
        elif code.co_name in ("unpack_hook", "unpack_hook_with_error_cb") and \
                code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        f = f.f_back
    return False


def in_checkpoint_recompute() -> bool:
    """True while a non-reentrant activation checkpoint recomputes its region on this thread.

    Fast path: no saved-tensor hooks active -> False; the recomputation's own hooks on top ->
    True. Otherwise (a checkpoint's first-pass hooks, e.g. a checkpoint nested in a region being
    recomputed, or user hooks such as save_on_cpu) look for the checkpoint unpack hook that
    starts every recomputation on the Python stack.
    """
    if torch.compiler.is_compiling():
        return False
    hooks = _top_saved_tensors_hooks()
    if hooks is None:
        return False
    if hooks != "unknown":
        qual = getattr(hooks[0], "__qualname__", "")
        if qual.endswith(_RECOMPUTE_PACK):
            return True
    return _recompute_frame_on_stack()

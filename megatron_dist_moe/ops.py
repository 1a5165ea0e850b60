"""routed_experts(): the one public op. Validation and the training decision live here.

The work itself is the registered op pair dist_moe::routed_experts_fwd / _bwd (library.py), whose
autograd formula, fake implementations and activation-checkpoint semantics are described there.
Both backends implement `backends.base.Backend`; this module never touches a backend's buffers.
"""

from __future__ import annotations

import torch

from . import library
from .context import Context
from .errors import ARG_NAMES, RoutedExpertsInputError  # noqa: F401  (re-exported)
from .prepared import PREPARED_PRECISIONS, PreparedWeight
from .weight_cache import weight_cache_mode

__all__ = ["routed_experts", "RoutedExpertsInputError", "validate_inputs", "validate_wgrad_into"]


_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)

def _want_value_checks(x: torch.Tensor) -> bool:
    """Host-side value checks need a device sync: skip them while capturing a CUDA graph or when
    the caller asked torch to flag syncs; the CUDA backend then traps on the device instead."""
    if x.device.type != "cuda":
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    return torch.cuda.get_sync_debug_mode() == 0


def validate_inputs(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, scores_TK: torch.Tensor,
                    w13: torch.Tensor, w2_EDF: torch.Tensor, ctx: Context,
                    check_values: bool | None = None) -> torch.Tensor:
    """Check every argument against ctx's Config; return w13 as [E_local, 2F, D] (a view).

    Raises RoutedExpertsInputError (a ValueError) naming the argument. Runs before any buffer is
    written, so the context stays usable after a rejected call.
    """
    cfg = ctx.config
    T_max, D, F, K = cfg.num_local_input_tokens, cfg.hidden_dim, cfg.intermediate_dim, cfg.top_k
    E_local = ctx.num_local_experts
    allowed = ctx.backend.supported_dtypes

    def tensor(name, t):
        if not isinstance(t, torch.Tensor):
            raise RoutedExpertsInputError(name, f"expected a torch.Tensor, got {type(t).__name__}")
        if t.device != ctx.device:
            raise RoutedExpertsInputError(name, f"is on {t.device}, the context is on {ctx.device}")

    prepared = cfg.precision in PREPARED_PRECISIONS
    for name, t in (("x", x_TD), ("expert_ids", expert_ids_TK), ("scores", scores_TK)):
        tensor(name, t)
    for name, w in (("w13", w13), ("w2", w2_EDF)):
        if prepared and not isinstance(w, PreparedWeight):
            raise RoutedExpertsInputError(
                name, f"precision={cfg.precision!r} reads prepared weights: pass "
                f"dm.prepare_expert_weights(w13, w2, precision={cfg.precision!r}).{name}, got "
                f"{type(w).__name__}")
        if not prepared and isinstance(w, PreparedWeight):
            raise RoutedExpertsInputError(
                name, f"prepared {w.precision} weights need an inference context with "
                f"precision={w.precision!r}; this context runs {cfg.precision!r}")
        if not prepared:
            tensor(name, w)
    if x_TD.dim() != 2 or x_TD.shape[1] != D:
        raise RoutedExpertsInputError("x", f"expected shape [T, D={D}], got {list(x_TD.shape)}")
    T = x_TD.shape[0]
    if T > T_max:
        raise RoutedExpertsInputError("x", f"T={T} rows exceed Config.num_local_input_tokens={T_max}")
    if x_TD.dtype not in allowed:
        raise RoutedExpertsInputError("x", f"dtype {x_TD.dtype} not supported by the "
                                      f"{ctx.backend.name} backend (supported: {allowed})")
    if expert_ids_TK.shape != (T, K):
        raise RoutedExpertsInputError("expert_ids", f"expected shape [T={T}, K={K}], got "
                                      f"{list(expert_ids_TK.shape)}")
    if expert_ids_TK.dtype not in _INDEX_DTYPES:
        raise RoutedExpertsInputError("expert_ids", f"expected an integer dtype (int16/int32/int64), "
                                      f"got {expert_ids_TK.dtype}")
    if scores_TK.shape != (T, K):
        raise RoutedExpertsInputError("scores", f"expected shape [T={T}, K={K}], got {list(scores_TK.shape)}")
    if scores_TK.dtype not in (torch.float32, torch.bfloat16) and not (
            scores_TK.dtype == torch.float64 and x_TD.dtype == torch.float64):
        raise RoutedExpertsInputError("scores", f"expected float32 or bfloat16, got {scores_TK.dtype}")
    if prepared:
        w13.check("w13", (E_local, 2 * F, D), cfg.precision, ctx.device)
        w2_EDF.check("w2", (E_local, D, F), cfg.precision, ctx.device)
        if x_TD.dtype != torch.bfloat16:
            raise RoutedExpertsInputError("x", f"dtype {x_TD.dtype}: precision "
                                          f"{cfg.precision!r} takes bfloat16 rows")
    elif w13.dim() == 4:
        if tuple(w13.shape) != (E_local, 2, F, D):
            raise RoutedExpertsInputError("w13", f"expected [E_local={E_local}, 2, F={F}, D={D}] or "
                                          f"[E_local, 2F={2 * F}, D], got {list(w13.shape)}")
        # before the reshape, which would copy: the kernels and the weight cache need the
        # caller's tensor
        if not w13.is_contiguous():
            raise RoutedExpertsInputError("w13", "must be contiguous")
        w13 = w13.reshape(E_local, 2 * F, D)
    elif tuple(w13.shape) != (E_local, 2 * F, D):
        raise RoutedExpertsInputError("w13", f"expected [E_local={E_local}, 2F={2 * F}, D={D}] or "
                                      f"[E_local, 2, F, D], got {list(w13.shape)}")
    if not prepared and tuple(w2_EDF.shape) != (E_local, D, F):
        raise RoutedExpertsInputError("w2", f"expected [E_local={E_local}, D={D}, F={F}], got "
                                      f"{list(w2_EDF.shape)}")
    for name, w in () if prepared else (("w13", w13), ("w2", w2_EDF)):
        if w.dtype != x_TD.dtype:
            raise RoutedExpertsInputError(name, f"dtype {w.dtype} differs from x's {x_TD.dtype}")
        if not w.is_contiguous():
            raise RoutedExpertsInputError(name, "must be contiguous")
    if check_values is None:
        check_values = _want_value_checks(x_TD)
    if check_values and T > 0:
        ids = expert_ids_TK.to(torch.int64)
        bad = (ids < -1) | (ids >= cfg.num_experts)
        if bool(bad.any()):
            t, k = (int(v) for v in bad.nonzero()[0])
            raise RoutedExpertsInputError(
                "expert_ids", f"expert_ids[{t}, {k}]={int(ids[t, k])} is outside [-1, "
                f"num_experts={cfg.num_experts}) ({int(bad.sum())} bad entries)")
        live_score = (ids == -1) & (scores_TK != 0)
        if bool(live_score.any()):
            t, k = (int(v) for v in live_score.nonzero()[0])
            raise RoutedExpertsInputError(
                "scores", f"scores[{t}, {k}]={float(scores_TK[t, k])} on an inactive route "
                "(expert_ids == -1): inactive routes must have score 0")
        if not bool(torch.isfinite(scores_TK).all()):
            raise RoutedExpertsInputError("scores", "contains NaN or Inf")
        if prepared:     # encode scales: finite and > 0 (quant/nvfp4.py); one sync for both
            g = torch.cat([w13.global_scale, w2_EDF.global_scale])
            ok = (torch.isfinite(g) & (g > 0)).tolist()
            for name, w, part in (("w13", w13, ok[:E_local]), ("w2", w2_EDF, ok[E_local:])):
                if not all(part):
                    raise RoutedExpertsInputError(
                        name, f"global scales must be finite and > 0, got "
                        f"{w.global_scale.tolist()}")
    return w13


def _check_grad_mode(x_TD, scores_TK, w13, w2_EDF, ctx: Context) -> bool:
    """Whether this call trains (records for backward); raises where the context cannot. Runs
    before the cross-rank agreement, so a rank that refuses here does not leave its peers
    waiting in the exchange."""
    if isinstance(w13, PreparedWeight):
        # inference on prepared weights: nothing to differentiate, so no registered op pair
        if torch.is_grad_enabled() and x_TD.requires_grad:
            raise RoutedExpertsInputError(
                "x", f"precision={ctx.config.precision!r} runs inference only: call under "
                "torch.no_grad() (or detach x)")
        return False
    training = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x_TD, scores_TK, w13, w2_EDF))
    if training and library.in_checkpoint_recompute():
        # Non-reentrant activation-checkpoint recomputation: the first pass already saved this
        # layer's state in its slot and its backward uses that snapshot; this call only rebuilds
        # y for the other ops of the region, so it must not touch the planner (library.py).
        training = False
    if training and ctx.config.inference:
        raise RoutedExpertsInputError(
            "ctx", "this context was created with Config.inference=True and keeps no state for "
            "backward; call under torch.no_grad() or create a training context")
    return training


def validate_wgrad_into(wgrad_into, ctx: Context) -> tuple[list, list]:
    """Check routed_experts' `wgrad_into` = (w13 accumulators, w2 accumulators): E_local fp32
    contiguous 16-byte aligned tensors each, [2F, D] (or [2, F, D]) and [D, F], on ctx.device;
    Config.wgrad_dtype must be "fp32". Raises RoutedExpertsInputError("wgrad_into", ...)."""
    cfg = ctx.config
    D, F, E_local = cfg.hidden_dim, cfg.intermediate_dim, ctx.num_local_experts
    if cfg.wgrad_dtype != "fp32":
        raise RoutedExpertsInputError("wgrad_into", "adds fp32 weight gradients: needs "
                                      f"Config.wgrad_dtype='fp32', got {cfg.wgrad_dtype!r}")
    if not isinstance(wgrad_into, (tuple, list)) or len(wgrad_into) != 2:
        raise RoutedExpertsInputError("wgrad_into", "expected a pair (w13 accumulators, w2 "
                                      f"accumulators), got {type(wgrad_into).__name__}")
    out = []
    for which, shapes in (("w13", ((2 * F, D), (2, F, D))), ("w2", ((D, F),))):
        accs = wgrad_into[len(out)]
        if not isinstance(accs, (tuple, list)) or len(accs) != E_local:
            raise RoutedExpertsInputError(
                "wgrad_into", f"{which}: expected a list of E_local={E_local} tensors, got "
                f"{len(accs) if isinstance(accs, (tuple, list)) else type(accs).__name__}")
        for e, t in enumerate(accs):
            where = f"{which}[{e}]"
            if not isinstance(t, torch.Tensor):
                raise RoutedExpertsInputError("wgrad_into", f"{where}: expected a tensor")
            if tuple(t.shape) not in shapes:
                raise RoutedExpertsInputError("wgrad_into", f"{where}: shape {list(t.shape)}, "
                                              f"expected {' or '.join(map(str, map(list, shapes)))}")
            if t.dtype != torch.float32:
                raise RoutedExpertsInputError("wgrad_into", f"{where}: dtype {t.dtype}, expected "
                                              "torch.float32")
            if t.device != ctx.device:
                raise RoutedExpertsInputError("wgrad_into", f"{where}: is on {t.device}, the "
                                              f"context is on {ctx.device}")
            if not t.is_contiguous() or t.data_ptr() % 16:
                raise RoutedExpertsInputError("wgrad_into", f"{where}: must be contiguous and "
                                              "16-byte aligned")
        out.append(list(accs))
    # every accumulator its own memory: experts' WGRADs add into them concurrently
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4, f"{which}[{e}]")
                   for which, accs in zip(("w13", "w2"), out) for e, t in enumerate(accs))
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise RoutedExpertsInputError("wgrad_into", f"{a} and {b} share memory: each "
                                          "expert's gradient needs its own accumulator")
    return out[0], out[1]


def routed_experts(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, scores_TK: torch.Tensor,
                   w13: torch.Tensor, w2_EDF: torch.Tensor, ctx: Context, *,
                   wgrad_into=None, is_first_microbatch: bool | None = None) -> torch.Tensor:
    """Run the routed expert MLPs of every rank's tokens on the experts' owners.

    Args:
        x_TD:          [T, D] token rows owned by this rank (bf16; the reference backend also takes
                       fp32/fp64). Every rank of the EP group passes the same T (pad with rows
                       whose routes are all inactive).
        expert_ids_TK: [T, K] int16/int32/int64 global expert IDs in [0, E); -1 disables a route.
        scores_TK:     [T, K] fp32 or bf16 route scores; must be 0 on inactive routes.
        w13:           [E_local, 2, F, D] or [E_local, 2F, D] gate rows then up rows of this
                       rank's experts (global expert id = rank * E_local + local index); on
                       an inference context with precision="nvfp4", the `PreparedWeight`
                       `dm.prepare_expert_weights(w13, w2, precision="nvfp4").w13` instead.
        w2_EDF:        [E_local, D, F] down projections (nvfp4: the prepared `.w2`).
        ctx:           a Context from create_context() on the EP group.
        wgrad_into:    optional (w13 accumulators, w2 accumulators): E_local fp32 tensors each,
                       [2F, D] (or [2, F, D]) and [D, F], e.g. Megatron's per-expert main_grad.
                       The backward then ADDS the fp32 weight gradients into them (the WGRAD
                       GEMMs accumulate in place: no bf16 rounding, no stacked gradient) and
                       w13 and w2 receive zero gradients. Needs Config.wgrad_dtype="fp32";
                       ignored by calls that keep no state for backward.
        is_first_microbatch: TransformerEngine's weight-cache protocol, for the precisions that
                       quantize the weights (fp8_block, mxfp8; others ignore it). None: quantize
                       them in this call. True: quantize them into this context's cache entry
                       for these weight tensors, then run. False: run on the entry the last
                       True call wrote (the weights must not have changed since, as within one
                       optimizer step); raises when there is none. See weight_cache.py.

    Returns:
        y_TD [T, D] in x's dtype: for each token the FP32 score-weighted sum over its active routes
        of W2 · act(W13 · x); exactly zero for a row with no active route.

    Differentiable w.r.t. x, scores, w13 and w2; weight gradients land on the owning rank.
    The work runs in the registered ops dist_moe::routed_experts_fwd / _bwd (library.py), so
    make_fx records two opaque nodes, and torch.utils.checkpoint works (semantics there).
    Raises RoutedExpertsInputError (a ValueError) naming a bad argument before anything is written.
    """
    if not isinstance(ctx, Context):
        raise RoutedExpertsInputError("ctx", f"expected a megatron_dist_moe Context, got {type(ctx).__name__}")
    if ctx.closed:
        raise RoutedExpertsInputError("ctx", "this Dist-MoE context is closed; create a new one")
    # Checks are host logic: under make_fx they run eagerly and stay out of the graph. With
    # FakeTensors (symbolic tracing, torch.compile) only metadata can be checked, and the
    # cross-rank agreement, a collective, waits for the real call.
    fake = any(library.is_fake_tensor(t) for t in (x_TD, expert_ids_TK, scores_TK, w13, w2_EDF))
    tracing = library.is_tracing()
    training = None
    with library.untraced():
        try:
            validate_inputs(x_TD, expert_ids_TK, scores_TK, w13, w2_EDF, ctx,
                            check_values=False if fake else None)
            training = _check_grad_mode(x_TD, scores_TK, w13, w2_EDF, ctx)
            if wgrad_into is not None:
                if fake or tracing:
                    # the accumulators travel beside the registered op (see below), which a
                    # traced graph would not replay: the gradients would go astray silently
                    raise RoutedExpertsInputError(
                        "wgrad_into", "is not supported under make_fx / torch.compile tracing; "
                        "call eagerly (CUDA-graph capture is fine) or drop wgrad_into")
                wgrad_into = validate_wgrad_into(wgrad_into, ctx)
            cache_mode = weight_cache_mode(is_first_microbatch)
            if not isinstance(w13, PreparedWeight) and not fake:
                ctx.weight_cache.check(w13, w2_EDF, cache_mode)
            local_error = None
        except RoutedExpertsInputError as e:
            local_error = e
        # Collective agreement: a bad input on one rank never leaves its peers waiting. The
        # reference backend makes every rank raise; the CUDA backend (no host sync) meets the
        # peers at its device barrier with a "rejected" header, and their routing traps.
        if not fake:
            ctx.backend.check_collective(x_TD, local_error, training=training)
    if local_error is not None:
        raise local_error
    if isinstance(w13, PreparedWeight):
        y_TD, _ = ctx.backend.forward(x_TD, expert_ids_TK, scores_TK, w13, w2_EDF,
                                      training=False)
        return y_TD
    cache_code = {None: -1, False: 0, True: 1}[cache_mode]
    if w13.dim() == 4:       # [E_local, 2, F, D] -> [E_local, 2F, D], a view (traced)
        w13 = w13.reshape(w13.shape[0], -1, w13.shape[-1])
    # the accumulators travel as the op's tensor-list arguments; its saved record keeps them
    into = wgrad_into if training and not fake and wgrad_into is not None else ([], [])
    y_TD, _ = torch.ops.dist_moe.routed_experts_fwd(x_TD, expert_ids_TK, scores_TK, w13, w2_EDF,
                                                    ctx.id, training, into[0], into[1],
                                                    cache_code)
    return y_TD

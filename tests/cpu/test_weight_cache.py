"""routed_experts(is_first_microbatch=...): quantized weights kept across calls (weight_cache.py).

The reference backend on two gloo ranks, fp8_block and mxfp8 training: True quantizes into the
context's cache and gives the bits of a call that quantizes its own weights; False reuses that
entry, so after an in-place weight update (as an optimizer writes `.data`) it still gives the
old bits until the next True call, which gives the new ones; forward and every gradient alike.
A False call with no entry, or a value that is no bool, raises naming the argument before
anything runs, on the peer too (naming it); bf16 ignores the argument. An entry belongs to its
tensors' storages: another tensor at the same address has none. The CUDA backend's own path
runs in the Triton interpreter (children/cuda_backend_ep1.py, `weight_cache` result) and on
the GPU (dist_check).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_dist_moe import testing as tt

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = dict(num_local_input_tokens=16, hidden_dim=128, intermediate_dim=128, top_k=2,
             num_experts=4, backend="reference")


def _call(dm, inp, ctx, w13, w2, mode):
    x0, ids, s0 = inp
    x = x0.clone().requires_grad_(True)
    s = s0.clone().requires_grad_(True)
    y = dm.routed_experts(x, ids, s, w13, w2, ctx, is_first_microbatch=mode)
    y.float().square().sum().backward()
    out = dict(y=y.detach().clone(), gx=x.grad.clone(), gs=s.grad.clone(),
               g13=w13.grad.clone(), g2=w2.grad.clone())
    w13.grad = w2.grad = None
    return out


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def _raised_arg(fn):
    from megatron_dist_moe.errors import RoutedExpertsInputError
    try:
        fn()
    except RoutedExpertsInputError as e:
        return e.arg
    return None


def _worker(rank, ws):
    import megatron_dist_moe as dm
    res = {}
    for precision in ("fp8_block", "mxfp8", "bf16"):
        cfg = dm.Config(**SHAPE, precision=precision)
        p = tt.make_problem(cfg, ws, seed=5, dtype=torch.bfloat16)
        tok, exp = p.tokens(rank), p.experts(rank)
        inp = (p.x[tok].contiguous(), p.ids[tok].contiguous(), p.scores[tok].contiguous())
        w13 = p.w13[exp].flatten(1, 2).clone().requires_grad_(True)
        w2 = p.w2[exp].clone().requires_grad_(True)
        r = {}
        with dm.create_context(config=cfg, device="cpu") as ctx:
            # False before any True (an error naming the argument, nothing run), on both
            # ranks; then on rank 0 only: rank 1's call names the peer's argument
            r["early_false"] = _raised_arg(lambda: _call(dm, inp, ctx, w13, w2, False))
            r["peer_false"] = _raised_arg(
                lambda: _call(dm, inp, ctx, w13, w2, False if rank == 0 else None))
            r["bad_value"] = _raised_arg(lambda: _call(dm, inp, ctx, w13, w2, 1))
            none0 = _call(dm, inp, ctx, w13, w2, None)
            first = _call(dm, inp, ctx, w13, w2, True)
            again = _call(dm, inp, ctx, w13, w2, False)
            with torch.no_grad():
                w13.data.add_(0.05 * torch.randn_like(w13))    # an optimizer step (.data)
                w2.data.mul_(1.1)
            stale = _call(dm, inp, ctx, w13, w2, False)
            none1 = _call(dm, inp, ctx, w13, w2, None)
            fresh = _call(dm, inp, ctx, w13, w2, True)
            r.update(first_eq_none=_same(first, none0), reuse_eq_first=_same(again, first),
                     stale_eq_old=_same(stale, none0), new_differs=not _same(none1, none0),
                     refresh_eq_new=_same(fresh, none1), entries=len(ctx.weight_cache),
                     fills=ctx.weight_cache.fills, hits=ctx.weight_cache.hits)
        res[precision] = r
    return res


@pytest.fixture(scope="module")
def results():
    return tt.spawn(_worker, 2, timeout_s=300)


@pytest.mark.parametrize("precision", ["fp8_block", "mxfp8"])
def test_first_microbatch_fills_and_later_ones_reuse(results, precision):
    for rank, res in enumerate(results):
        r = res[precision]
        assert r["early_false"] == "is_first_microbatch", (rank, r)
        assert r["peer_false"] == "is_first_microbatch", (rank, r)   # rank 1: the peer's
        assert r["bad_value"] == "is_first_microbatch", (rank, r)
        assert r["first_eq_none"] and r["reuse_eq_first"], (rank, r)  # a quantizing call's bits
        assert r["new_differs"], (rank, r)                            # None sees the update
        assert r["stale_eq_old"], (rank, r)                           # False keeps the copy
        assert r["refresh_eq_new"], (rank, r)                         # True requantizes
        assert (r["entries"], r["fills"], r["hits"]) == (1, 2, 2), (rank, r)


def test_bf16_ignores_the_argument(results):
    for rank, res in enumerate(results):
        r = res["bf16"]
        assert r["early_false"] is None and r["bad_value"] == "is_first_microbatch", (rank, r)
        assert r["first_eq_none"] and r["reuse_eq_first"] and r["refresh_eq_new"], (rank, r)
        assert not r["stale_eq_old"] and r["entries"] == 0, (rank, r)   # it reads the weights


def test_an_entry_belongs_to_its_tensors_storage():
    """Another tensor at the same address (two storages over one buffer here; a caching
    allocator's reused block in practice) finds no entry: False raises, True fills its own;
    entries of freed tensors are dropped by the next fill."""
    import numpy as np

    from megatron_dist_moe.errors import RoutedExpertsInputError
    from megatron_dist_moe.weight_cache import WeightCache
    buf13, buf2 = np.zeros((2, 8, 4), np.float32), np.zeros((2, 4, 4), np.float32)
    a13, a2 = torch.from_numpy(buf13), torch.from_numpy(buf2)
    b13, b2 = torch.from_numpy(buf13), torch.from_numpy(buf2)   # same addresses, new storages
    assert a13.data_ptr() == b13.data_ptr()
    cache = WeightCache("fp8_block")
    assert cache.resolve(a13, a2, True, lambda entry: "A") == "A"
    assert cache.resolve(a13, a2, False, lambda entry: "unused") == "A"
    assert cache.resolve(a13.view(2, 2, 4, 4), a2, False, lambda e: "unused") == "A"   # a view
    with pytest.raises(RoutedExpertsInputError, match="is_first_microbatch"):
        cache.check(b13, b2, False)
    assert cache.resolve(b13, b2, True, lambda entry: ("B", entry)) == ("B", None)
    c13, c2 = torch.zeros(2, 8, 4), torch.zeros(2, 4, 4)
    cache.resolve(c13, c2, True, lambda entry: "C")
    assert len(cache) == 2
    del c13, c2
    cache.resolve(b13, b2, True, lambda entry: entry)        # a fill drops the dead entry
    assert len(cache) == 1 and cache.resolve(b13, b2, False, None) == ("B", None)
    assert cache.resolve(a13, a2, None, None) is None         # None: no cache involved
    assert WeightCache("bf16").resolve(a13, a2, False, None) is None

"""nvfp4 inference on prepared weights (prepared.py), reference backend on 2 spawned gloo ranks.

Accuracy: y against the fp64 oracle on the dequantized prepared weights (the weights'
quantization is the model; x and h2 are quantized by the layer) must stay within 2x of the
error the same quantization emulated in plain torch makes (testing.nvfp4_emulation), and close
to that emulation itself (the same math: only summation orders and rounding flips differ).
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

import megatron_dist_moe as dm
from megatron_dist_moe import testing as tt

EP = 2


def _config(**kw):
    base = dict(num_local_input_tokens=48, hidden_dim=128, intermediate_dim=256, top_k=2,
                num_experts=8, backend="reference", precision="nvfp4", inference=True,
                num_activation_slots=0)
    base.update(kw)
    return dm.Config(**base)


def _worker(rank, ws):
    out = {}
    for name, routing, kw in (("random", "random", {}), ("hot_expert", "hot_expert", {}),
                              ("clamped", "random", dict(activation="swiglu_clamped"))):
        cfg = _config(**kw)
        p = tt.make_problem(cfg, ws, seed=21 + len(name), dtype=torch.bfloat16, routing=routing)
        tok, exp = p.tokens(rank), p.experts(rank)
        prepared = dm.prepare_expert_weights(p.w13[exp].contiguous(), p.w2[exp].contiguous())
        with dm.create_context(config=cfg, device="cpu") as ctx:
            with torch.no_grad():
                y = dm.routed_experts(p.x[tok], p.ids[tok], p.scores[tok], prepared.w13,
                                      prepared.w2, ctx)
            errors = {}
            # bad inputs, each before anything is written; the context stays usable
            for arg, call in (
                    ("w13", lambda: dm.routed_experts(p.x[tok], p.ids[tok], p.scores[tok],
                                                      p.w13[exp].contiguous(), prepared.w2,
                                                      ctx)),
                    ("w2", lambda: dm.routed_experts(p.x[tok], p.ids[tok], p.scores[tok],
                                                     prepared.w13, prepared.w13, ctx)),
                    ("x", lambda: dm.routed_experts(p.x[tok].float(), p.ids[tok],
                                                    p.scores[tok], prepared.w13, prepared.w2,
                                                    ctx)),
                    # a corrupt global scale would zero or blow up y without a trace
                    ("w2", lambda: dm.routed_experts(
                        p.x[tok], p.ids[tok], p.scores[tok], prepared.w13,
                        dataclasses.replace(prepared.w2, global_scale=torch.full_like(
                            prepared.w2.global_scale, float("nan"))), ctx)),
                    ("w13", lambda: dm.routed_experts(
                        p.x[tok], p.ids[tok], p.scores[tok],
                        dataclasses.replace(prepared.w13,
                                            global_scale=-prepared.w13.global_scale),
                        prepared.w2, ctx))):
                try:
                    call()
                    errors.setdefault(arg, []).append("no error")
                except dm.RoutedExpertsInputError as e:
                    errors.setdefault(arg, []).append(e.arg)
            with torch.no_grad():
                y2 = dm.routed_experts(p.x[tok], p.ids[tok], p.scores[tok], prepared.w13,
                                       prepared.w2, ctx)
        oracle = tt.nvfp4_oracle_y(p, cfg)[tok]
        em = tt.nvfp4_emulation(p, cfg)[tok]
        out[name] = dict(err=tt.relative_error(y, oracle), emul=tt.relative_error(em, oracle),
                         vs_emulation=tt.relative_error(y, em), errors=errors,
                         repeat_equal=bool(torch.equal(y, y2)), dtype=str(y.dtype))
    return out


@pytest.fixture(scope="module")
def results():
    return tt.spawn(_worker, EP, timeout_s=120)


@pytest.mark.parametrize("case", ["random", "hot_expert", "clamped"])
def test_y_within_twice_the_emulated_nvfp4_error(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["err"] <= 2 * r["emul"], f"rank {rank} {case}: {r}"
        assert 0.02 < r["err"] < 0.3, f"rank {rank} {case}: quantized for real? {r}"
        assert r["vs_emulation"] < 0.5 * r["emul"], f"rank {rank} {case}: {r}"
        assert r["repeat_equal"] and r["dtype"] == "torch.bfloat16"


def test_bad_inputs_name_the_argument(results):
    for res in results:
        assert res["random"]["errors"] == dict(w13=["w13", "w13"], w2=["w2", "w2"], x=["x"])


def test_prepared_weights_round_trip_through_torch_save():
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(4, 2, 64, 128, generator=g), torch.randn(4, 128, 64, generator=g)
    p = dm.prepare_expert_weights(w13.to(torch.bfloat16), w2.to(torch.bfloat16))
    assert p.w13.shape == (4, 128, 128) and p.w2.shape == (4, 128, 64)
    assert p.w13.nbytes < w13.numel() * 2 / 3.5      # ~3.6x smaller than bf16
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    q = torch.load(buf)            # the default weights_only=True load
    for a, b in ((p.w13, q.w13), (p.w2, q.w2)):
        assert torch.equal(a.packed, b.packed) and torch.equal(a.global_scale, b.global_scale)
        assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
        assert a.shape == b.shape and a.precision == b.precision
    assert torch.equal(p.w13.dequantize(), q.w13.dequantize())


@pytest.mark.parametrize("kw,arg", [
    (dict(precision="fp8_block"), "precision"),
    (dict(w2=torch.zeros(4, 128, 32)), "w2"),
    (dict(w13=torch.zeros(4, 128, 120), w2=torch.zeros(4, 120, 64)), "w13"),
    (dict(w13=torch.zeros(4, 128, 128, dtype=torch.int32)), "w13"),
    (dict(w13="weights"), "w13"),
    (dict(w13=torch.zeros(0, 128, 128), w2=torch.zeros(0, 128, 64)), "w13"),
    (dict(w13=torch.zeros(4, 128, 128, device="meta")), "w13"),
    # NVFP4's amax ignores NaN: without the check these would be stored as finite values
    (dict(w13=torch.zeros(4, 128, 128).index_fill_(2, torch.tensor([5]), float("nan"))), "w13"),
    (dict(w2=torch.zeros(4, 128, 64).index_fill_(1, torch.tensor([7]), float("inf"))), "w2"),
])
def test_prepare_refuses_bad_weights_naming_the_argument(kw, arg):
    args = dict(w13=torch.zeros(4, 128, 128), w2=torch.zeros(4, 128, 64))
    args.update(kw)
    with pytest.raises(dm.RoutedExpertsInputError) as e:
        dm.prepare_expert_weights(**args)
    assert e.value.arg == arg
    assert str(e.value).startswith(f"prepare_expert_weights({arg}): "), str(e.value)


def test_nvfp4_needs_an_inference_context_and_a_pipeline_that_runs_it():
    with pytest.raises(dm.ConfigError, match="inference"):
        _config(inference=False, num_activation_slots=1)
    with pytest.raises(dm.ConfigError, match="pipeline"):
        _config(backend="cuda", pipeline="mega")


def test_row_kernels_refuse_widths_they_cannot_store():
    """The NVFP4 row quantizers store each row's fp32 S_dec at byte K/2 + K/16 (4-byte aligned
    only for K % 64 == 0), the fan-out reads whole byte rows: both refuse before any launch."""
    from megatron_dist_moe.kernels import quant_nvfp4 as KN
    n = torch.tensor([2], dtype=torch.int32)
    x = torch.zeros(2, 96, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="multiple of 64"):
        KN.quantize_rows(x, n, 2, 96, out=torch.zeros(2, 64, dtype=torch.uint8))
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(AssertionError, match="ids16"):
        KN.publish_quantized(torch.zeros(2, 128, dtype=torch.bfloat16), ids,
                             torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int16),
                             torch.zeros(2, 256, dtype=torch.uint8), out_stride=256)
    with pytest.raises(AssertionError, match="src_stride_bytes"):
        KN.fanout_dequantize(torch.zeros(1, dtype=torch.int64), 64,
                             torch.zeros(4, dtype=torch.int32), 2, 2,
                             torch.zeros(1, dtype=torch.int64), n, 128,
                             a16=torch.zeros(1, dtype=torch.int64))
    # S_dec alone in the byte rows only where a16 holds the values
    with pytest.raises(AssertionError, match="s_dec_only=True needs a16"):
        KN.quantize_rows(torch.zeros(2, 128, dtype=torch.bfloat16), n, 2, 128,
                         out=torch.zeros(2, 128, dtype=torch.uint8), s_dec_only=True)

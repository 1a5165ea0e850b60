"""The rows an inference call's bf16 GEMM A regions keep past R (layout.GEMM_A_TAIL_ROWS), and
who passes them on: the pipelines to the GEMM launchers, the launchers to their TMA descriptors.

Why they exist: a grouped GEMM tile whose TMA box reaches past R takes TMA's out-of-bounds path,
slower the more of the box lies outside (decode: 1 row per expert in a 64-row box). With the
tail the descriptor spans readable rows instead; what the GEMM computes from them is never
stored. On the GPU: inference_check (its arena starts NaN-filled, so a tail row that reached a
stored output would fail its oracle), scripts/device/gemm_a_tail.py (NaN tails, y bitwise
against no tail; the time) and bench_decode. The interpreter does not use TMA, so the CPU tests
stop at what the launchers receive.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import megatron_dist_moe as dm
from megatron_dist_moe import layout as L

D, F = 64, 128


def test_inference_layouts_keep_tails_at_the_gemm_a_regions():
    assert L.GEMM_A_TAIL_ROWS == 128
    assert L.tail_rows("inference", D, F) == {"x_g": 128, "h2": 128}
    assert L.tail_rows("inference", D, F, "mxfp8") == {"x_g": 128, "h2q": 128}
    # fp8_block and nvfp4 read their A operands another way (fp8 descriptors, CUDA GEMMs)
    assert L.tail_rows("inference", D, F, "fp8_block") == {}
    assert L.tail_rows("inference", D, F, "nvfp4") == {}
    for mode in L.TRAINING_MODES:       # saved and training regions keep none
        for precision in ("bf16", "mxfp8", "fp8_block"):
            assert L.tail_rows(mode, D, F, precision) == {}, (mode, precision)
    for R in (0, 1, 5, 200):
        lay = L.call_layout("inference", R, D, F)
        assert lay["x_g"].nbytes == -(-2 * D * (R + 128) // 128) * 128
        assert "h1" not in lay   # nothing reads an inference forward's h1
        assert lay["h2"].nbytes == -(-2 * F * (R + 128) // 128) * 128


def test_training_contexts_size_their_scratch_for_inference_forwards_too():
    # a training context runs inference forwards (no_grad, checkpoint recompute) in the
    # inference layout, so its scratch holds that layout, tails included
    assert L.modes_of(True) == L.TRAINING_MODES + L.INFERENCE_MODES
    assert L.modes_of(False) == L.INFERENCE_MODES
    for R in (1, 16, 1000):
        assert L.scratch_bytes(R, D, F, True) >= L.call_layout("inference", R, D, F).total


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, name):
        def record(*args, **kw):
            self.calls.append((name, kw))
        return record


def _pipeline(precision: str, pipeline: str, monkeypatch):
    from megatron_dist_moe.backends.cuda import experts as X
    # 128-wide features: mxfp8 and fp8_block need multiples of 128
    cfg = dm.Config(num_local_input_tokens=4, hidden_dim=128, intermediate_dim=F, top_k=2,
                    num_experts=2, precision=precision, pipeline=pipeline)
    cls = {("bf16", "standard"): X.StandardPipeline, ("bf16", "mega"): X.MegaPipeline,
           ("bf16", "staged"): X.StagedPipeline,
           ("mxfp8", "standard"): X.Mxfp8Pipeline}[(precision, pipeline)]
    # (mxfp8: the EP = 1 default, the quantizer reading the rows where they lie)
    pipe = cls(cfg, SimpleNamespace(wait_timeout_s=10.0, quantizer_gathers=True), 2, 8,
               torch.device("cpu"), 0)
    rec = _Recorder()
    import megatron_dist_moe.kernels.grouped_gemm as G
    from megatron_dist_moe.kernels.grouped_gemm import mega
    monkeypatch.setattr(G, "grouped_mm_fwd", rec("grouped_mm_fwd"))
    monkeypatch.setattr(mega, "mega_fwd", rec("mega_fwd"))
    monkeypatch.setattr(pipe.k, "gather", rec("gather"))
    if precision == "mxfp8":
        monkeypatch.setattr(pipe.mx, "quantize", rec("quantize"))
        monkeypatch.setattr(pipe.mx, "swiglu_quant", rec("swiglu_quant"))
    return pipe, rec


@pytest.mark.parametrize("precision,pipeline,want", [
    ("bf16", "standard", [("grouped_mm_fwd", "a_tail_rows", 128)] * 2),
    ("mxfp8", "standard", [("grouped_mm_fwd", "a_tail_rows", 128)] * 2),
    ("bf16", "mega", [("mega_fwd", "xg_tail_rows", 128), ("mega_fwd", "h2_tail_rows", 128)]),
    ("bf16", "staged", [("grouped_mm_fwd", "a_tail_rows", 128)] * 2),   # W13 in claim mode
])
def test_inference_forwards_pass_the_tails_and_training_forwards_none(monkeypatch, precision,
                                                                        pipeline, want):
    pipe, rec = _pipeline(precision, pipeline, monkeypatch)
    tabs = SimpleNamespace(expert_offsets=torch.tensor([0, 3, 8], dtype=torch.int32),
                           num_rows=torch.tensor([8], dtype=torch.int32), fwd_gather_ptrs=None)
    ptr = torch.zeros(1, dtype=torch.int64)
    at = {n: ptr for n in ("x_g", "x_c", "x_c_s", "h1", "h1q", "h1q_s", "h2", "h2q")}
    w13, w2 = torch.zeros(2, 2 * F, 128), torch.zeros(2, 128, F)
    scatter = torch.zeros(8, dtype=torch.int64)
    prepared = (w13, w2) if precision == "mxfp8" else None
    for training, rows in ((False, 128), (True, 0)):
        rec.calls.clear()
        pipe.forward(tabs, w13, w2, scatter, at, prepared=prepared, training=training)
        got = [(name, key, kw[key]) for name, kw in rec.calls
               for key in ("a_tail_rows", "xg_tail_rows", "h2_tail_rows") if key in kw]
        assert got == [(n, k, rows) for n, k, _ in want], (training, got)


@pytest.mark.parametrize("pipeline", ["standard", "mega", "staged"])
def test_bf16_inference_forwards_store_no_h1(monkeypatch, pipeline):
    # the inference layout has no h1 region (nothing reads h1 after an inference forward): the
    # W13 launch gets h1=None there, and the region's address in a training forward
    pipe, rec = _pipeline("bf16", pipeline, monkeypatch)
    tabs = SimpleNamespace(expert_offsets=torch.tensor([0, 3, 8], dtype=torch.int32),
                           num_rows=torch.tensor([8], dtype=torch.int32), fwd_gather_ptrs=None)
    w13, w2 = torch.zeros(2, 2 * F, 128), torch.zeros(2, 128, F)
    scatter = torch.zeros(8, dtype=torch.int64)
    h1_addr = torch.full((1,), 1234, dtype=torch.int64)
    for training in (False, True):
        names = ("x_g", "h2") + (("h1",) if training else ())
        at = {n: h1_addr if n == "h1" else torch.zeros(1, dtype=torch.int64) for n in names}
        rec.calls.clear()
        pipe.forward(tabs, w13, w2, scatter, at, training=training)
        w13_calls = [kw for name, kw in rec.calls if name == "mega_fwd"
                     or kw.get("epilogue") == "swiglu"]
        assert len(w13_calls) == 1, rec.calls
        assert w13_calls[0]["h1"] is (h1_addr if training else None), (training, w13_calls[0]["h1"])


def test_launchers_check_the_tail_against_a_dense_a(monkeypatch):
    from megatron_dist_moe.kernels.grouped_gemm import grouped_mm_fwd, mm
    seen = []
    monkeypatch.setattr(mm, "_launch_mm", lambda args, *a, **k: seen.append(args.a_tail))
    E, R = 2, 8
    w = torch.zeros(E, 32, 16)
    offs = torch.tensor([0, 3, R], dtype=torch.int32)
    out = torch.zeros(R, 32)
    grouped_mm_fwd(w=w, expert_offsets=offs, max_rows=R, a=torch.zeros(R + 4, 16), out=out,
                   a_tail_rows=4)
    grouped_mm_fwd(w=w, expert_offsets=offs, max_rows=R, a=torch.zeros(R, 16), out=out)
    assert seen == [4, 0]
    with pytest.raises(AssertionError, match="a_tail_rows=5.*max_rows \\+ a_tail_rows = 13"):
        grouped_mm_fwd(w=w, expert_offsets=offs, max_rows=R, a=torch.zeros(R + 4, 16),
                       out=out, a_tail_rows=5)
    # claim mode: the copy the GEMM reads (a_copy_out) must hold the tail
    from megatron_dist_moe.kernels.grouped_gemm import ClaimFlags
    claim = dict(a_row_ptrs=torch.zeros(R, dtype=torch.int64),
                 claim_flags=ClaimFlags(R, None, E, "cpu"), out=out)
    grouped_mm_fwd(w=w, expert_offsets=offs, max_rows=R, a_copy_out=torch.zeros(R + 4, 16),
                   a_tail_rows=4, **claim)
    assert seen[-1] == 4
    with pytest.raises(AssertionError, match="a_tail_rows=8.*= 16 rows"):
        grouped_mm_fwd(w=w, expert_offsets=offs, max_rows=R, a_copy_out=torch.zeros(R + 4, 16),
                       a_tail_rows=8, **claim)
    with pytest.raises(AssertionError, match="a_tail_rows=-1"):
        grouped_mm_fwd(w=w, expert_offsets=offs, max_rows=R, a=torch.zeros(R, 16), out=out,
                       a_tail_rows=-1)


def test_mega_checks_the_tails_against_dense_xg_and_h2():
    from megatron_dist_moe.kernels.grouped_gemm.mega import MegaFlags, mega_fwd
    E, R = 2, 8
    offs = torch.tensor([0, 3, R], dtype=torch.int32)
    args = dict(w13=torch.zeros(E, 2 * 32, 32), w2=torch.zeros(E, 32, 32), expert_offsets=offs,
                max_rows=R, h2=torch.zeros(R, 32), out_row_ptrs=torch.zeros(R, dtype=torch.int64),
                flags=MegaFlags(R, E, "cpu"))
    with pytest.raises(AssertionError, match="xg_tail_rows=8.*max_rows \\+ xg_tail_rows = 16"):
        mega_fwd(xg=torch.zeros(R + 4, 32), xg_tail_rows=8, **args)
    with pytest.raises(AssertionError, match="xg_tail_rows=-2"):
        mega_fwd(xg=torch.zeros(R, 32), xg_tail_rows=-2, **args)
    # h2: the W2 items read it through TMA on a GPU, so its tail is checked alike
    args["xg"] = torch.zeros(R, 32)
    with pytest.raises(AssertionError, match="h2_tail_rows=4.*max_rows \\+ h2_tail_rows = 12"):
        mega_fwd(h2_tail_rows=4, **args)
    with pytest.raises(AssertionError, match="h2_tail_rows=-1"):
        mega_fwd(h2_tail_rows=-1, **{**args, "h2": torch.zeros(R + 4, 32)})


def test_explain_shows_the_no_grad_forward_of_a_training_context():
    c = dm.Config(num_local_input_tokens=4, hidden_dim=D, intermediate_dim=F, top_k=2,
                  num_experts=4)
    p = dm.plan_memory(c, ep_size=2)
    R = p.device_scratch_rows
    assert f"no_grad forward at device R   {p.layer.inference_scratch(R):>16,} B" in p.explain()
    assert p.layer.inference_scratch(R) == L.call_layout("inference", R, D, F).total
    assert p.device_scratch_bytes >= p.layer.inference_scratch(R)

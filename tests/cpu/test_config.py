"""Config validation (every error names its field) and the YAML presets."""

from __future__ import annotations

from pathlib import Path

import pytest

import megatron_dist_moe as dm
from megatron_dist_moe.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHAPE = dict(num_local_input_tokens=64, hidden_dim=128, intermediate_dim=128, top_k=2,
             num_experts=8)


def make(**kw):
    return dm.Config(**{**SHAPE, **kw})


BAD = [
    # (field named in the error, overrides)
    ("num_local_input_tokens", dict(num_local_input_tokens=0)),
    ("num_local_input_tokens", dict(num_local_input_tokens=True)),
    ("num_local_input_tokens", dict(num_local_input_tokens=2**30, top_k=2)),
    ("hidden_dim", dict(hidden_dim=100)),
    ("hidden_dim", dict(hidden_dim=64.0)),
    ("intermediate_dim", dict(intermediate_dim=96)),
    ("intermediate_dim", dict(intermediate_dim=192, precision="fp8_block")),
    ("hidden_dim", dict(hidden_dim=64, precision="mxfp8")),
    ("top_k", dict(top_k=-1)),
    ("top_k", dict(top_k=9)),
    ("num_experts", dict(num_experts=0)),
    ("precision", dict(precision="fp16")),
    ("precision", dict(precision="nvfp4")),               # nvfp4 without inference
    ("pipeline", dict(pipeline="fast")),
    ("activation", dict(activation="gelu")),
    ("backend", dict(backend="triton")),
    ("wgrad_dtype", dict(wgrad_dtype="fp16")),
    ("inference", dict(inference=1)),
    ("num_activation_slots", dict(num_activation_slots=0)),   # training needs a slot
    ("num_activation_slots", dict(num_activation_slots=-1, inference=True)),
    ("num_activation_slots", dict(num_activation_slots=1.0)),
    ("max_moe_layers_per_activation_slot", dict(max_moe_layers_per_activation_slot=0)),
    ("activation_slot_bytes", dict(activation_slot_bytes=1 << 20,
                                   activation_slot_capacity_factor=1.0)),
    ("activation_slot_bytes", dict(activation_slot_bytes=-128)),
    ("activation_slot_bytes", dict(activation_slot_bytes=1.5)),
    ("activation_slot_capacity_factor", dict(activation_slot_capacity_factor=-0.5)),
    ("activation_slot_capacity_factor", dict(activation_slot_capacity_factor=float("nan"))),
    ("device_scratch_capacity_factor", dict(device_scratch_capacity_factor=0.0)),
    ("host_scratch_capacity_factor", dict(host_scratch_capacity_factor=1.0)),  # below device 2.0
    ("swiglu_limit", dict(activation="swiglu_clamped", swiglu_limit=0.0)),
    # float fields: numbers (a YAML string such as "inf" is not one), finite
    ("device_scratch_capacity_factor", dict(device_scratch_capacity_factor="2")),
    ("device_scratch_capacity_factor", dict(device_scratch_capacity_factor=float("inf"))),
    ("activation_slot_capacity_factor", dict(activation_slot_capacity_factor="1")),
    ("activation_slot_capacity_factor", dict(activation_slot_capacity_factor=float("inf"))),
    ("host_scratch_capacity_factor", dict(host_scratch_capacity_factor=float("inf"))),
    ("swiglu_limit", dict(activation="swiglu_clamped", swiglu_limit="7")),
    ("swiglu_alpha", dict(swiglu_alpha=float("nan"))),
    ("swiglu_alpha", dict(swiglu_alpha="x")),
    ("wait_timeout_s", dict(wait_timeout_s=0)),
    ("wait_timeout_s", dict(wait_timeout_s="10")),
    # what no backend runs is refused when the Config is built, naming the field
    ("pipeline", dict(precision="mxfp8", backend="cuda", pipeline="staged")),
    ("pipeline", dict(precision="nvfp4", inference=True, num_activation_slots=0, backend="cuda",
                      pipeline="staged")),
    ("fp8_power_2_scales", dict(precision="fp8_block", fp8_power_2_scales=1)),
    ("fp8_amax_epsilon", dict(precision="fp8_block", fp8_amax_epsilon=-1e-3)),
    ("pipeline", dict(precision="fp8_block", backend="cuda", pipeline="mega")),
]


@pytest.mark.parametrize("field,kw", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_invalid_config_names_the_field(field, kw):
    with pytest.raises(ValueError) as info:
        make(**kw)
    assert isinstance(info.value, ConfigError)
    assert info.value.field == field
    assert f"Config.{field}" in str(info.value)


def test_what_does_not_run_says_what_runs():
    with pytest.raises(ConfigError) as info:
        make(precision="mxfp8", backend="cuda", pipeline="mega")
    msg = str(info.value)
    assert "does not run" in msg or "no backend runs" in msg
    assert "what runs:" in msg and "'bf16' (standard/staged/mega)" in msg
    assert "'fp8_block' (standard)" in msg


def test_a_pipeline_a_precision_does_not_run_with_names_the_pipeline():
    with pytest.raises(ConfigError) as info:
        make(precision="fp8_block", pipeline="staged", backend="cuda")
    assert info.value.field == "pipeline"


def test_valid_combinations():
    make()
    make(pipeline="staged", backend="reference")
    make(activation="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=7.0)
    make(host_scratch_capacity_factor=8.0, device_scratch_capacity_factor=2.0)
    make(activation_slot_bytes=0)
    make(precision="fp8_block", backend="cuda")
    make(precision="fp8_block", pipeline="staged", backend="reference")
    make(precision="mxfp8", backend="reference")


def test_frozen_and_replace_validates():
    cfg = make()
    with pytest.raises(Exception):
        cfg.top_k = 3
    assert cfg.replace(top_k=4).top_k == 4
    with pytest.raises(ConfigError, match="Config.top_k"):
        cfg.replace(top_k=100)


def test_num_local_experts():
    cfg = make()
    assert cfg.num_local_experts(4) == 2
    with pytest.raises(ConfigError, match="Config.num_experts.*3"):
        cfg.num_local_experts(3)
    with pytest.raises(ValueError, match="ep_size"):
        cfg.num_local_experts(0)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ConfigError, match="unknown field") as info:
        dm.Config.from_dict({**SHAPE, "hiden_dim": 3})
    assert info.value.field == "hiden_dim"
    assert "did you mean 'hidden_dim'" in str(info.value)
    assert dm.Config.from_dict(make().to_dict()) == make()


def test_replace_and_load_config_name_an_unknown_field(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'top_k'") as info:
        make().replace(topk=2)
    assert info.value.field == "topk"
    path = tmp_path / "c.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in make().to_dict().items()
                            if not isinstance(v, (dict, list)) and v is not None))
    assert dm.load_config(path) == make()
    with pytest.raises(ConfigError, match="num_activation_slot") as info:
        dm.load_config(path, num_activation_slot=2)
    assert info.value.field == "num_activation_slot"


PRESETS = {
    "guide_bench": (2048, 7168, 3072, 384, 6),
    "deepseek_v3": (4096, 7168, 2048, 256, 8),
    "tiny": (64, 128, 128, 8, 2),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load(name):
    cfg = dm.load_config(CONFIGS / f"{name}.yaml")
    T, D, F, E, K = PRESETS[name]
    assert (cfg.num_local_input_tokens, cfg.hidden_dim, cfg.intermediate_dim, cfg.num_experts,
            cfg.top_k) == (T, D, F, E, K)
    assert not cfg.inference


def test_load_config_overrides_and_nested_key(tmp_path):
    cfg = dm.load_config(CONFIGS / "tiny.yaml", top_k=4, precision="bf16")
    assert cfg.top_k == 4
    p = tmp_path / "nested.yaml"
    p.write_text("dist_moe:\n  num_local_input_tokens: 8\n  hidden_dim: 64\n"
                 "  intermediate_dim: 64\n  top_k: 1\n  num_experts: 2\n")
    assert dm.load_config(p).num_experts == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        dm.load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("num_local_input_tokens: 8\nhidden_dim: 64\nintermediate_dim: 64\n"
                    "top_k: 1\nnum_experts: 2\nprecison: bf16\n")
    with pytest.raises(ConfigError, match="precison"):
        dm.load_config(typo)


def test_execution_overrides_are_strict(monkeypatch):
    """The one development override layer: an unknown name or value is an error."""
    from megatron_dist_moe.execution import ENV_OVERRIDES, Execution, parse_overrides

    assert parse_overrides("gemm_engine=torch, routing=torch") == dict(gemm_engine="torch",
                                                                       routing="torch")
    with pytest.raises(ValueError, match="unknown execution override 'gemm'"):
        parse_overrides("gemm=torch")
    with pytest.raises(ValueError, match="routing='cuda'"):
        parse_overrides("routing=cuda")
    with pytest.raises(ValueError, match="not name=value"):
        parse_overrides("torch")
    monkeypatch.setenv(ENV_OVERRIDES, "bookkeeping=fast")
    import torch
    with pytest.raises(ValueError, match="DIST_MOE_EXECUTION: bookkeeping='fast'"):
        Execution.resolve(make(), torch.device("cpu"))
    monkeypatch.delenv(ENV_OVERRIDES)
    ex = Execution.resolve(make(), torch.device("cpu"))
    assert ex.backend == "reference" and "reference" in ex.explain()
    with pytest.raises(ValueError, match="reference backend"):
        Execution.resolve(make(), torch.device("cpu"), {"gemm_engine": "torch"})


@pytest.mark.parametrize("precision, pipeline, gemm", [
    ("bf16", "standard", "Triton persistent grouped GEMMs"),
    ("bf16", "mega", "one persistent Triton launch for the forward"),
    ("fp8_block", "standard", "FP8 block-scaled"),
    ("mxfp8", "standard", "MXFP8 operands' bf16 copies"),
    ("nvfp4", "standard", "NVFP4 grouped GEMMs on prepared weights")])
def test_cuda_execution_explains_every_step(precision, pipeline, gemm):
    from megatron_dist_moe.execution import Execution
    inference = precision == "nvfp4"
    ex = Execution(backend="cuda", precision=precision, pipeline=pipeline, inference=inference,
                   save_route_outputs=False, wait_timeout_s=600.0)
    text = ex.explain()
    keys = ("pipeline", "GEMMs", "x gather", "routing tables", "bookkeeping", "device waits")
    for key in keys + (() if inference else ("backward", "score gradients")):
        assert key in text, (precision, key)
    assert gemm in text
    assert ("quantization" in text) == (precision != "bf16")


@pytest.mark.parametrize("precision, pipeline, inference, rows, want", [
    ("bf16", "standard", True, 48, "W13 FPROP 64x128x128 4w 4st, W2 FPROP 64x128x128"),
    ("bf16", "standard", False, 12288, "W13 FPROP 128x256x64 8w 4st, W2 FPROP 128x256x64"),
    ("bf16", "mega", True, 48, "W13 FPROP 64x128x128 4w 4st, W2 FPROP 64x128x128"),
    ("bf16", "mega", False, 12288, "W13 FPROP 128x256x64 8w 4st, W2 FPROP 128x256x64"),
    ("bf16", "staged", False, 48, "W13 FPROP 128x256x64 8w 4st, W2 FPROP 64x128x128"),
    ("fp8_block", "standard", False, 48, "64x128x128 4w 3st, 2 programs per SM, every GEMM"),
    ("nvfp4", "standard", True, 48, "16x64x128 4w 3st, 4 programs per SM"),
    ("nvfp4", "standard", True, 3072, "256x128x64 8w 4st, 1 program per SM"),
    ("nvfp4", "standard", True, 12288,
     "weights decoded once per call into an fp16 scratch (at most 256 MiB, experts in groups), "
     "then the fp16 GEMM with the global scales (and W13's SwiGLU) in its epilogue: W13 "
     "128x256x64 8w 4st")])
def test_explain_names_the_gemm_tiles(monkeypatch, precision, pipeline, inference, rows, want):
    """explain() shows the tiles the context's GEMMs launch with at its row bound (the decode
    tiles of a small T, also in the Mega kernel, whose W2 items share its W13 tiles; the staged
    pipeline's claimed W13 keeping the training tiles);
    the GPU tables, read without a GPU."""
    import torch
    from megatron_dist_moe.execution import Execution
    from megatron_dist_moe.kernels import common
    from megatron_dist_moe.kernels.grouped_gemm import choice, config, fp8
    for module in (common, choice, config, fp8):   # also under TRITON_INTERPRET=1
        monkeypatch.setattr(module, "interpreting", lambda: False)
    ex = Execution(backend="cuda", precision=precision, pipeline=pipeline, inference=inference,
                   save_route_outputs=False, wait_timeout_s=600.0)
    tiles = choice.gemm_tiles(ex, rows, 6, 7168, 3072, torch.device("cuda"))
    assert want in tiles and f"{rows} rows = {-(-rows // 6)} per expert" in tiles, tiles
    assert ("DGRAD" in tiles) == (not inference and precision != "fp8_block")
    line = [ln for ln in ex.explain(tiles).splitlines() if ln.startswith("GEMM tiles")]
    assert line and line[0].endswith(tiles), line


@pytest.mark.parametrize("precision, pipeline", [("bf16", "mega"), ("bf16", "staged"),
                                                 ("fp8_block", "standard")])
def test_torch_gemm_oracle_runs_bf16_standard_only(precision, pipeline):
    """The torch GEMM oracle has no claims, no Mega work list and no quantized GEMMs: any other
    combination is refused, not silently run as the oracle's standard bf16 pipeline."""
    from megatron_dist_moe.execution import Execution
    with pytest.raises(ValueError, match="gemm_engine='torch'"):
        Execution(backend="cuda", precision=precision, pipeline=pipeline, inference=False,
                  save_route_outputs=False, wait_timeout_s=600.0, gemm_engine="torch")


def test_context_explain_passes_its_row_bound_to_the_tiles(monkeypatch):
    """Context.explain hands the plan's scratch rows, E_local and the shape to
    choice.gemm_tiles on the CUDA backend (and nothing on the reference backend)."""
    import types

    import torch
    from megatron_dist_moe.context import Context
    from megatron_dist_moe.execution import Execution
    from megatron_dist_moe.kernels.grouped_gemm import choice
    seen = []
    monkeypatch.setattr(choice, "gemm_tiles", lambda ex, *a: seen.append(a) or "TILES")
    cfg = dm.Config(num_local_input_tokens=8, hidden_dim=256, intermediate_dim=128, top_k=2,
                    num_experts=4)
    plan = types.SimpleNamespace(total_scratch_rows=40, explain=lambda: "PLAN")
    for backend in ("cuda", "reference"):
        ex = Execution(backend=backend, precision="bf16", pipeline="standard", inference=True,
                       save_route_outputs=False, wait_timeout_s=600.0)
        fake = types.SimpleNamespace(execution=ex, config=cfg, plan=plan, num_local_experts=2,
                                     device=torch.device("cpu"))
        text = Context.explain(fake)
        assert text.startswith("PLAN") and (("TILES" in text) == (backend == "cuda")), text
    assert seen == [(40, 2, 256, 128, torch.device("cpu"))]


def test_fp8_gemm_engine_is_chosen_at_creation(monkeypatch):
    """fp8_block's CUTLASS GEMMs (the W13 FPROP; training: the WGRADs): CUTLASS where the csrc/
    library can be built on a Hopper GPU, Triton elsewhere (here: no GPU), shown by explain();
    the override forces either, and is refused where it means nothing."""
    import torch
    from megatron_dist_moe import execution as X
    from megatron_dist_moe.kernels import grouped_gemm_sm90

    monkeypatch.setattr(grouped_gemm_sm90, "available", lambda: True)
    # a CPU device (the interpreter's CUDA backend) never takes the CUTLASS units
    assert not grouped_gemm_sm90.fp8_gemm_loads(torch.device("cpu"))
    ex = X.Execution(backend="cuda", precision="fp8_block", pipeline="standard",
                     inference=False, save_route_outputs=False, wait_timeout_s=600.0,
                     fp8_gemm="cutlass")
    text = ex.explain()
    assert "CUTLASS sm_90a FP8 blockwise-scaled grouped GEMM" in text
    assert "the W13 FPROP on CUTLASS's sm_90a blockwise-scaled" in text
    assert "W2 DGRAD on CUTLASS storing u = g3 W2, then one SwiGLU-backward pass" in text
    assert "W13 DGRAD on CUTLASS storing dense rows, then one launch scattering" in text
    triton = ex.replace(fp8_gemm="triton").explain()
    assert "Triton FP8 block-scaled grouped WGRAD" in triton and "CUTLASS" not in triton
    assert "W2 DGRAD on Triton storing u = g3 W2, then one SwiGLU-backward pass" in triton
    assert "W2 DGRAD with the SwiGLU backward in its epilogue" in ex.replace(
        precision="bf16", fp8_gemm="triton").explain()
    assert "WGRADs" not in ex.replace(fp8_gemm="triton", inference=True).explain()
    # inference runs the CUTLASS FPROP too (no WGRADs)
    inf = ex.replace(inference=True).explain()
    assert "the W13 FPROP on CUTLASS's" in inf and "WGRADs" not in inf
    with pytest.raises(ValueError, match="fp8_gemm='cutlass' is fp8_block's"):
        ex.replace(precision="bf16")
    assert X.parse_overrides("fp8_gemm=triton") == {"fp8_gemm": "triton"}
    with pytest.raises(ValueError, match="fp8_gemm='torch'"):
        X.parse_overrides("fp8_gemm=torch")
    # resolve: CUTLASS in both modes where the library loads, Triton where it does not
    from megatron_dist_moe.config import Config
    for inference in (False, True):
        cfg = Config(num_local_input_tokens=16, hidden_dim=256, intermediate_dim=128,
                     num_experts=4, top_k=2, precision="fp8_block", backend="cuda",
                     inference=inference)
        for loads, engine in ((True, "cutlass"), (False, "triton")):
            got = X.Execution.resolve(cfg, torch.device("cuda", 0),
                                     cutlass_loads=lambda d: loads)
            assert got.fp8_gemm == engine, (inference, loads)


def test_fp8_rows_stay_where_they_lie_at_ep1():
    """fp8_block (and mxfp8's quantizer) at EP = 1: the quantizer reads the token rows where they
    lie and the combine
    reads the W2 FPROP's dense rows (shown by explain()); at EP > 1 the fan-out copy and the
    scatter; the pulling combine is refused at EP > 1 and with save_route_outputs, the quantizer
    gather for other precisions."""
    import torch
    from megatron_dist_moe import execution as X
    from megatron_dist_moe.config import Config

    cfg = Config(num_local_input_tokens=16, hidden_dim=256, intermediate_dim=128,
                 num_experts=4, top_k=2, precision="fp8_block", backend="cuda")
    cuda = torch.device("cuda", 0)
    one = X.Execution.resolve(cfg, cuda, cutlass_loads=lambda d: True)
    assert (one.fp8_gather, one.fp8_combine) == ("quantizer", "pull")
    text = one.explain()
    assert "inside the quantizer" in text and "which the combine kernel reads" in text, text
    two = X.Execution.resolve(cfg, cuda, cutlass_loads=lambda d: True, ep_size=2)
    assert (two.fp8_gather, two.fp8_combine) == ("fanout", "scatter")
    assert "fan-out" in two.explain() and "scatter to the owners in its epilogue" in two.explain()
    saved = X.Execution.resolve(cfg.replace(save_route_outputs=True), cuda)
    assert (saved.fp8_gather, saved.fp8_combine) == ("quantizer", "scatter")
    got = X.Execution.resolve(cfg, cuda, {"fp8_gather": "fanout", "fp8_combine": "scatter"})
    assert (got.fp8_gather, got.fp8_combine) == ("fanout", "scatter")
    with pytest.raises(ValueError, match="fp8_combine='pull' runs at EP = 1 only"):
        X.Execution.resolve(cfg, cuda, {"fp8_combine": "pull"}, ep_size=2)
    with pytest.raises(ValueError, match="without save_route_outputs"):
        one.replace(save_route_outputs=True)
    with pytest.raises(ValueError, match="fp8_gather='quantizer' is fp8_block's"):
        one.replace(precision="bf16", fp8_combine="scatter", fp8_gemm="triton")
    bf16 = X.Execution.resolve(cfg.replace(precision="bf16"), cuda)
    assert (bf16.fp8_gather, bf16.fp8_combine) == ("fanout", "scatter")
    mx = X.Execution.resolve(cfg.replace(precision="mxfp8"), cuda)
    assert (mx.fp8_gather, mx.fp8_combine) == ("quantizer", "scatter")
    assert "read by the quantizer where its rows lie" in mx.explain()
    assert X.Execution.resolve(cfg.replace(precision="mxfp8"), cuda,
                               ep_size=2).fp8_gather == "fanout"


def test_fp8_quant_engine_is_chosen_at_creation(monkeypatch):
    """fp8_block's quantizer: the CUDA C++ kernel where its library loads, Triton elsewhere and
    for other precisions, shown by explain(); the override forces either and is refused where
    it means nothing; the kernels the backend builds use the chosen one; ranks that disagree
    all run Triton."""
    import torch
    import torch.distributed as dist
    from megatron_dist_moe import Config, execution as X
    from megatron_dist_moe.backends.cuda.experts import Fp8BlockKernels
    from megatron_dist_moe.kernels import quant_fp8_cuda

    # a CPU device (the interpreter's CUDA backend) never takes the CUDA quantizer
    assert not quant_fp8_cuda.loads(torch.device("cpu"))
    cfg = Config(num_local_input_tokens=16, hidden_dim=256, intermediate_dim=128,
                 num_experts=4, top_k=2, precision="fp8_block", backend="cuda")
    cuda = torch.device("cuda", 0)
    ex = X.Execution.resolve(cfg, cuda, fp8_quant_loads=lambda d: True)
    assert ex.fp8_quant == "cuda" and "CUDA C++ (csrc/fp8_block_quant.cu) quantizer" in ex.explain()
    off = X.Execution.resolve(cfg, cuda, fp8_quant_loads=lambda d: False)
    assert off.fp8_quant == "triton" and "Triton quantizer" in off.explain()
    assert X.Execution.resolve(cfg, cuda, {"fp8_quant": "triton"},
                               fp8_quant_loads=lambda d: True).fp8_quant == "triton"
    assert X.Execution.resolve(cfg.replace(precision="mxfp8"), cuda,
                               fp8_quant_loads=lambda d: True).fp8_quant == "triton"
    with pytest.raises(ValueError, match="fp8_quant='cuda' is fp8_block's"):
        ex.replace(precision="mxfp8")
    with pytest.raises(ValueError, match="fp8_quant='cuda' is fp8_block's"):
        ex.replace(backend="reference")
    with pytest.raises(ValueError, match="fp8_quant='torch'"):
        X.parse_overrides("fp8_quant=torch")
    # the backend's kernels load the library when they are made (a failure names the
    # override that avoids it) and call the engine's launcher
    def no_nvcc():
        raise RuntimeError("nvcc not found")
    monkeypatch.setattr(quant_fp8_cuda, "load", no_nvcc)
    with pytest.raises(RuntimeError, match="could not be loaded: nvcc not found\n.*'fp8_quant': "
                                           "'triton'"):
        Fp8BlockKernels(cfg, 4, 64, "triton", torch.device("cpu"), fp8_quant="cuda")
    monkeypatch.setattr(quant_fp8_cuda, "load", lambda: None)
    calls = []
    monkeypatch.setattr(quant_fp8_cuda, "quantize_rows_cols",
                        lambda *a, **k: calls.append(k["recipe"]))
    k = Fp8BlockKernels(cfg, 4, 64, "triton", torch.device("cpu"), fp8_quant="cuda")
    k.quantize(None, None, 256, cols=(None, None), row_ptrs=None)
    assert calls == [k.recipe]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(
        slice(None), [obj, {**obj, "fp8_quant": "triton"}]))
    with pytest.warns(UserWarning, match=r"fp8_quant: every rank runs 'triton': ranks \[1\]"):
        assert X.agree_engines(ex, None).fp8_quant == "triton"


def test_nvfp4_gemm_engine_is_chosen_at_creation(monkeypatch):
    """nvfp4 inference's decode-regime GEMMs: our CUDA C++ kernel where its library loads on a
    Hopper GPU, Triton elsewhere, shown by explain() with the variant at the context's row
    bound; the override forces either and is refused where it means nothing; a library that
    cannot be built leaves Triton with one warning and one attempt; ranks that disagree all run
    Triton."""
    import torch
    import torch.distributed as dist
    from megatron_dist_moe import Config, execution as X
    from megatron_dist_moe.kernels import common
    from megatron_dist_moe.kernels.grouped_gemm import choice, nvfp4_decode

    cfg = Config(num_local_input_tokens=16, hidden_dim=256, intermediate_dim=128,
                 num_experts=4, top_k=2, precision="nvfp4", inference=True, backend="cuda")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    ex = X.Execution.resolve(cfg, cuda, nvfp4_loads=lambda d: True)
    assert ex.nvfp4_gemm == "cuda" and "csrc/nvfp4_decode_mm.cu" in ex.explain()
    assert X.Execution.resolve(cfg, cuda, nvfp4_loads=lambda d: False).nvfp4_gemm == "triton"
    assert X.Execution.resolve(cfg, cuda, {"nvfp4_gemm": "triton"},
                               nvfp4_loads=lambda d: True).nvfp4_gemm == "triton"
    assert "csrc/nvfp4_decode_mm.cu" not in ex.replace(nvfp4_gemm="triton").explain()
    with pytest.raises(ValueError, match="nvfp4_gemm='cuda' is nvfp4's"):
        ex.replace(precision="bf16")
    # the decode GEMM's variant at the row bound (8 rows per expert), the wgmma GEMM's above
    # 16 per expert (stream-K up to 160); Triton's tiles where the engine is "triton"
    tiles = choice.gemm_tiles(ex, 32, 4, 256, 128, cuda)
    assert tiles.startswith("CUDA GEMMs, W13 decode variant 32142"), tiles
    assert "W2 decode variant 32142" in tiles, tiles
    assert "K split over 4 warps" in choice.gemm_tiles(ex, 32, 4, 7168, 3072, cuda)
    assert nvfp4_decode.default_variant(4 * 17, 4, 256) is None
    mid = choice.gemm_tiles(ex, 4 * 17, 4, 256, 128, cuda)
    assert mid.startswith("CUDA GEMMs, W13 wgmma variant 13103214: 128 weight rows x 32"), mid
    assert "stream-K" in mid and "2 blocks per SM" in mid, mid
    big = choice.gemm_tiles(ex, 4 * 33, 4, 256, 128, cuda)
    assert big.startswith("CUDA GEMMs, W13 wgmma variant 3006424: 256 weight rows x 64"), big
    assert "W2 wgmma variant 5012824" in choice.gemm_tiles(ex, 4 * 700, 4, 256, 128, cuda)
    # from memory_plan.NVFP4_DENSE_MIN_ROWS_PER_EXPERT the weights decoded per call, either
    # engine
    for engine in ("cuda", "triton"):
        dense = choice.gemm_tiles(ex.replace(nvfp4_gemm=engine), 4 * 768, 4, 256, 128, cuda)
        assert dense.startswith("dense: the weights decoded once per call"), dense
    assert not choice.gemm_tiles(ex.replace(nvfp4_gemm="triton"), 32, 4, 256, 128,
                                 cuda).startswith("CUDA")
    # CPU devices never take it; a failing build warns once and is not retried
    assert not nvfp4_decode.loads(torch.device("cpu"))
    calls = []

    def failing_lib():
        calls.append(1)
        raise RuntimeError("nvcc failed on nvfp4_decode_mm.cu")
    monkeypatch.setattr(nvfp4_decode.loads, "error", None)
    monkeypatch.setattr(nvfp4_decode, "_run_fn", failing_lib)
    monkeypatch.setattr(common, "interpreting", lambda: False)
    with pytest.warns(UserWarning, match="could not be built or loaded here: nvcc failed"):
        assert not nvfp4_decode.loads(cuda)
    assert not nvfp4_decode.loads(cuda) and len(calls) == 1
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(
        slice(None), [obj, {**obj, "nvfp4_gemm": "triton"}]))
    with pytest.warns(UserWarning, match=r"nvfp4_gemm: every rank runs 'triton': ranks \[1\]"):
        assert X.agree_engines(ex, None).nvfp4_gemm == "triton"



def test_nvfp4_decode_gemm_refuses_what_its_kernel_cannot_read():
    """The CUDA decode GEMM's wrapper checks what the kernel's loads assume (before touching the
    library): 16-byte aligned contiguous packed weights, the rows' widths, one device."""
    import torch
    import megatron_dist_moe as dm
    from megatron_dist_moe.kernels.grouped_gemm.nvfp4_decode import nvfp4_decode_mm
    from megatron_dist_moe.layout import nvfp4_row_bytes
    from megatron_dist_moe.prepared import PreparedWeight
    E, N, K, R = 2, 32, 256, 4
    W = dm.prepare_expert_weights(torch.randn(E, N, K).to(torch.bfloat16),
                                  torch.zeros(E, K, N // 2, dtype=torch.bfloat16)).w13
    offs = torch.tensor([0, 2, 4], dtype=torch.int32)
    a = torch.zeros(R, nvfp4_row_bytes(K), dtype=torch.uint8)
    a16 = torch.zeros(R, K, dtype=torch.float16)
    out = torch.zeros(R, N, dtype=torch.bfloat16)
    kw = dict(a=a, a16=a16, weight=W, expert_offsets=offs, max_rows=R, out=out)
    buf = torch.zeros(W.packed.numel() + 1, dtype=torch.uint8)
    odd = PreparedWeight(buf[1:].view(W.packed.shape), W.scales, W.global_scale, W.shape)
    with pytest.raises(AssertionError, match="16-byte aligned uint8"):
        nvfp4_decode_mm(**{**kw, "weight": odd})
    with pytest.raises(AssertionError, match=r"a16: expected torch.float16 \[R, 256\]"):
        nvfp4_decode_mm(**{**kw, "a16": torch.zeros(R, 128, dtype=torch.float16)})
    with pytest.raises(AssertionError, match=r"a: expected torch.uint8 \[R, 160\]"):
        nvfp4_decode_mm(**{**kw, "a": torch.zeros(R, 100, dtype=torch.uint8)})
    # the wgmma GEMM shares the checks
    from megatron_dist_moe.kernels.grouped_gemm.nvfp4_wgmma import nvfp4_wgmma_mm
    with pytest.raises(AssertionError, match=r"a16: expected torch.float16 \[R, 256\]"):
        nvfp4_wgmma_mm(**{**kw, "a16": torch.zeros(R, 128, dtype=torch.float16)})


def test_fp8_gemm_falls_back_to_triton(monkeypatch):
    """A library that cannot be built or loaded leaves Triton with one warning and one attempt
    per process; ranks that disagree all run Triton."""
    import torch
    import torch.distributed as dist
    from megatron_dist_moe import execution as X
    from megatron_dist_moe.kernels import common, grouped_gemm_sm90

    calls = []

    def failing_load():
        calls.append(1)
        raise RuntimeError("nvcc failed on grouped_gemm_sm90_fp8_wgrad_overlap_f32.cu")
    monkeypatch.setattr(grouped_gemm_sm90.fp8_gemm_loads, "error", None)
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(grouped_gemm_sm90, "available", lambda: True)
    monkeypatch.setattr(grouped_gemm_sm90, "load_library", failing_load)
    with pytest.warns(UserWarning, match="could not be built or loaded here: nvcc failed"):
        assert not grouped_gemm_sm90.fp8_gemm_loads(torch.device("cuda", 0))
    assert not grouped_gemm_sm90.fp8_gemm_loads(torch.device("cuda", 0)) and len(calls) == 1

    ex = X.Execution(backend="cuda", precision="fp8_block", pipeline="standard",
                     inference=False, save_route_outputs=False, wait_timeout_s=600.0,
                     fp8_gemm="cutlass")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)

    def gather(out, obj, group=None):
        out[:] = [obj, {**obj, "fp8_gemm": "triton"}, obj]
    monkeypatch.setattr(dist, "all_gather_object", gather)
    with pytest.warns(UserWarning, match=r"fp8_gemm: every rank runs 'triton': ranks \[1\]"):
        assert X.agree_engines(ex, None).fp8_gemm == "triton"
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * 3))
    assert X.agree_engines(ex, None) is ex
    with pytest.raises(ValueError, match="fp8_gemm='cutlass' is fp8_block's"):
        ex.replace(backend="reference")

"""install() / uninstall(): argument parsing, YAML model configs, the layer redirect, the launcher.

These tests patch Megatron in the pytest process itself; the `installed` fixture always undoes it.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import textwrap
import typing

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("megatron.training")

import megatron_dist_moe.megatron as dmm  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "megatron", "*.yaml")))


@pytest.fixture
def installed():
    dmm.install()
    try:
        yield
    finally:
        dmm.uninstall()


def _patched_objects():
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import arguments

    return {
        "add_megatron_arguments": arguments.add_megatron_arguments,
        "MoELayer.__init__": MoELayer.__dict__["__init__"],
        "forward_step": schedules.forward_step,
        "backward_step": schedules.backward_step,
        "no_pipelining": schedules.forward_backward_no_pipelining,
        "1f1b": schedules.forward_backward_pipelining_without_interleaving,
        "interleaved": schedules.forward_backward_pipelining_with_interleaving,
        "literal": TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"].type,
    }


def _megatron_parser():
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def test_install_is_idempotent_keeps_wrapped_and_uninstall_restores():
    assert not dmm.is_installed()
    before = _patched_objects()
    dmm.install()
    try:
        first = _patched_objects()
        dmm.install()   # second call: no double wrapping
        assert _patched_objects() == first
        assert dmm.is_installed()
        for name in before:
            if name == "literal":
                assert typing.get_args(first[name]) == (*typing.get_args(before[name]), "dist_moe")
            else:
                assert first[name] is not before[name]
                assert first[name].__wrapped__ is before[name], name
    finally:
        dmm.uninstall()
    assert not dmm.is_installed()
    assert _patched_objects() == before
    dmm.uninstall()   # harmless when nothing is installed


def test_cli_accepts_dist_moe_only_after_install(capsys):
    with pytest.raises(SystemExit):
        _megatron_parser().parse_args(["--moe-token-dispatcher-type", "dist_moe"])
    assert "invalid choice: 'dist_moe'" in capsys.readouterr().err
    dmm.install()
    try:
        args = _megatron_parser().parse_args(
            ["--moe-token-dispatcher-type", "dist_moe", "--dist-moe-backend", "reference",
             "--dist-moe-activation-slot-capacity-factor", "0.5"])
        assert args.moe_token_dispatcher_type == "dist_moe"
        from megatron_dist_moe.megatron.config_map import DistMoEOptions, options_from_args

        assert options_from_args(args) == DistMoEOptions(backend="reference",
                                                         activation_slot_capacity_factor=0.5)
        # Megatron's other dispatchers stay valid
        assert _megatron_parser().parse_args(
            ["--moe-token-dispatcher-type", "alltoall"]).moe_token_dispatcher_type == "alltoall"
    finally:
        dmm.uninstall()
    with pytest.raises(SystemExit):
        _megatron_parser().parse_args(["--moe-token-dispatcher-type", "dist_moe"])


def test_argument_factory_reads_the_extended_literal(installed):
    """Megatron-Core 0.19 derives the flag's choices from the TransformerConfig annotation."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.argument_utils import ArgumentGroupFactory

    from dataclasses import fields

    parser = argparse.ArgumentParser()
    others = [f.name for f in fields(TransformerConfig) if f.name != "moe_token_dispatcher_type"]
    ArgumentGroupFactory(TransformerConfig, exclude=others).build_group(parser, "transformer")
    assert parser.parse_args(["--moe-token-dispatcher-type", "dist_moe"]
                             ).moe_token_dispatcher_type == "dist_moe"


def test_hard_coded_choices_of_older_megatron_lm_are_extended():
    from megatron_dist_moe.megatron.patches import add_dist_moe_arguments

    parser = argparse.ArgumentParser()
    parser.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"])
    add_dist_moe_arguments(parser)
    add_dist_moe_arguments(parser)   # idempotent
    assert parser.parse_args(["--moe-token-dispatcher-type", "dist_moe"]
                             ).moe_token_dispatcher_type == "dist_moe"


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_yaml_model_configs_parse_with_dist_moe(path, installed):
    from megatron_dist_moe.megatron.launch import load_config_argv

    argv = load_config_argv(path)
    args = _megatron_parser().parse_args(argv)
    if "pp4vp2" not in path:
        assert args.moe_token_dispatcher_type == "dist_moe"
        assert args.num_experts and args.swiglu and not args.add_bias_linear
        assert args.expert_tensor_parallel_size == 1
    assert args.dist_moe_backend in (None, "auto")


def test_yaml_section_needs_install():
    from megatron_dist_moe.megatron.launch import load_config_argv

    argv = load_config_argv(os.path.join(REPO, "configs", "megatron", "tiny_gpt_dist_moe.yaml"))
    with pytest.raises(SystemExit):
        _megatron_parser().parse_args(argv)


def test_transformer_config_from_yaml_values_builds_dist_moe_layer(installed):
    """--yaml-cfg (megatron.training.yaml_arguments) passes language_model values straight to
    TransformerConfig; the installed MoELayer redirect then builds DistMoELayer."""
    import torch.nn.functional as F
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dist_moe.megatron.layer import DistMoELayer

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               num_moe_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2,
                               moe_token_dispatcher_type="dist_moe", gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False,
                               use_cpu_initialization=True)
    layer = MoELayer.__new__(MoELayer)
    try:
        MoELayer.__init__(layer, config, submodules=None, pg_collection=_single_rank_pgs())
    except Exception as e:   # no process group needed beyond the fake one
        pytest.fail(f"building the redirected layer failed: {e!r}")
    assert type(layer) is DistMoELayer and isinstance(layer, MoELayer)
    assert list(layer.state_dict()) == ["router.weight"] + [
        f"experts.local_experts.{i}.{fc}.{p}" for i in range(4)
        for fc in ("linear_fc1", "linear_fc2") for p in ("weight", "_extra_state")]


def _single_rank_pgs():
    """A ProcessGroupCollection of size-1 stand-ins (layer construction only reads sizes)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    class G:
        def size(self):
            return 1

        def rank(self):
            return 0

    pgs = ProcessGroupCollection()
    for name in ("ep", "tp", "cp", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "tp_dp_cp"):
        setattr(pgs, name, G())
    return pgs


def test_launcher_installs_then_runs_the_script(tmp_path):
    script = tmp_path / "fake_pretrain.py"
    script.write_text(textwrap.dedent("""
        import argparse, sys
        from megatron.training.arguments import add_megatron_arguments
        args = add_megatron_arguments(argparse.ArgumentParser()).parse_args()
        print("DISPATCHER", args.moe_token_dispatcher_type, args.num_experts,
              args.dist_moe_activation_slot_capacity_factor, __name__)
    """))
    config = os.path.join(REPO, "configs", "megatron", "tiny_gpt_dist_moe.yaml")
    out = subprocess.run(
        [sys.executable, "-m", "megatron_dist_moe.megatron.launch", "--config", config,
         str(script), "--num-experts", "16"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DISPATCHER dist_moe 16 1.0 __main__" in out.stdout


def test_spec_object_for_megatron_lm_gpt_builders():
    """Megatron-LM's gpt_builders.py resolves `--spec MODULE NAME` with import_module and hands
    the object to GPTModel uncalled: it must be a layer ModuleSpec building DistMoELayer."""
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_dist_moe.megatron.layer import DistMoELayer

    spec = import_module(["megatron_dist_moe.megatron.spec", "dist_moe_layer_spec"])
    assert isinstance(spec, ModuleSpec) and spec.module is TransformerLayer
    assert spec.submodules.mlp.func is DistMoELayer
    fn = import_module(["megatron_dist_moe.megatron.spec", "get_gpt_layer_spec_dist_moe"])
    assert callable(fn) and "vp_stage" in fn.__code__.co_varnames

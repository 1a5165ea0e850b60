"""`python -m megatron_dist_moe plan|demo`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_dist_moe as dm
from megatron_dist_moe import cli

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
PRESET_EP = {"guide_bench": 64, "deepseek_v3": 64, "tiny": 2}


@pytest.mark.parametrize("name", sorted(PRESET_EP))
def test_plan_prints_explain(name, capsys):
    rc = cli.main(["plan", "--config", str(CONFIGS / f"{name}.yaml"), "--ep", str(PRESET_EP[name])])
    out = capsys.readouterr().out
    assert rc == 0
    want = dm.plan_memory(dm.load_config(CONFIGS / f"{name}.yaml"), ep_size=PRESET_EP[name])
    assert want.explain() in out


def test_plan_imbalance_table(capsys):
    rc = cli.main(["plan", "--config", str(CONFIGS / "deepseek_v3.yaml"), "--ep", "64",
                   "--imbalance", "1,4,8", "--layers", "4", "--set", "save_route_outputs=true"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = [ln.split() for ln in out.splitlines() if ln.strip().startswith("L")]
    assert [ln[0] for ln in lines] == ["L0", "L1", "L2", "L3"]
    assert [ln[5] for ln in lines] == ["save", "save", "replay", "replay"]
    assert "rewinds every cursor: yes" in out
    # the default layout (no route outputs) saves less per layer, and the slot, sized in
    # balanced full states, shrinks with it: the 4x layer no longer fits
    rc = cli.main(["plan", "--config", str(CONFIGS / "deepseek_v3.yaml"), "--ep", "64",
                   "--imbalance", "1,4,8", "--layers", "4"])
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("L")]
    assert rc == 0 and [ln[5] for ln in lines] == ["save", "replay", "replay", "replay"]


def test_simulation_uses_the_planner():
    c = dm.load_config(CONFIGS / "tiny.yaml", max_moe_layers_per_activation_slot=3,
                       save_route_outputs=True)   # the numbers below: the guide's layout
    plan = dm.plan_memory(c, ep_size=4)
    assert cli.imbalanced_rows(plan, 1.0) == [128] * 4
    # 4 x 128 routes in all: the tracked rank takes 2.5 x 128 = 320, the others share 192
    assert cli.imbalanced_rows(plan, 2.5, tracked_rank=2) == [64, 64, 320, 64]
    assert cli.imbalanced_rows(plan, 0.5, tracked_rank=0) == [64, 150, 149, 149]
    assert cli.imbalanced_rows(plan, 100.0) == [512, 0, 0, 0]
    # slot = 3 x full_state(128) = 3 x 131072; full_state(R) = 768 R + 32768; input 16384
    #   L0 128 rows: 131072 + 2 x 16384 <= 393216 save
    #   L1 192 rows: 131072 + 180224 + 16384 = 327680 <= 393216 save
    #   L2 384 rows: 311296 + 327680 > 393216 replay (and 384 > 256 scratch rows: overflow)
    sim = cli.simulate_slot(plan, [1, 1.5, 3])
    assert [d.need_recompute for d in sim.layers] == [False, False, True]
    assert sim.layers[1].candidate_bytes + sim.layers[1].reserve_bytes == 327680
    assert sim.layers[2].overflow and not sim.layers[0].overflow
    assert sim.rewound
    assert sim.layers[1].start == plan.layer.full_state(128)
    with pytest.raises(ValueError, match="max_moe_layers_per_activation_slot"):
        cli.simulate_slot(plan, [1], num_layers=4)


@pytest.mark.parametrize("name", sorted(PRESET_EP))
def test_plan_plot_writes_png(name, tmp_path, capsys):
    out = tmp_path / f"{name}.png"
    rc = cli.main(["plan", "--config", str(CONFIGS / f"{name}.yaml"), "--ep", str(PRESET_EP[name]),
                   "--imbalance", "1,2,4", "--plot", str(out)])
    assert rc == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert f"wrote {out}" in capsys.readouterr().out


def test_plan_errors_name_the_problem(capsys):
    rc = cli.main(["plan", "--config", str(CONFIGS / "tiny.yaml"), "--ep", "3"])
    assert rc == 2 and "Config.num_experts" in capsys.readouterr().err
    rc = cli.main(["plan", "--config", str(CONFIGS / "tiny.yaml"), "--ep", "2",
                   "--set", "top_k=100"])
    assert rc == 2 and "Config.top_k" in capsys.readouterr().err
    rc = cli.main(["plan", "--config", str(CONFIGS / "nope.yaml"), "--ep", "2"])
    assert rc == 2 and "nope.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "--config", str(CONFIGS / "tiny.yaml"), "--ep", "2", "--imbalance", "a,b"])


def test_demo_end_to_end():
    """The README's main job: 2 gloo ranks, reference backend, error against the fp64 oracle."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "megatron_dist_moe", "demo", "--ranks", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "Dist-MoE memory plan" in out and "reference" in out and "PASS" in out
    worst = float(out.split("max relative error")[1].split()[0])
    assert 1e-4 < worst < 2e-2


def test_demo_pipeline_mega():
    """--pipeline reaches the Config and the plan (the reference backend runs every pipeline)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "megatron_dist_moe", "demo", "--ranks", "2",
                           "--pipeline", "mega"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bf16 / mega" in proc.stdout and "PASS" in proc.stdout


@pytest.mark.parametrize("precision", ["fp8_block", "mxfp8", "nvfp4"])
def test_demo_block_scaled(precision):
    """--precision: judged entry by entry against the emulated quantization's error."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "megatron_dist_moe", "demo", "--ranks", "2",
                           "--precision", precision],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{precision} quantization emulated" in proc.stdout and "PASS" in proc.stdout
    worst = float(proc.stdout.split("max relative error")[1].split()[0])
    assert 2e-2 < worst < 0.25    # E4M3 (E2M1 for nvfp4) errors, far above bf16's


BAD_ARGS = [
    # (argv, words of the one-line error)
    (["plan", "--config", "configs/tiny.yaml", "--ep", "0"], "--ep: expected a positive integer"),
    (["plan", "--config", "configs/tiny.yaml", "--ep", "2", "--layers", "0"],
     "--layers: expected a positive integer"),
    (["plan", "--config", "configs/tiny.yaml", "--ep", "2", "--tracked-rank", "99"],
     "--tracked-rank 99 is not a rank of --ep 2"),
    (["plan", "--config", "configs/tiny.yaml", "--ep", "2", "--set", "inference=true",
      "--imbalance", "2"], "an inference plan (--set inference=true) keeps no saved state"),
    (["plan", "--config", "configs/tiny.yaml", "--ep", "2", "--set", "pipeline=mega", "--set",
      "precision=mxfp8", "--set", "backend=cuda"],
     "Config.pipeline: the cuda backend does not run precision='mxfp8' with pipeline='mega'"),
    (["demo", "--routing", "one_rank", "--topk", "5"], "--topk <= 4"),
    (["demo", "--ranks", "0"], "--ranks: expected a positive integer"),
    (["demo", "--config", "configs/guide_bench.yaml"], "GiB are available"),
]


@pytest.mark.parametrize("argv,words", BAD_ARGS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_ARGS])
def test_bad_arguments_get_one_line_errors(argv, words):
    """A bad flag ends with exit status 2 and one 'error:' line naming it, no traceback."""
    r = subprocess.run([sys.executable, "-m", "megatron_dist_moe", *argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert words in r.stderr, r.stderr[-2000:]

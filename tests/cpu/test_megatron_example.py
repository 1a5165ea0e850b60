"""Smoke run of examples/tiny_gpt_dist_moe.py on CPU (2 gloo ranks, reference backend).

--compare trains Megatron's alltoall model and the dist_moe model (loaded from the alltoall
weights) on the same batches (on CPU with torch AdamW and a plain gradient all-reduce that honours
Megatron's `allreduce` attribute; Megatron's DDP and distributed optimizer need CUDA and run in
the GPU example, where `--fp32 --dist-moe-backend reference` checks them without bf16 rounding).
Over 30 optimizer steps the fp32 losses agree to ~1e-7 (100 steps: max difference 4.8e-7),
inside the 1e-5 relative bound checked here, while a wrong expert mapping, or expert gradients
averaged across EP ranks by DDP, would drift apart by orders of magnitude more.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example():
    """examples/tiny_gpt_dist_moe.py as a module (parse_args, transformer_config, ...)."""
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        import tiny_gpt_dist_moe
    finally:
        sys.path.pop(0)
    return tiny_gpt_dist_moe


def test_example_compare_smoke_run(tmp_path):
    out_csv = tmp_path / "cmp.csv"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "tiny_gpt_dist_moe.py"), "--device", "cpu",
         "--nproc", "2", "--steps", "30", "--warmup-steps", "1", "--log-interval", "10",
         "--compare", "--csv", str(out_csv)],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "dist_moe: mean" in proc.stdout and "tokens/s" in proc.stdout
    rows = list(csv.DictReader(open(out_csv)))
    assert [int(r["step"]) for r in rows] == list(range(30))
    assert set(rows[0]) == {"step", "loss_alltoall", "tokens_per_s_alltoall", "loss_dist_moe",
                            "tokens_per_s_dist_moe"}
    for r in rows:
        a, d = float(r["loss_alltoall"]), float(r["loss_dist_moe"])
        assert abs(a - d) <= 1e-5 * a, r
        assert float(r["tokens_per_s_dist_moe"]) > 0
    # ln(vocab=512) = 6.24 at initialisation: the loss is a real per-token cross entropy
    assert 5.5 < float(rows[0]["loss_dist_moe"]) < 7.0
    # and the model trains: 30 steps bring it down by a visible margin
    assert float(rows[-1]["loss_dist_moe"]) < float(rows[0]["loss_dist_moe"]) - 0.05


def test_example_repeats_start_from_one_perturbed_state(tmp_path):
    """--repeat-alltoall --repeat-dist-moe --repeat-perturb: four models; the two repeats start
    from the same perturbed weights (one draw per shared parameter name), so they agree with
    each other as closely as the unperturbed pair, while differing from it."""
    out_csv = tmp_path / "rep.csv"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "tiny_gpt_dist_moe.py"), "--device", "cpu",
         "--nproc", "2", "--steps", "6", "--warmup-steps", "1", "--log-interval", "5",
         "--compare", "--repeat-alltoall", "--repeat-dist-moe", "--repeat-perturb", "1e-2",
         "--csv", str(out_csv)],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "max |loss_dist_moe - loss_dist_moe_repeat|" in proc.stdout
    rows = list(csv.DictReader(open(out_csv)))
    assert len(rows) == 6 and {"loss_alltoall_repeat", "loss_dist_moe_repeat"} <= set(rows[0])
    moved = 0.0
    for r in rows:
        a, d = float(r["loss_alltoall"]), float(r["loss_dist_moe"])
        ar, dr = float(r["loss_alltoall_repeat"]), float(r["loss_dist_moe_repeat"])
        assert abs(a - d) <= 1e-5 * a and abs(ar - dr) <= 1e-5 * ar, r
        moved = max(moved, abs(a - ar))
    assert moved > 1e-4   # the perturbation reached the repeats


@pytest.mark.parametrize("argv, message", [
    (["--repeat-dist-moe"], "--repeat-dist-moe needs --compare"),
    (["--fp32", "--device", "cuda", "--dist-moe-backend", "cuda"], "--fp32 needs --dist-moe-backend reference"),
    (["--fp32", "--device", "cuda", "--dist-moe-backend", "reference", "--te", "on"], "--te off"),
    (["--compare", "--repeat-perturb", "1e-3"], "--repeat-perturb needs --repeat-alltoall"),
    (["--compare", "--repeat-alltoall", "--repeat-perturb", "0.5"], "--repeat-perturb must be"),
])
def test_example_fp32_flag_is_checked(argv, message, capsys):
    ex = _example()
    with pytest.raises(SystemExit):
        ex.parse_args(argv)
    assert message in capsys.readouterr().err
    args = ex.parse_args(["--fp32", "--device", "cuda", "--dist-moe-backend", "reference"])
    assert args.fp32 and not ex.use_te(args)


def test_perturb_weights_is_rank_independent_and_eps_sized():
    """--repeat-perturb: w * (1 + eps N(0,1)) drawn from (seed, parameter name), so two models
    (two ranks) get the same draw; the relative change has standard deviation eps."""
    import torch

    ex = _example()
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    b = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    b.load_state_dict(a.state_dict())
    w0 = a[0].weight.detach().clone()
    ex.perturb_weights(a, 1e-3, seed=7)
    ex.perturb_weights(b, 1e-3, seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    rel = (a[0].weight.detach() / w0 - 1.0)
    assert 0.9e-3 < float(rel.std()) < 1.1e-3 and abs(float(rel.mean())) < 1e-4
    c = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    c.load_state_dict(b.state_dict())
    ex.perturb_weights(c, 1e-3, seed=8)   # another seed: another draw
    assert not torch.equal(c[0].weight, b[0].weight)


def test_example_repeat_alltoall_gives_a_noise_pair(tmp_path):
    """--repeat-alltoall trains a second alltoall model from the same weights and batches; on
    CPU (deterministic) it repeats the first exactly, and the noise tool reads the column."""
    out_csv = tmp_path / "rep.csv"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "tiny_gpt_dist_moe.py"), "--device", "cpu",
         "--nproc", "2", "--steps", "4", "--warmup-steps", "1", "--compare", "--repeat-alltoall",
         "--csv", str(out_csv)],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "loss_alltoall_repeat" in proc.stdout or "alltoall_repeat" in proc.stdout
    rows = list(csv.DictReader(open(out_csv)))
    assert all(r["loss_alltoall"] == r["loss_alltoall_repeat"] for r in rows), rows
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import megatron_loss_noise as mln
    finally:
        sys.path.pop(0)
    curves = mln.load_curves([str(out_csv)])
    assert set(curves) == {"alltoall#0", "alltoall#0r", "dist_moe#0"}
    kinds = {(r["a"], r["b"]): r["kind"] for r in mln.compare(curves, [(0, 4)])}
    assert kinds[("alltoall#0", "alltoall#0r")] == "noise"


@pytest.mark.parametrize("recipe, precision", [("blockwise", "fp8_block"), ("mxfp8", "mxfp8")])
def test_example_fp8_recipe_reaches_only_the_dist_moe_models(recipe, precision):
    """--fp8-recipe sets Megatron's fp8 fields on the dist_moe models' TransformerConfig (after
    Megatron's TE-only MoE check when TE is absent) and the plugin maps them to the experts'
    precision; the alltoall models (the bf16 noise band) and the bf16 dist_moe model keep none."""
    ex = _example()
    from megatron_dist_moe.megatron.config_map import precision_from_transformer_config

    args = ex.parse_args(["--device", "cuda", "--te", "off", "--compare", "--fp8-recipe", recipe])
    fp8_tc = ex.transformer_config(args, "dist_moe", 1, fp8=True)
    assert (fp8_tc.fp8, fp8_tc.fp8_recipe) == ("e4m3", recipe)
    assert precision_from_transformer_config(fp8_tc) == precision
    for tc in (ex.transformer_config(args, "alltoall", 1), ex.transformer_config(args, "dist_moe", 1)):
        assert not tc.fp8 and precision_from_transformer_config(tc) == "bf16"
    # hybrid (E5M2 gradients) is refused by the plugin, naming the flag
    hybrid = ex.parse_args(["--device", "cuda", "--te", "off", "--fp8-recipe", recipe,
                            "--fp8-format", "hybrid"])
    with pytest.raises(ValueError, match="--fp8-format"):
        precision_from_transformer_config(ex.transformer_config(hybrid, "dist_moe", 1, fp8=True))


@pytest.mark.parametrize("argv", [["--device", "cpu", "--fp8-recipe", "blockwise"],
                                  ["--device", "cuda", "--fp32", "--dist-moe-backend", "reference",
                                   "--fp8-recipe", "mxfp8"]])
def test_example_fp8_recipe_needs_bf16_on_the_gpu(argv, capsys):
    ex = _example()
    with pytest.raises(SystemExit):
        ex.parse_args(argv)
    assert "--fp8-recipe quantizes bf16 experts" in capsys.readouterr().err

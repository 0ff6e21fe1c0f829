"""FP8 training keeps up with FP32: the final loss of ``bench.train_step`` within 5%.

A small size of the training-step benchmark's model and task (the same code, through
``bench.train_step.run``), on the CPU so that it runs everywhere and is deterministic.
The FP32 run must learn (its final loss well below the initial one), so that "within
5%" compares trained models, not two copies of the initial loss.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level package of the repository
    sys.path.insert(0, str(ROOT))

from bench import train_step  # noqa: E402

SIZE = {"width": 64, "depth": 2, "batch": 64, "steps": 40, "lr": 3e-3, "seed": 0}
FP8_RECIPES = ["delayed", "current", "block", "mxfp8", "rowwise", "rowwise_with_gw_hp"]
CONVERTED = 2 * SIZE["depth"] + 1  # fc1 and fc2 per block, and the head


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def fp32_run() -> dict:
    return train_step.run("fp32", device="cpu", **SIZE)


def test_fp32_reference_learns(fp32_run):
    losses = fp32_run["losses"]
    assert len(losses) == SIZE["steps"]
    assert fp32_run["converted"] == 0
    assert fp32_run["final_loss"] < 0.25 * losses[0], losses


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_final_loss_within_5_percent_of_fp32(fp32_run, recipe):
    result = train_step.run(recipe, device="cpu", **SIZE)
    assert result["converted"] == CONVERTED
    ratio = train_step.loss_ratio(result, fp32_run)
    assert train_step.within_tolerance(ratio), (
        f"{recipe}: final loss {result['final_loss']:.4f} is {ratio:.3f}x FP32's "
        f"{fp32_run['final_loss']:.4f} (limit: within {train_step.TOLERANCE:.0%})"
    )


def test_same_data_and_init_give_the_same_run():
    a = train_step.run("current", device="cpu", **{**SIZE, "steps": 3})
    b = train_step.run("current", device="cpu", **{**SIZE, "steps": 3})
    assert a["losses"] == b["losses"]


def test_command_line_prints_a_table(capsys):
    argv = "--width 32 --depth 1 --batch 32 --steps 4 --recipes current,fp32 --device cpu"
    assert train_step.main(argv.split()) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("recipe"))
    # fp32 runs first (the reference), whatever the order asked for.
    assert lines[header + 2].split()[0] == "fp32"
    assert lines[header + 3].split()[0] == "current"
    assert "the CPU is the device" in out
    assert "held-out" in lines[header] and "noise" in out


def test_unknown_recipe_is_refused():
    with pytest.raises(SystemExit):
        train_step.parse_args(["--recipes", "fp32,fp9"])
    with pytest.raises(ValueError, match="unknown recipe"):
        train_step.run("fp9", device="cpu", **{**SIZE, "steps": 1})


def test_compile_mode_runs_every_recipe_and_torchao_only_when_asked():
    assert "torchao" not in train_step.parse_args([]).recipes
    assert train_step.parse_args(["--compile"]).recipes == list(train_step.RECIPES)
    assert train_step.parse_args(["--recipes", "torchao,fp32"]).recipes == ["fp32", "torchao"]


def test_nvfp4_keeps_its_head_and_reports_held_out_loss(fp32_run):
    result = train_step.run("nvfp4", device="cpu", **SIZE)
    assert result["converted"] == CONVERTED - 1  # the head stays high precision
    # Held-out loss: fresh samples of the same noisy task, so never below the noise floor.
    floor = train_step.LABEL_NOISE**2
    for r in (fp32_run, result):
        assert r["heldout_loss"] > floor and r["heldout_recipe_loss"] > floor
    assert fp32_run["heldout_loss"] < 0.5 * fp32_run["losses"][0]  # it generalises
    ratio = train_step.heldout_ratio(result, fp32_run)
    assert ratio == result["heldout_loss"] / fp32_run["heldout_loss"]
    assert train_step.heldout_tolerance("nvfp4") == 0.03
    assert train_step.heldout_tolerance("current") == train_step.TOLERANCE

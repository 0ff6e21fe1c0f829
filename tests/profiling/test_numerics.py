"""``fc.inspect``: per-layer, per-operand FP8/FP4 numerics, free when off."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import sys
import threading
import weakref
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fastcast as fc
from fastcast.formats import ELEMENT_MAX
from fastcast.nn import function as function_module
from fastcast.numerics.inspector import _Tap
from fastcast.numerics.stats import _FIELDS, layout_stats
from fastcast.runtime import observers

FMT_MAX = 448.0


class Pair(nn.Module):
    """Two independent layers, ``good`` and ``bad``, fed their own inputs."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.good = fc.Linear(width, width)
        self.bad = fc.Linear(width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.good(x).sum() + self.bad(y).sum()


def _train_step(model: Pair, recipe: fc.Recipe, x: torch.Tensor, y: torch.Tensor) -> None:
    with fc.autocast(recipe=recipe):
        loss = model(x, y)
    loss.backward()
    model.zero_grad()


def _wide(shape: tuple[int, int], scale: float, gen: torch.Generator) -> torch.Tensor:
    """Gaussian values times ``scale``, every other column scaled down by 1e-9 as well: a
    range no FP8 format spans."""
    y = torch.randn(shape, generator=gen) * scale
    y[:, ::2] *= 1e-9
    return y


def test_layer_beyond_the_format_range_is_flagged_worst():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = Pair()
    recipe = fc.DelayedScaling(amax_history_len=4)
    with fc.inspect(model, every=1) as insp:
        for _ in range(3):  # scales settle on the normal range of both inputs
            x = torch.randn(64, 32, generator=gen)
            _train_step(model, recipe, x, torch.randn(64, 32, generator=gen))
        # Then bad's input jumps 100x (saturates under the old scale) and spans 1e-9..1e2.
        _train_step(model, recipe, torch.randn(64, 32, generator=gen), _wide((64, 32), 100.0, gen))
    report = insp.report()
    worst = report.rows()[0]
    assert (worst["layer"], worst["operand"], worst["step"]) == ("bad", "input", 3)
    assert worst["saturated"] > 0.1 and worst["underflow"] > 0.4
    assert worst["stale"] > 10
    assert report.flagged()[0] == "bad" and "good" not in report.flagged()
    assert "fc.keep_high_precision(model, names=('bad',))" in str(report)
    good = [r for r in report.rows() if r["layer"] == "good" and r["operand"] == "input"]
    # (A fresh batch may exceed the amax behind a delayed scale by a little: 1 element.)
    assert all(r["saturated"] < 0.001 and r["underflow"] < 0.01 for r in good)


def _reference_e4m3(x: torch.Tensor) -> tuple[float, float]:
    """SQNR (dB) and underflow of per-tensor current scaling to E4M3, in float64: scale
    448/amax, torch's own FP8 cast (round to nearest even), decoded back."""
    x64 = x.double()
    scale = FMT_MAX / x64.abs().max()
    codes = (x64 * scale).clamp(-FMT_MAX, FMT_MAX).to(torch.float8_e4m3fn)
    back = codes.double() / scale
    sqnr = 10 * math.log10(x64.square().sum().item() / (x64 - back).square().sum().item())
    nonzero = x64 != 0
    underflow = ((back == 0) & nonzero).sum().item() / nonzero.sum().item()
    return sqnr, underflow


def test_sqnr_and_underflow_agree_with_a_float64_reference():
    torch.manual_seed(0)
    layer = fc.Linear(64, 32, bias=False)
    # Log-uniform magnitudes over 8 decades: a real share underflows.
    x = torch.exp(torch.empty(128, 64).uniform_(-18, 0)) * torch.randn(128, 64).sign()
    recipe = fc.Float8CurrentScaling(fp8_format=fc.Format.E4M3)
    insp = fc.inspect(layer, step="manual").start()
    with torch.no_grad(), fc.autocast(recipe=recipe):
        layer(x)
    insp.stop()
    rows = {(r["operand"], r["layout"]): r for r in insp.report().rows()}
    assert set(rows) == {("input", "rowwise"), ("weight", "rowwise")}  # no grad: no T
    for operand, tensor in (("input", x), ("weight", layer.weight.detach())):
        sqnr, underflow = _reference_e4m3(tensor)
        row = rows[(operand, "rowwise")]
        assert row["sqnr_db"] == pytest.approx(sqnr, abs=1e-3)  # FP32 scale vs float64
        assert row["underflow"] == pytest.approx(underflow, abs=1e-12)
        assert row["amax"] == pytest.approx(tensor.abs().max().item(), rel=1e-6)
        assert row["scale"] == pytest.approx(FMT_MAX / tensor.abs().max().item(), rel=1e-6)
    assert rows[("input", "rowwise")]["underflow"] > 0.05


def test_delayed_scaling_reports_stale_scales_after_a_distribution_shift():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    layer = fc.Linear(32, 32)
    recipe = fc.DelayedScaling(amax_history_len=1)
    with fc.inspect(layer) as insp:
        for step in range(5):
            x = torch.randn(64, 32, generator=gen) * (50.0 if step == 4 else 1.0)
            with fc.autocast(recipe=recipe):
                out = layer(x)
            out.sum().backward()
    rows = {(r["step"], r["operand"]): r for r in insp.report().rows()}
    # Steps 2-3: the scale comes from the previous step's amax of the same distribution.
    for step in (2, 3):
        assert 0.5 < rows[(step, "input")]["stale"] < 2.0
        assert rows[(step, "input")]["saturated"] < 0.005  # a few elements at most
    shifted = rows[(4, "input")]
    assert shifted["stale"] > 20 and shifted["saturated"] > 0.2
    assert rows[(4, "weight")]["stale"] == pytest.approx(1.0, rel=1e-3)
    assert any("DelayedScaling(margin=1)" in a for a in insp.report().actions())


def _hook_state(model: nn.Module) -> list:
    state = []
    for m in model.modules():
        for name in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
        ):
            state.append(dict(getattr(m, name)))
    for p in model.parameters():
        state.append(p._backward_hooks)
    return state


def _tapped(model: nn.Module) -> bool:
    return any(
        type(getattr(m._plan, a)) is _Tap
        for m in model.modules()
        if isinstance(m, fc.Linear) and m._plan is not None
        for a in ("input_q", "weight_q", "grad_q")
    )


def test_off_means_nothing_installed_and_nothing_retained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    fc.convert(model)
    recipe = fc.Float8CurrentScaling()
    plan_for, enter = function_module.plan_for, fc.autocast.__dict__["__enter__"]
    native_enter = type(fc.autocast(recipe=recipe)).__dict__["__enter__"]
    hooks = _hook_state(model)
    insp = fc.inspect(model, every=2)
    assert insp not in observers.attached  # built, not on: nothing attached yet
    x = torch.randn(16, 32, requires_grad=True)
    x_ref = weakref.ref(x)
    insp.start()
    assert observers.attached == [insp]
    for step in range(3):
        with fc.autocast(recipe=recipe):
            out = model(x)
        # Sampled steps (0, 2) tap the layers' plans while they last; step 1 runs without.
        assert _tapped(model) == (step % 2 == 0)
        out.sum().backward()
    # Nothing of fastcast's is replaced, on or off: the inspection is an attached observer.
    assert function_module.plan_for is plan_for
    assert fc.autocast.__dict__["__enter__"] is enter
    assert type(fc.autocast(recipe=recipe)).__dict__["__enter__"] is native_enter
    insp.stop()
    assert observers.attached == []
    assert _hook_state(model) == hooks
    assert not _tapped(model)
    del x, out
    gc.collect()
    assert x_ref() is None  # the inspection kept no tensor
    assert insp._pending == []
    assert {r["step"] for r in insp.report().rows()} == {0, 2}


@settings(max_examples=8, deadline=None)
@given(every=st.integers(1, 4), steps=st.integers(1, 6), manual=st.booleans())
def test_sampled_steps_are_the_multiples_of_every(every, steps, manual):
    layer = fc.Linear(16, 16)
    recipe = fc.Float8CurrentScaling()
    x = torch.randn(16, 16)
    insp = fc.inspect(layer, every=every, step="manual" if manual else "autocast")
    with insp:
        for i in range(steps):
            if manual and i:
                insp.step()
            with fc.autocast(recipe=recipe):
                with fc.autocast(recipe=recipe):  # nested: still one step
                    layer(x)
    assert insp.report().steps() == [s for s in range(steps) if s % every == 0]
    assert insp.current_step == steps - 1


def test_outputs_rows_jsonl_table_and_heatmap(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    fc.convert(model)
    recipe = fc.Float8CurrentScaling()  # HYBRID: E5M2 gradients
    with fc.inspect(model, threshold_db=100.0) as insp:  # everything is below 100 dB
        for _ in range(2):
            with fc.autocast(recipe=recipe):
                out = model(torch.randn(16, 32))
            out.square().sum().backward()
    report = insp.report()
    rows = report.rows()
    # Per step: layer 2 has input, weight and grad in both layouts; layer 0 (whose input
    # needs no gradient: no dgrad) its input's two, its weight's and its grad's one each.
    assert len(rows) == 2 * (6 + 4)
    assert [r["rank_db"] for r in rows] == sorted(r["rank_db"] for r in rows)
    for key in ("layer", "operand", "step", "amax", "underflow", "saturated", "sqnr_db"):
        assert key in rows[0]
    for r in rows:  # no outliers here: the bulk is (nearly) the tensor
        assert r["rank_db"] == min(r["sqnr_db"], r["bulk_sqnr_db"])
        assert r["outliers"] < 0.01 and abs(r["bulk_sqnr_db"] - r["sqnr_db"]) < 1.0
    assert {r["layer"] for r in rows} == {"0", "2"}
    assert {r["fmt"] for r in rows if r["operand"] == "grad_output"} == {"e5m2"}
    path = tmp_path / "rows.jsonl"
    report.to_jsonl(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 20 and lines[0]["layer"] == rows[0]["layer"]
    text = str(report)
    assert text.startswith("| layer | operand |")
    assert "fc.keep_high_precision(model, names=(" in text
    assert "fc.Float8CurrentScaling(fp8_format=fc.Format.E4M3)" in text
    with pytest.raises(ValueError, match="metric"):
        report.heatmap(tmp_path / "x.png", metric="loss")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="matplotlib"):
        report.heatmap(tmp_path / "x.png")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="tensorboard"):
        report.to_tensorboard(tmp_path / "runs")


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _inspected_mlp(steps: int = 3) -> fc.numerics.Report:
    torch.manual_seed(0)
    model = fc.convert(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)))
    with fc.inspect(model, every=1) as insp:
        for _ in range(steps):
            with fc.autocast(recipe=fc.Float8CurrentScaling()):
                out = model(torch.randn(16, 32) * torch.logspace(-3, 1, 32))
            out.square().sum().backward()
    return insp.report()


@pytest.mark.parametrize("metric", ["rank_db", "underflow"])
def test_heatmap_draws_each_layer_operand_and_step_worst_cell(tmp_path, metric):
    # matplotlib is in the [dev] extra: this test runs wherever the suite does.
    from matplotlib.figure import Figure

    report = _inspected_mlp()
    rows = report.rows()
    png = tmp_path / "map.png"
    fig = report.heatmap(png, metric=metric)
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    assert isinstance(fig, Figure)
    ax = fig.axes[0]  # the other one is the colour bar
    # One row per (layer, operand): every layer shows its input, weight and gradient.
    layers = sorted({r["layer"] for r in rows})
    expected = [(layer, op) for layer in layers for op in ("input", "weight", "grad_output")]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"{a} {b}" for a, b in expected]
    # One column per step; each cell the worst of that layer's operand's layouts, as
    # worked out here from the rows.
    steps = report.steps()
    grid = ax.images[0].get_array()
    assert grid.shape == (len(layers) * 3, len(steps)) == (6, 3)
    worse = min if metric == "rank_db" else max
    for i, (layer, operand) in enumerate(expected):
        for j, step in enumerate(steps):
            cell = [
                r[metric]
                for r in rows
                if (r["layer"], r["operand"], r["step"]) == (layer, operand, step)
            ]
            assert len(cell) in (1, 2)  # one or both layouts
            assert grid[i, j] == pytest.approx(worse(cell), rel=1e-12)
    # The picture's worst cell is the report's worst row.
    if metric == "rank_db":
        worst = rows[0]  # rows() is worst first
        assert grid.min() == pytest.approx(worst["rank_db"], rel=1e-12)
        i, j = divmod(int(grid.argmin()), grid.shape[1])
        assert expected[i] == (worst["layer"], worst["operand"]) and steps[j] == worst["step"]
    else:
        assert grid.max() == pytest.approx(max(r["underflow"] for r in rows), rel=1e-12)
        assert grid.max() > 0  # the inputs span 4 decades: some underflow to show


def test_heatmap_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    report = _inspected_mlp(steps=1)
    for name in ("matplotlib", "matplotlib.figure"):  # even when already imported
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"needs matplotlib \(pip install matplotlib\)"):
        report.heatmap(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    assert report.rows() and report.table()  # the rest of the report needs no matplotlib


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="no fc.Linear"):
        fc.inspect(nn.Linear(4, 4))
    layer = fc.Linear(16, 16)
    with pytest.raises(ValueError, match="every"):
        fc.inspect(layer, every=0)
    with pytest.raises(ValueError, match="step"):
        fc.inspect(layer, step="optimizer")
    with fc.inspect(layer) as insp:
        with pytest.raises(RuntimeError, match="another inspection"):
            fc.inspect(layer).start()
        with pytest.raises(RuntimeError, match="manual"):
            insp.step()
    assert "nothing recorded" in str(insp.report())


@pytest.mark.parametrize(
    ("threshold", "error", "match"),
    [
        ("abc", TypeError, r"threshold_db must be None, a number of dB or a dict"),
        ([20.0], TypeError, r"threshold_db must be None, a number of dB or a dict"),
        (True, TypeError, r"threshold_db must be None, a number of dB or a dict"),
        (math.nan, ValueError, r"threshold_db must be a finite number of dB, got nan"),
        (-math.inf, ValueError, r"threshold_db must be a finite number of dB"),
        ({"e4m3": "x"}, TypeError, r"threshold_db\['e4m3'\] must be a number of dB, got 'x'"),
        ({"e5m2": math.nan}, ValueError, r"threshold_db\['e5m2'\] must be a finite number"),
        ({"fp8": 20.0}, ValueError, r"unknown element format 'fp8'; the formats are 'e4m3'"),
        ({"E4M3": 20.0}, ValueError, r"unknown element format 'E4M3'"),
    ],
)
def test_bad_thresholds_are_refused_at_construction(threshold, error, match):
    layer = fc.Linear(16, 16)
    with pytest.raises(error, match=match):
        fc.inspect(layer, threshold_db=threshold)
    with fc.inspect(layer) as insp:
        with fc.autocast(recipe=fc.Float8CurrentScaling()):
            layer(torch.randn(16, 16))
    with pytest.raises(error, match=match):  # and where a report takes one
        insp.report(threshold_db=threshold)
    with pytest.raises(error, match=match):
        fc.numerics.Report([], threshold)


def test_good_thresholds_are_kept_as_numbers():
    layer = fc.Linear(16, 16)
    assert fc.inspect(layer, threshold_db=20).threshold_db == 20.0
    insp = fc.inspect(layer, threshold_db={"e5m2": 15})
    assert insp.threshold_db == {"e5m2": 15.0}
    report = insp.report()
    assert report.threshold("e5m2") == 15.0 and report.threshold("e4m3") == 25.0
    assert insp.report(threshold_db=30.5).threshold("e2m1") == 30.5


@pytest.mark.slow  # cold Inductor compiles (make test keeps a few compile tests: README)
@pytest.mark.compile
def test_compiled_steps_run_and_are_not_inspected():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    fc.convert(model)
    recipe = fc.Float8CurrentScaling()

    def forward(x: torch.Tensor) -> torch.Tensor:
        with fc.autocast(recipe=recipe):
            return model(x)

    compiled = torch.compile(forward, fullgraph=True)
    x = torch.randn(16, 32)
    expected = forward(x)
    with fc.inspect(model, step="manual") as insp:
        out = compiled(x)  # step 0: compiled, runs as without inspection, records nothing
        out.sum().backward()
        insp.step()
        forward(x).sum().backward()  # step 1: eager, inspected
    assert torch.equal(out, expected)
    assert insp.report().steps() == [1]


# -- steps belong to the inspected model (issue 32) -----------------------------------------
def _mlp(width: int = 32) -> nn.Module:
    return fc.convert(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)))


def _steps(model: nn.Module, steps: int, wait: Any = None) -> None:
    recipe = fc.Float8CurrentScaling()
    for _ in range(steps):
        if wait is not None:
            wait()
        with fc.autocast(recipe=recipe):
            out = model(torch.randn(8, 32))
        out.sum().backward()


def _recorded(insp: fc.numerics.Inspector) -> dict[int, set[str]]:
    layers: dict[int, set[str]] = {}
    for row in insp.report().rows():
        layers.setdefault(row["step"], set()).add(row["layer"])
    return layers


def test_another_model_training_in_another_thread_counts_no_step():
    torch.manual_seed(0)
    inspected, other = _mlp(), _mlp()
    barrier = threading.Barrier(2)  # both threads begin each step together
    with fc.inspect(inspected, every=2) as insp:
        threads = [
            threading.Thread(target=_steps, args=(m, 6, barrier.wait)) for m in (inspected, other)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # (Counted per process, the other thread's 6 entries made 12 steps, sampled [8, 10].)
    assert insp.current_step == 5
    assert _recorded(insp) == {0: {"0", "2"}, 2: {"0", "2"}, 4: {"0", "2"}}


def test_another_model_in_another_asyncio_task_counts_no_step():
    torch.manual_seed(0)
    inspected, other = _mlp(), _mlp()
    recipe = fc.Float8CurrentScaling()

    async def train(model: nn.Module) -> None:
        for _ in range(6):
            with fc.autocast(recipe=recipe):
                await asyncio.sleep(0)  # the other task enters its own autocast here
                out = model(torch.randn(8, 32))
            out.sum().backward()
            await asyncio.sleep(0)

    async def both() -> None:
        await asyncio.gather(train(inspected), train(other))

    with fc.inspect(inspected, every=2) as insp:
        asyncio.run(both())
    assert insp.current_step == 5
    assert _recorded(insp) == {0: {"0", "2"}, 2: {"0", "2"}, 4: {"0", "2"}}


def test_autocasts_the_model_does_not_run_in_begin_no_step():
    torch.manual_seed(0)
    inspected, other = _mlp(), _mlp()
    recipe = fc.Float8CurrentScaling()
    with fc.inspect(inspected, every=2) as insp:
        for _ in range(3):
            _steps(inspected, 1)
            with fc.autocast(recipe=recipe):  # an evaluation of another model, same thread
                other(torch.randn(8, 32))
            with fc.autocast(recipe=recipe):  # nothing at all
                pass
    assert insp.current_step == 2
    assert _recorded(insp) == {0: {"0", "2"}, 2: {"0", "2"}}


def test_a_checkpointed_recomputation_stays_in_its_step():
    torch.manual_seed(0)
    model = _mlp()
    recipe = fc.Float8CurrentScaling()
    x = torch.randn(8, 32, requires_grad=True)
    with fc.inspect(model) as insp:
        for _ in range(3):
            with fc.autocast(recipe=recipe):
                out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
            out.sum().backward()  # recomputes the forward, outside the autocast
    assert insp.current_step == 2
    assert set(_recorded(insp)) == {0, 1, 2}


# -- outliers: ranked by what they do to the rest of the tensor (issue 32) -----------------
def test_an_outlier_column_that_flushes_the_input_ranks_its_layer_worst():
    torch.manual_seed(0)
    model = fc.convert(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)))
    x = torch.randn(128, 64)
    x[:, 5] = 1e6
    with fc.inspect(model) as insp:
        with fc.autocast(recipe=fc.Float8CurrentScaling()):
            out = model(x)
        out.sum().backward()
    report = insp.report()
    rows = report.rows()
    # Both layouts of layer 0's input come first: the outlier's scale flushes the rest.
    assert {(r["layer"], r["operand"]) for r in rows[:2]} == {("0", "input")}
    worst = rows[0]
    assert worst["sqnr_db"] > 90  # the whole tensor: the outlier's energy, well kept
    assert worst["bulk_sqnr_db"] < 3 and worst["rank_db"] == worst["bulk_sqnr_db"]
    assert worst["underflow"] > 0.9
    assert worst["outliers"] == pytest.approx(1 / 64)
    assert report.flagged() == ["0"]
    assert "outliers flush the bulk of 1 operand(s) (worst: '0' input" in str(report)
    table = report.table()
    assert table.splitlines()[2].startswith("| 0 **!** | input |")
    assert "| rank dB | SQNR dB | bulk SQNR dB |" in table


class _Deep(nn.Module):
    """Six layers; a feature of ``bump`` is added to layer ``at``'s input."""

    def __init__(self, bump: float, at: int = 4, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(fc.Linear(width, width) for _ in range(depth))
        self.bump, self.at = bump, at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i == self.at:
                x = x + torch.nn.functional.one_hot(torch.tensor(7), x.shape[-1]) * self.bump
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


@pytest.mark.parametrize("recipe", [fc.Float8CurrentScaling(), fc.NVFP4BlockScaling()])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_feature_outlier_at_a_deep_layer_ranks_that_layer_worst(recipe, seed):
    torch.manual_seed(seed)
    model = _Deep(bump=1e4)
    with fc.inspect(model) as insp:
        with fc.autocast(recipe=recipe):
            out = model(torch.randn(128, 64))
        out.sum().backward()
    report = insp.report()
    worst = report.rows()[0]
    assert (worst["layer"], worst["operand"], worst["layout"]) == ("layers.4", "input", "rowwise")
    assert worst["bulk_sqnr_db"] < worst["sqnr_db"] - 30
    assert report.flagged()[0] == "layers.4"


def test_bulk_sqnr_agrees_with_a_float64_reference():
    torch.manual_seed(0)
    layer = fc.Linear(64, 32, bias=False)
    x = torch.randn(128, 64)
    x[:, 3] = 3e3 * torch.randn(128).sign()  # outliers, but the bulk stays representable
    x[::7, 9] = 0.0
    insp = fc.inspect(layer, step="manual").start()
    with torch.no_grad(), fc.autocast(recipe=fc.Float8CurrentScaling(fp8_format=fc.Format.E4M3)):
        layer(x)
    insp.stop()
    row = next(r for r in insp.report().rows() if r["operand"] == "input")
    x64 = x.double()
    scale = FMT_MAX / x64.abs().max()
    back = (x64 * scale).clamp(-FMT_MAX, FMT_MAX).to(torch.float8_e4m3fn).double() / scale
    mag = x64.abs()
    bulk = mag <= fc.numerics.OUTLIER_RATIO * mag[mag > 0].median()
    expected = 10 * math.log10(
        x64[bulk].square().sum().item() / (x64 - back)[bulk].square().sum().item()
    )
    assert row["bulk_sqnr_db"] == pytest.approx(expected, abs=1e-3)
    assert row["outliers"] == pytest.approx(128 / x.numel())
    assert row["sqnr_db"] > row["bulk_sqnr_db"] + 20


def test_saturation_counts_the_clipped_amax_element_alike_in_every_format():
    """An element counts as saturated when its code is the format's maximum and its value
    exceeds what that code decodes to: current scaling's amax element (scale max/amax)
    lands exactly on the maximum and does not count; an NVFP4 block's amax element counts
    when its E4M3 block scale rounded down (clipped, up to 1/16 off), and not when the
    scale was exact or rounded up (at or below 6)."""
    x = torch.full((8, 16), 0.25)
    # Tensor amax 6 * 448 (tensor scale 1). Block scales amax/6: 448 and 1.5 exact; 1.5625
    # rounds (to even) down to 1.5: 9.375 is clipped to 9; 1.6 rounds up to 1.625.
    x[:, 3] = torch.tensor([2688.0, 9.0, -9.0, 9.375, -9.375, 9.6, 9.6, -9.6])
    for recipe, saturated in ((fc.NVFP4BlockScaling(), 2), (fc.Float8CurrentScaling(), 0)):
        q = fc.quantize(x, recipe, role="input")
        stats = dict(zip(_FIELDS, layout_stats(x, q, "rowwise").tolist()))
        at_max = q._decode_data(q.data).abs() == ELEMENT_MAX[q.fmt]
        assert int(at_max.sum()) == (8 if saturated else 1)  # every block's amax element
        assert stats["saturated"] == saturated

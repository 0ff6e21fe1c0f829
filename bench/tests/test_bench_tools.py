"""The benchmark harness's bookkeeping: history and run-to-run comparison (bench/history.py),
README tables rendered from the sample (bench/readme.py)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level package of the repository
    sys.path.insert(0, str(ROOT))

from bench import history, readme  # noqa: E402
from bench.report import format_time  # noqa: E402

SAMPLE = ROOT / "bench" / "results" / "sample.json"


def _bench(name: str, median: float, inner: int | None = None, group: str = "g") -> dict:
    extra = {} if inner is None else {"inner": inner}
    stats = {"median": median, "iqr": 0.0, "rounds": 5, "data": [median] * 5}
    return {
        "name": name,
        "fullname": f"bench/bench_x.py::{name}",
        "group": group,
        "extra_info": extra,
        "stats": stats,
        "data": [median] * 5,
    }


def _run(node: str, when: str, *benches: dict) -> dict:
    return {
        "machine_info": {"node": node},
        "datetime": when,
        "commit_info": {"id": "0123456789abcdef"},
        "benchmarks": list(benches),
    }


# --------------------------------------------------------------------------- history


def test_compare_uses_per_call_medians_and_the_threshold():
    old = _run(
        "m",
        "2026-01-01T00:00:00",
        _bench("slower", 0.010, inner=1000),  # 10 µs per call
        _bench("faster", 0.020),
        _bench("same", 0.004, inner=20),
        _bench("gone", 1.0),
    )
    new = _run(
        "m",
        "2026-01-02T00:00:00",
        _bench("slower", 0.0115, inner=1000),
        _bench("faster", 0.010),
        _bench("same", 0.0042, inner=20),
        _bench("added", 1.0),
    )
    rows = {r["name"]: r for r in history.compare(old, new, threshold=1.10)}
    assert set(rows) == {"slower", "faster", "same"}  # only benchmarks in both runs
    assert rows["slower"]["drift"] == 1.0  # no baseline moved: nothing to correct
    assert rows["slower"]["old"] == pytest.approx(10e-6)  # per call, not the loop's total
    assert rows["slower"]["new"] == pytest.approx(11.5e-6)
    assert rows["slower"]["ratio"] == pytest.approx(1.15)
    assert rows["slower"]["status"] == "REGRESSION"
    assert rows["faster"]["status"] == "faster"
    assert rows["same"]["status"] == ""
    # A looser threshold lets the 1.15x through.
    loose = {r["name"]: r for r in history.compare(old, new, threshold=1.2)}
    assert loose["slower"]["status"] == ""
    with pytest.raises(ValueError, match="threshold must be > 1"):
        history.compare(old, new, threshold=0.9)


def test_save_keeps_every_run_per_machine_stats_only(tmp_path):
    latest = tmp_path / "latest.json"
    latest.write_text(json.dumps(_run("box/1", "2026-01-01T10:00:00.5", _bench("a", 1.0))))
    first = history.save(latest, tmp_path / "h")
    second = history.save(latest, tmp_path / "h")  # same second: kept apart
    assert first != second and first.parent == second.parent == tmp_path / "h" / "box_1"
    assert history.runs("box_1", tmp_path / "h") == sorted([first, second])
    saved = json.loads(first.read_text())
    assert "data" not in saved["benchmarks"][0] and "data" not in saved["benchmarks"][0]["stats"]
    assert saved["benchmarks"][0]["stats"]["median"] == 1.0


def _noisy(entry: dict, spread: float) -> dict:
    entry["stats"]["iqr"] = entry["stats"]["median"] * spread
    return entry


def test_a_loaded_machine_is_no_regression_but_a_real_one_still_is():
    # The new run on a machine 1.3x slower overall: the baselines (PyTorch alone) of each
    # group slowed as much as fastcast's entries; one fastcast entry slowed 1.3 * 1.5x.
    old = _run(
        "m",
        "t0",
        _bench("test_nn_linear", 10e-6, group="linear"),
        _bench("test_fc_linear_current", 20e-6, group="linear"),
        _bench("test_plain_cast", 1e-3, group="quantize"),
        _bench("test_current_scaling", 1.2e-3, group="quantize"),
        _bench("test_mxfp8", 2e-3, group="quantize"),
    )
    new = _run(
        "m",
        "t1",
        _bench("test_nn_linear", 13e-6, group="linear"),
        _bench("test_fc_linear_current", 26e-6, group="linear"),
        _bench("test_plain_cast", 1.3e-3, group="quantize"),
        _bench("test_current_scaling", 1.56e-3, group="quantize"),
        _bench("test_mxfp8", 2e-3 * 1.3 * 1.5, group="quantize"),
    )
    rows = {r["name"]: r for r in history.compare(old, new, threshold=1.10)}
    assert all(r["ratio"] >= 1.3 - 1e-9 for r in rows.values())  # all slower in raw time
    assert rows["test_fc_linear_current"]["drift"] == pytest.approx(1.3)
    assert rows["test_fc_linear_current"]["adjusted"] == pytest.approx(1.0)
    assert rows["test_fc_linear_current"]["status"] == ""
    assert rows["test_current_scaling"]["status"] == ""
    assert rows["test_mxfp8"]["adjusted"] == pytest.approx(1.5)
    assert rows["test_mxfp8"]["status"] == "REGRESSION"
    assert sum(r["status"] == "REGRESSION" for r in rows.values()) == 1
    # The same 1.5x inside a benchmark whose rounds spread by 60% is only noisy.
    _noisy(new["benchmarks"][-1], 0.6)
    rows = {r["name"]: r for r in history.compare(old, new, threshold=1.10)}
    assert rows["test_mxfp8"]["status"] == "noisy" and rows["test_mxfp8"]["spread_new"] == 0.6
    text = history.format_comparison(list(rows.values()), "old", "new", 1.10)
    assert "machine drift (baselines, PyTorch alone; new/old): median 1.30x" in text
    assert "60%" in text and "1 beyond the threshold but within their own spread" in text


def test_runs_of_two_machines_are_not_compared(tmp_path, capsys):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(_run("ci-box", "t", _bench("x", 0.001))))
    new.write_text(json.dumps(_run("laptop", "t", _bench("x", 0.002))))
    assert history.main([str(old), str(new), "--strict"]) == 2
    out = capsys.readouterr().out
    assert "ran on ci-box" in out and "on laptop" in out and "REGRESSION" not in out
    assert history.main([str(old), str(new), "--any-machine", "--strict"]) == 0
    out = capsys.readouterr().out
    assert "2.00x" in out and "REGRESSION" not in out  # ratios, no verdicts


def test_compare_command_on_two_files(tmp_path, capsys):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(_run("m", "t", _bench("x", 0.001, inner=10))))
    new.write_text(json.dumps(_run("m", "t", _bench("x", 0.002, inner=10))))
    assert history.main([str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert "100 µs" in out and "200 µs" in out and "2.00x" in out and "REGRESSION" in out
    assert history.main([str(old), str(new), "--strict"]) == 1
    assert history.main([str(new), str(new), "--strict"]) == 0


def test_compare_without_history_says_what_to_do(tmp_path, capsys):
    assert history.main(["--machine", "never-ran-here-" + tmp_path.name]) == 2
    assert "run `make bench` twice" in capsys.readouterr().out


# --------------------------------------------------------------------------- README


@pytest.fixture(scope="module")
def sample() -> dict:
    return json.loads(SAMPLE.read_text())


def _block(text: str, name: str) -> list[str]:
    start = text.index(f"<!-- bench:{name} -->\n") + len(f"<!-- bench:{name} -->\n")
    return text[start : text.index(f"<!-- /bench:{name} -->")].splitlines()


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.parametrize("page", readme.PAGES, ids=lambda p: p.name)
def test_pages_are_what_the_sample_renders_and_rendering_is_stable(sample, page):
    text = page.read_text()
    assert "<!-- bench:" in text
    once = readme.render(text, sample)
    assert readme.render(once, sample) == once
    assert once == text, f"{page.name}'s tables differ from sample.json: run `make readme`"


def test_headline_rows_are_micro_rows(sample):
    text = readme.render((ROOT / "README.md").read_text(), sample)
    micro = readme.render((ROOT / "docs" / "benchmarks.md").read_text(), sample)
    assert set(_block(text, "headline")[2:]) <= set(_block(micro, "micro")[2:])
    assert any("torchao" in line for line in _block(text, "headline"))


def test_a_cell_is_the_samples_per_call_median(sample):
    raw = {b["name"]: b for b in sample["benchmarks"]}
    text = readme.render((ROOT / "docs" / "benchmarks.md").read_text(), sample)
    rows = {_cells(line)[0]: _cells(line) for line in _block(text, "micro")[2:]}
    autocast = raw["test_fc_autocast"]
    per_call = autocast["stats"]["median"] / autocast["extra_info"]["inner"]
    assert rows["`with fc.autocast(recipe=r): pass`"][1] == format_time(per_call)
    current, nn = raw["test_fc_linear_current"], raw["test_nn_linear"]
    ratio = (current["stats"]["median"] / current["extra_info"]["inner"]) / (
        nn["stats"]["median"] / nn["extra_info"]["inner"]
    )
    row = rows["`fc.Linear` 16x16 fwd+bwd, `Float8CurrentScaling`, vs `nn.Linear`"]
    assert row[2] == f"{ratio:.2f}x"
    assert row[3].endswith("pass" if ratio <= 2.5 else "**miss**")


def test_a_moved_median_moves_the_table_and_check_catches_it(sample, tmp_path):
    changed = copy.deepcopy(sample)
    for b in changed["benchmarks"]:
        if b["name"] == "test_fc_autocast":
            b["stats"]["median"] = b["extra_info"]["inner"] * 200e-9  # 200 ns per call
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    rendered = readme.render(text, changed)
    rows = {_cells(line)[0]: _cells(line) for line in _block(rendered, "micro")[2:]}
    assert rows["`with fc.autocast(recipe=r): pass`"][1] == "200 ns"
    # Outside the blocks nothing changed.
    assert rendered.split("<!-- bench:micro -->")[0] == text.split("<!-- bench:micro -->")[0]
    copy_readme, copy_sample = tmp_path / "benchmarks.md", tmp_path / "sample.json"
    copy_readme.write_text(text)
    copy_sample.write_text(json.dumps(changed))
    args = ["--readme", str(copy_readme), "--sample", str(copy_sample)]
    assert readme.main([*args, "--check"]) == 1
    assert readme.main(args) == 0 and readme.main([*args, "--check"]) == 0


def test_overhead_block_renders_when_the_sample_has_a_report(sample):
    with_report = copy.deepcopy(sample)
    with_report.setdefault("fastcast", {})["overhead"] = {
        "device": "cpu",
        "ranges": [
            {
                "range": "fastcast.scaled_mm",
                "calls_per_step": 27,
                "cpu_us_per_call": 30.0,
                "kernel_us_per_call": 20.0,
                "cpu_over_kernel": 1.5,
            }
        ],
        "step": {"cpu_us": 1000.0, "kernel_us": 800.0, "cpu_over_kernel": 1.25},
    }
    text = "a\n<!-- bench:overhead -->\nold\n<!-- /bench:overhead -->\nb\n"
    lines = _block(readme.render(text, with_report), "overhead")
    assert _cells(lines[2]) == ["`fastcast.scaled_mm`", "27", "30.0", "20.0", "1.50x"]
    assert _cells(lines[3]) == ["whole step", "1", "1,000", "800.0", "1.25x"]


def _train_step_sample(sample: dict) -> dict:
    """The sample with a small training-step run of each kind (bench.train_step --json)."""
    result = copy.deepcopy(sample)
    extra = result.setdefault("fastcast", {})
    row = {"final_loss": 0.2, "loss_ratio": 1.0, "heldout_loss": 0.2, "heldout_ratio": 1.0}
    extra["train_step"] = {
        "results": {
            "fp32": {**row, "step_ms": 10.0, "heldout_target": 0.05},
            "current": {**row, "step_ms": 14.0, "heldout_ratio": 1.004, "heldout_target": 0.05},
            "rowwise": {**row, "step_ms": 16.0, "heldout_ratio": 1.02, "heldout_target": 0.01},
            "nvfp4": {**row, "step_ms": 30.0, "heldout_ratio": 1.011, "heldout_target": 0.03},
        },
        "skipped": {"mxfp8": "no kernel"},
    }
    compiled = {"eager_ms": 14.0, "compile_cold_s": 15.0, "compile_warm_s": 4.0}
    extra["train_step_compile"] = {
        "results": {
            "current": {**compiled, "compiled_ms": 7.0},
            "torchao": {**compiled, "eager_ms": 28.0, "compiled_ms": 14.0},
        },
        "not_run": {"block": "compile failed: Boom"},
    }
    return result


def test_training_step_blocks_render_from_the_samples_runs(sample):
    text = "<!-- bench:train_step -->\n<!-- /bench:train_step -->\n"
    text += "<!-- bench:train_compile -->\n<!-- /bench:train_compile -->\n"
    rendered = readme.render(text, _train_step_sample(sample))
    rows = {_cells(line)[0]: _cells(line) for line in _block(rendered, "train_step")[2:]}
    assert rows["fp32"][1:3] == ["10.0 ms", "1.00x"]  # no step target for high precision
    assert rows["`Float8CurrentScaling`"][2] == "1.40x: pass"  # FP8: <= 1.5x fp32's step
    assert rows["`Float8RowwiseScaling`"][2] == "1.60x: **miss**"
    assert rows["`Float8RowwiseScaling`"][6] == "1.020: **miss** (1%)"
    assert rows["`NVFP4BlockScaling` (head kept)"][2] == "3.00x"  # FP4: no step target
    assert rows["`NVFP4BlockScaling` (head kept)"][6] == "1.011: pass (3%)"
    assert rows["`MXFP8BlockScaling`"][1] == "skipped"
    compiled = _block(rendered, "train_compile")
    rows = {_cells(line)[0]: _cells(line) for line in compiled[2:5]}
    assert rows["`Float8CurrentScaling`"][1:] == ["14.0 ms", "7.0 ms", "0.50x", "15.0 / 4.0 s"]
    assert rows["`Float8BlockScaling`"][2] == "compile failed: Boom"
    assert compiled[-1] == (
        "Compiled current scaling / compiled torchao: 0.50x (pass, target <= 1x)."
    )


def test_a_missing_benchmark_is_named(sample):
    partial = copy.deepcopy(sample)
    partial["benchmarks"] = [b for b in partial["benchmarks"] if b["name"] != "test_mxfp8"]
    with pytest.raises(KeyError, match="no benchmark 'test_mxfp8'"):
        readme.render("<!-- bench:micro -->\n<!-- /bench:micro -->\n", partial)


# --------------------------------------------------------------------------- nsys, py-spy


def _nvtx_rows(*rows: tuple[str, int, float]) -> list[dict[str, str]]:
    """nvtx_sum CSV rows: (range as nsys writes it, instances, total ns)."""
    return [
        {
            "Time (%)": "1.0",
            "Total Time (ns)": f"{total:,.0f}",
            "Instances": str(n),
            "Avg (ns)": str(total / n),
            "Style": "PushPop",
            "Range": name,
        }  # fmt: skip
        for name, n, total in rows
    ]


def _proj_rows(*rows: tuple[str, int, float]) -> list[dict[str, str]]:
    return [
        {
            "Range": name,
            "Style": "PushPop",
            "Total Proj Time (ns)": str(total),
            "Total Range Time (ns)": "0",
            "Range Instances": str(n),
            "Proj Avg (ns)": "0",
        }  # fmt: skip
        for name, n, total in rows
    ]


def test_nsys_tables_become_the_overhead_report():
    from bench import nsys_report

    nvtx = _nvtx_rows(
        ("fastcast:fastcast.scaled_mm", 60, 600_000),  # 10 µs per call on the CPU
        (":fastcast.Linear.forward[blocks.0.fc1]", 10, 500_000),
        (":fastcast.Linear.forward[head]", 10, 300_000),
        ("fastcast:overhead_report.step", 10, 2_000_000),  # 200 µs per step
        ("some_other_range", 5, 1_000),
    )
    proj = _proj_rows(
        ("fastcast:fastcast.scaled_mm", 60, 1_200_000),  # 20 µs of GPU per call
        (":fastcast.Linear.forward[blocks.0.fc1]", 10, 100_000),
        ("fastcast:overhead_report.step", 10, 1_000_000),
    )
    result = nsys_report.summarize(nvtx, proj, steps=10, per_module=False)
    rows = {r["range"]: r for r in result["ranges"]}
    assert set(rows) == {"fastcast.scaled_mm", "fastcast.Linear.forward"}
    mm = rows["fastcast.scaled_mm"]
    assert mm["calls_per_step"] == 6 and mm["cpu_us_per_call"] == pytest.approx(10)
    assert mm["kernel_us_per_call"] == pytest.approx(20) and mm["cpu_over_kernel"] == 0.5
    linear = rows["fastcast.Linear.forward"]  # both modules together
    assert linear["calls_per_step"] == 2 and linear["cpu_us_per_call"] == pytest.approx(40)
    step = result["step"]
    assert step["cpu_us"] == pytest.approx(200) and step["kernel_us"] == pytest.approx(100)
    assert step["cpu_bound"]  # 200 µs of launches for 100 µs of GPU work
    per_module = nsys_report.summarize(nvtx, proj, steps=10, per_module=True)
    assert "fastcast.Linear.forward[head]" in {r["range"] for r in per_module["ranges"]}
    with pytest.raises(ValueError, match="unexpected columns"):
        nsys_report.summarize([{"Foo": "1"}], [], steps=1, per_module=False)


def _script(name: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "profiles" / name)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_make_nsys_without_nsys_says_so(tmp_path):
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin", PYTHON=sys.executable)
    if shutil.which("nsys", path=env["PATH"]):
        pytest.skip("nsys is installed here")
    done = _script("nsys.sh", env)
    assert done.returncode == 2
    assert "Nsight Systems (`nsys`) is not on PATH" in done.stderr


def test_make_profile_names_a_missing_ptrace_permission(tmp_path):
    # A py-spy that fails as it does without ptrace permission; an interpreter beside it.
    spy = tmp_path / "py-spy"
    spy.write_text("#!/bin/sh\necho 'Caused by: Permission denied (os error 13)' >&2\nexit 1\n")
    spy.chmod(0o755)
    python = tmp_path / "python"  # this interpreter (its environment: torch)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), STEPS="1", OUT=str(tmp_path / "out"))
    done = _script("record.sh", env)
    assert done.returncode == 3
    assert "ptrace is not permitted" in done.stderr and "SYS_PTRACE" in done.stderr


# --------------------------------------------------------------------------- charts


def test_charts_from_the_sample(sample, tmp_path):
    pytest.importorskip("matplotlib")  # the [bench] extra; make test installs [dev] only
    from bench import charts

    written = charts.draw(sample, (sample.get("fastcast") or {}).get("overhead"), tmp_path)
    names = {p.name for p in written}
    assert {"autocast.png", "linear.png", "quantize.png"} <= names
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A run without the Linear group (filtered with -k) draws no Linear chart.
    partial = copy.deepcopy(sample)
    partial["benchmarks"] = [b for b in partial["benchmarks"] if b["group"] != "linear-fwd-bwd"]
    assert "linear.png" not in {p.name for p in charts.draw(partial, None, tmp_path / "p")}


@pytest.mark.slow  # a profiled training run in a fresh interpreter
def test_make_profile_samples_only_the_steady_state(tmp_path):
    # A py-spy that checks, when started, that the target finished its warm-up (the
    # --ready file exists), then waits for the target to end and writes its output.
    spy = tmp_path / "py-spy"
    log = tmp_path / "spy.log"
    spy.write_text(
        "#!/bin/bash\n"
        "while [ $# -gt 0 ]; do case $1 in --pid) pid=$2; shift;; --output) out=$2; shift;; "
        "esac; shift; done\n"
        'ready=$(tr "\\0" "\\n" < /proc/$pid/cmdline | grep -A1 -x -- --ready | tail -n 1)\n'
        f'if [ -e "$ready" ]; then echo warm >> "{log}"; else echo cold >> "{log}"; fi\n'
        'while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done\n'
        'echo profile > "$out"\n'
    )
    spy.chmod(0o755)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), STEPS="2", PYTHONPATH=str(ROOT))
    done = _script("record.sh", env | {"OUT": str(tmp_path / "out")})
    assert done.returncode == 0, done.stdout + done.stderr
    assert log.read_text().split() == ["warm", "warm"]  # flamegraph, speedscope
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["train_step_current.speedscope.json", "train_step_current.svg"]
    assert "steady_state: current, 2 steps after 10 warm-up steps" in done.stdout


# --------------------------------------------------------------------------- summary.md


def test_summary_has_the_overhead_training_step_and_compile_tables(sample):
    from bench import run

    extra = _train_step_sample(sample)["fastcast"]
    lines = run.summary_sections(
        {
            "overhead": sample["fastcast"]["overhead"],
            "train_step": extra["train_step"],
            "train_step_compile": extra["train_step_compile"],
        }
    )
    titles = [line for line in lines if line.startswith("## ")]
    assert titles == [
        "## Overhead per range (bench.overhead_report)",
        "## Training step, eager (bench.train_step)",
        "## Training step, compiled (bench.train_step --compile)",
    ]
    # The compile table's target is stated with its verdicts (torchao has none).
    target = "Target: a compiled FP8/FP4 step <= 0.6x its eager step: current 0.50x pass."
    assert lines[-2] == target


# --------------------------------------------------------------------------- a leaf


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (imports inside functions count)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_bench_is_a_leaf_without_cycles():
    outside = [*(ROOT / "fastcast").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    importers = [
        p.relative_to(ROOT).as_posix()
        for p in outside
        if any(m == "bench" or m.startswith("bench.") for m in _imports(p))
    ]
    assert importers == [], "bench/ must be a leaf: nothing in fastcast or tests imports it"
    modules = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"__init__", "conftest"}
    graph = {
        m: {i.split(".")[1] for i in _imports(ROOT / "bench" / f"{m}.py")
            if i.startswith("bench.") and i.split(".")[1] in modules}
        for m in modules
    }  # fmt: skip

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert [m for m in sorted(modules) if m in reach(m)] == [], graph

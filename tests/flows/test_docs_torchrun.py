"""docs/distributed.md's scripts run as a user runs them: under torchrun, with the
process count their first line names (gloo on the CPU), and against one process.

Each script prints ``rank R of W...: loss L`` on every rank. Every rank must report
itself and the world size (the old examples each started their own one-rank job), and
the losses must agree across the ranks and with one process: tensor parallelism and
FSDP2 on the same batch compute what one process does, to FP32 rounding.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_docs import torchrun_scripts

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "distributed.md"
SCRIPTS = torchrun_scripts(PAGE)
# "rank R of W: loss L", or with a 2-D mesh "rank R of W (dp D x tp T): loss L", where L
# is the rank's share of the global loss (the global loss over D).
REPORT = re.compile(r"^rank (\d+) of (\d+)(?: \(dp (\d+) x tp \d+\))?: loss (\S+)$", re.M)


def _run(name: str, code: str, folder: Path, nproc: int) -> dict[int, tuple[int, float]]:
    """Run ``code`` as ``folder/name`` with ``nproc`` processes under torchrun (in
    ``folder``: the checkpoints it writes land there); each rank's (world, global loss)."""
    folder.mkdir()
    script = folder / name
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTCAST_")}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # Each rank's stdout in its own file (--redirects 1): ranks sharing one pipe can
    # interleave their lines, which the report pattern would then miss.
    logs = folder / "logs"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), "--log-dir", str(logs), "--redirects", "1"]
    command += [script.name]
    done = subprocess.run(
        command, cwd=script.parent, env=env, capture_output=True, text=True, timeout=900
    )
    outputs = sorted(logs.rglob("stdout.log"))
    printed = "\n".join(f"{path.relative_to(logs)}:\n{path.read_text()}" for path in outputs)
    assert done.returncode == 0, printed[-3000:] + done.stderr[-6000:]
    assert len(outputs) == nproc, f"{len(outputs)} rank logs for {nproc} ranks:\n{printed}"
    reports: dict[int, tuple[int, float]] = {}
    for path in outputs:
        for rank, world, dp, loss in REPORT.findall(path.read_text()):
            assert int(rank) not in reports, f"rank {rank} reported twice:\n{printed}"
            reports[int(rank)] = (int(world), float(loss) * int(dp or 1))  # the global loss
    assert len(reports) == nproc, f"reports from ranks {sorted(reports)}:\n{printed}"
    return reports


def test_the_page_has_its_three_scripts():
    assert set(SCRIPTS) == {"tp.py", "fsdp.py", "mesh2d.py"}
    for name, (nproc, code) in SCRIPTS.items():
        assert nproc >= 2, name
        assert 'init_process_group("gloo")' in code and "init_method" not in code, name
        assert code.rstrip().endswith("dist.destroy_process_group()"), name


@pytest.mark.distributed
@pytest.mark.slow  # minutes: 2, 2 and 4 processes, then one, each importing torch
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_docs_script_runs_on_every_rank_as_one_process(name, tmp_path):
    nproc, code = SCRIPTS[name]
    ranks = _run(name, code, tmp_path / "ranks", nproc)
    assert sorted(ranks) == list(range(nproc))
    assert {world for world, _ in ranks.values()} == {nproc}
    losses = [loss for _, loss in ranks.values()]
    assert len(set(losses)) == 1, ranks  # the same loss on every rank

    single = _run(name, code, tmp_path / "one", 1)
    assert list(single) == [0] and single[0][0] == 1
    assert losses[0] == pytest.approx(single[0][1], rel=1e-5, abs=2e-6)
    print(f"{name}: {nproc} ranks {losses[0]}, one process {single[0][1]}")

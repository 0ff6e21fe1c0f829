"""Render the GPU tables of README.md and docs/cuda.md from the committed gpu-check run.

``bench/results/gpu/<device>-run<N>.json`` are what ``make gpu-check`` wrote on lent
GPUs (``gpu_check.json``; device, driver, torch, CUDA and fastcast's commit in each
run's ``env`` part). Each table comes from the newest run that has its part, and says
which run and commit that is (a part that ran out of time leaves the table to an
earlier run). The pages hold generated blocks between ``<!-- gpu:NAME -->`` and
``<!-- /gpu:NAME -->``; ``python -m bench.gpu_tables`` rewrites them and leaves every
other line alone (``--check``: exit 1 when a page is not what the data renders).
``make readme`` runs it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu"
PAGES = (ROOT / "README.md", ROOT / "docs" / "cuda.md")
RECIPES = ("delayed", "current", "rowwise", "block", "mxfp8", "nvfp4")
QUANTIZERS = ("current", "rowwise", "block", "mxfp8", "nvfp4_plain", "nvfp4")


def load_runs(folder: Path = RESULTS) -> list[dict[str, Any]]:
    """The runs, oldest first (``*-run<N>.json`` by N), each with its file name."""

    def number(path: Path) -> int:
        return int(re.search(r"run(\d+)\.json$", path.name).group(1))

    runs = []
    for path in sorted(folder.glob("*-run*.json"), key=number):
        data = json.loads(path.read_text())
        data["_file"] = path.name
        runs.append(data)
    return runs


def _part(data: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The newest result of part ``name`` (empty when no run has one)."""
    return _part_and_run(data, name)[0]


def _part_and_run(data: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], str]:
    for run in reversed(data):
        result = run.get(name, {}).get("result")
        if isinstance(result, dict) and result:
            env = run.get("env", {}).get("result", {})
            return result, f"{run['_file']}, fastcast {env.get('commit')}"
    return {}, ""


def device_line(data: list[dict[str, Any]]) -> str:
    env = _part(data, "env")
    return (
        f"{env.get('device')} (sm{str(env.get('capability', '')).replace('.', '')}, "
        f"{env.get('sms')} SMs), driver {env.get('driver')}, torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, Triton {env.get('triton')}"
    )


def _routing(data: list[dict[str, Any]], name: str) -> str:
    """What ran the quantize operators in the run that has part ``name``."""
    run_name = _part_and_run(data, name)[1].split(",")[0]
    run = next((r for r in data if r["_file"] == run_name), {})
    routing = run.get("build", {}).get("result", {}).get("cuda_routing", {})
    native = sorted(op for op, impl in routing.items() if "inductor" not in impl)
    if not native:
        return "Every quantize operator Inductor-compiled"
    return f"Native CUDA kernels for {', '.join(native)}; Inductor for the rest"


def _source(data: list[dict[str, Any]], name: str) -> str:
    return f"(`bench/results/gpu/{_part_and_run(data, name)[1]}`)"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(head) - 1)
    return [
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _cell(entry: Any, key: str, fmt: str) -> str:
    if isinstance(entry, dict) and key in entry:
        return format(entry[key], fmt)
    if entry is None:
        return "n/a"
    return f"failed ({str(entry).split(':')[0]})"  # the run recorded an error


def tests_block(data: list[dict[str, Any]]) -> list[str]:
    rows = []
    for name, what in (("pytest_gpu", "`pytest -m gpu`"), ("suite", "the whole suite")):
        result, run = _part_and_run(data, name)
        if result:
            counts = result.get("counts", {})
            note = "stopped at its time limit; " if "incomplete" in counts else ""
            if name == "pytest_gpu":  # what was run (a rerun may narrow it to some files)
                args = result.get("command", "").replace("-m pytest ", "").split(" -q")[0]
                what = f"`pytest {args}`" if args else what
            rows.append(
                [
                    what,
                    str(counts.get("passed", 0)),
                    str(counts.get("failed", 0) + counts.get("errors", 0)),
                    str(counts.get("skipped", 0)),
                    f"{note}`bench/results/gpu/{run}`",
                ]
            )
    parity = _part(data, "parity")
    lines = [f"On {device_line(data)}:", ""]
    lines += _table(["tests", "passed", "failed", "skipped", "note"], rows)
    if parity:
        lines += [
            "",
            f"Quantizer codes and scales, CUDA against the CPU path: {parity['equal']} of "
            f"{parity['cases']} cases bit for bit.",
        ]
    return lines


def host_block(data: list[dict[str, Any]]) -> list[str]:
    host = _part(data, "host_time")
    if not host:
        return ["(no host-time figures in this run)"]
    base = min(host.get("nn.Linear_us", 0), host.get("nn.Linear_again_us", 1e9))
    modes = [m for m in ("auto", "compiled") if f"current/{m}" in host]
    head = ["recipe"] + [f"{m}: µs (x nn.Linear)" for m in modes]
    rows = []
    for recipe in RECIPES:
        row = [recipe]
        for mode in modes:
            entry = host.get(f"{recipe}/{mode}", {})
            row.append(f"{entry.get('us', 0):.0f} ({entry.get('ratio', 0):.1f}x)")
        rows.append(row)
    intro = f"`nn.Linear` 64x64 bf16 forward+backward: {base:.0f} µs of host time "
    return [intro + f"{_source(data, 'host_time')}.", ""] + _table(head, rows)


# The operator each quantizer of the bandwidth part runs (its routing says native or not).
OPERATOR = {
    "current": "quantize_tensorwise",
    "rowwise": "quantize_rows",
    "block": "quantize_blocks",
    "mxfp8": "quantize_mxfp8",
    "nvfp4_plain": "quantize_nvfp4",
    "nvfp4": "quantize_nvfp4",
}


def quantize_block(data: list[dict[str, Any]]) -> list[str]:
    """One row per quantizer and implementation (native CUDA kernel or Inductor's
    operator), each from the newest run that timed it, against that run's copy."""
    found: dict[tuple[str, str], tuple[str, list[str]]] = {}
    sizes: list[str] = []
    copies: dict[str, list[str]] = {}
    for run in reversed(data):
        bw = run.get("bandwidth", {}).get("result")
        if not isinstance(bw, dict) or not bw:
            continue
        run_sizes = [k for k in bw if re.fullmatch(r"\d+x\d+", k)]
        sizes = sizes or run_sizes
        if run_sizes != sizes:
            continue
        routing = run.get("build", {}).get("result", {}).get("cuda_routing", {})
        label = re.search(r"run(\d+)", run["_file"]).group(0)
        for q in QUANTIZERS:
            for mode in bw.get("modes", ["auto"]):
                native = mode == "auto" and "inductor" not in routing.get(OPERATOR[q], "inductor")
                key = (q, "native CUDA" if native else "Inductor")
                entries = [bw[size].get(f"{q}/{mode}") for size in sizes]
                if key in found or not all(entries):
                    continue
                cells = [f"{e['GBps']:.0f} GB/s ({e['of_copy']:.0%})" for e in entries]
                found[key] = (label, cells)
                copies.setdefault(label, [f"{bw[size]['copy_GBps']:.0f}" for size in sizes])
    if not found:
        return ["(no bandwidth figures in this run)"]
    head = ["quantizer (bf16 in, both layouts)", "kernels", "run", *sizes]
    rows = [["device-to-device copy, GB/s", "", run, *cells] for run, cells in copies.items()]
    for q in QUANTIZERS:
        for impl in ("native CUDA", "Inductor"):
            if (q, impl) in found:
                run, cells = found[(q, impl)]
                rows.append([q, impl, run, *cells])
    return _table(head, rows)


def llama_block(data: list[dict[str, Any]]) -> list[str]:
    llama = _part(data, "llama")
    if not llama:
        return ["(no Llama-block figures in this run)"]
    rows = [["BF16", f"{llama['bf16_ms']:.2f}", "1.00x"]]
    for name in (*RECIPES, "torchao_tensorwise", "torchao_rowwise"):
        entry = llama.get(name)
        if entry is not None:
            ratio = _cell(entry, "vs_bf16", ".2f")
            rows.append(
                [name, _cell(entry, "ms", ".2f"), ratio + ("x" if ratio[0].isdigit() else "")]
            )
    head = f"{llama['shape']}, forward+backward, eager {_source(data, 'llama')}:"
    return [head, ""] + _table(["recipe", "ms", "vs BF16"], rows)


BLOCKS: dict[str, Callable[[list[dict[str, Any]]], list[str]]] = {
    "tests": tests_block,
    "host": host_block,
    "quantize": quantize_block,
    "llama": llama_block,
}


def render(text: str, data: list[dict[str, Any]]) -> str:
    def block(match: re.Match[str]) -> str:
        name = match.group(1)
        body = "\n".join(BLOCKS[name](data))
        return f"<!-- gpu:{name} -->\n{body}\n<!-- /gpu:{name} -->"

    return re.sub(r"<!-- gpu:(\w+) -->.*?<!-- /gpu:\1 -->", block, text, flags=re.S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    data = load_runs()
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = render(text, data)
        if new != text:
            stale.append(page.name)
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(f"not what bench/results/gpu renders: {', '.join(stale)} (run make readme)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

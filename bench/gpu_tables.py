"""Render the GPU tables of README.md and docs/cuda.md from the committed gpu-check run.

``bench/results/gpu/gpu_check.json`` is what ``make gpu-check`` wrote on a lent GPU
(device, driver, torch and CUDA named in its ``env`` part). The pages hold generated
blocks between ``<!-- gpu:NAME -->`` and ``<!-- /gpu:NAME -->``; ``python -m
bench.gpu_tables`` rewrites them and leaves every other line alone (``--check``: exit 1
when a page is not what the data renders). ``make readme`` runs it.
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
DATA = ROOT / "bench" / "results" / "gpu" / "gpu_check.json"
PAGES = (ROOT / "README.md", ROOT / "docs" / "cuda.md")
RECIPES = ("delayed", "current", "rowwise", "block", "mxfp8", "nvfp4")
QUANTIZERS = ("current", "rowwise", "block", "mxfp8", "nvfp4_plain", "nvfp4")


def _part(data: dict[str, Any], name: str) -> dict[str, Any]:
    result = data.get(name, {}).get("result")
    return result if isinstance(result, dict) else {}


def device_line(data: dict[str, Any]) -> str:
    env = _part(data, "env")
    return (
        f"{env.get('device')} (sm{str(env.get('capability', '')).replace('.', '')}, "
        f"{env.get('sms')} SMs), driver {env.get('driver')}, torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, Triton {env.get('triton')}; fastcast {env.get('commit')}"
    )


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
    return "n/a" if entry is None else str(entry)[:40]


def tests_block(data: dict[str, Any]) -> list[str]:
    rows = []
    for name, what in (("pytest_gpu", "`pytest -m gpu`"), ("suite", "the whole suite")):
        result = _part(data, name)
        if result:
            counts = result.get("counts", {})
            rows.append(
                [
                    what,
                    str(counts.get("passed", 0)),
                    str(counts.get("failed", 0) + counts.get("errors", 0)),
                    str(counts.get("skipped", 0)),
                    "" if "incomplete" not in counts else "stopped at its time limit",
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


def host_block(data: dict[str, Any]) -> list[str]:
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
    return [f"`nn.Linear` 64x64 bf16 forward+backward: {base:.0f} µs of host time.", ""] + (
        _table(head, rows)
    )


def quantize_block(data: dict[str, Any]) -> list[str]:
    bw = _part(data, "bandwidth")
    sizes = [k for k in bw if "x" in k and isinstance(bw[k], dict)]
    if not sizes:
        return ["(no bandwidth figures in this run)"]
    modes = bw.get("modes", ["auto"])
    head = ["quantizer (bf16 in, both layouts)"] + [f"{s} {m}" for s in sizes for m in modes]
    rows = [
        ["device-to-device copy, GB/s"]
        + [f"{bw[s]['copy_GBps']:.0f}" for s in sizes for _ in modes]
    ]
    for q in QUANTIZERS:
        row = [q]
        for s in sizes:
            for m in modes:
                e = bw[s].get(f"{q}/{m}")
                row.append("n/a" if not e else f"{e['GBps']:.0f} GB/s ({e['of_copy']:.0%})")
        rows.append(row)
    return _table(head, rows)


def llama_block(data: dict[str, Any]) -> list[str]:
    llama = _part(data, "llama")
    if not llama:
        return ["(no Llama-block figures in this run)"]
    rows = [["BF16", f"{llama['bf16_ms']:.2f}", "1.00x"]]
    for name in (*RECIPES, "torchao_tensorwise", "torchao_rowwise"):
        entry = llama.get(name)
        if entry is not None:
            rows.append([name, _cell(entry, "ms", ".2f"), _cell(entry, "vs_bf16", ".2f") + "x"])
    return [f"{llama['shape']}, forward+backward, eager:", ""] + _table(
        ["recipe", "ms", "vs BF16"], rows
    )


BLOCKS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "tests": tests_block,
    "host": host_block,
    "quantize": quantize_block,
    "llama": llama_block,
}


def render(text: str, data: dict[str, Any]) -> str:
    def block(match: re.Match[str]) -> str:
        name = match.group(1)
        body = "\n".join(BLOCKS[name](data))
        return f"<!-- gpu:{name} -->\n{body}\n<!-- /gpu:{name} -->"

    return re.sub(r"<!-- gpu:(\w+) -->.*?<!-- /gpu:\1 -->", block, text, flags=re.S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    data = json.loads(DATA.read_text())
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = render(text, data)
        if new != text:
            stale.append(page.name)
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(f"not what {DATA.name} renders: {', '.join(stale)} (run make readme)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

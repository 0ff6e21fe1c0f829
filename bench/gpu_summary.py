"""``gpu_check.json`` and ``gpu_check.md`` from a gpu-check run's ``sections.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(out: Path) -> dict[str, Any]:
    parts: dict[str, Any] = {}
    for line in (out / "sections.jsonl").read_text().splitlines():
        entry = json.loads(line)
        parts[entry["part"]] = entry
    return parts


def summarise(out: Path) -> dict[str, Any]:
    parts = load(out)
    (out / "gpu_check.json").write_text(json.dumps(parts, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(parts))
    return parts


def _result(parts: dict[str, Any], name: str) -> Any:
    return parts.get(name, {}).get("result")


def markdown(parts: dict[str, Any]) -> str:
    lines = ["# gpu-check", ""]
    env = _result(parts, "env") or {}
    if env:
        lines += [
            f"{env.get('device', 'no GPU')} (sm {env.get('capability')}, {env.get('sms')} SMs), "
            f"driver {env.get('driver')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
            f"Triton {env.get('triton')}, {env.get('nvcc')}; commit {env.get('commit')}",
            "",
        ]
    lines += ["| part | seconds | outcome |", "| --- | ---: | --- |"]
    for name, entry in parts.items():
        if "error" in entry:
            outcome = "ERROR: " + entry["error"].strip().splitlines()[-1][:160]
        elif "skipped" in entry:
            outcome = "skipped: " + entry["skipped"]
        elif "group_status" in entry:
            outcome = f"child process ended: {entry['group_status']}"
        else:
            outcome = _outcome(name, entry.get("result"))
        lines.append(f"| {name} | {entry.get('seconds', '')} | {outcome} |")
    lines.append("")
    for name in ("host_time", "llama"):
        result = _result(parts, name)
        if isinstance(result, dict):
            lines += [f"## {name}", "", "```", json.dumps(result, indent=1), "```", ""]
    return "\n".join(lines)


def _outcome(name: str, result: Any) -> str:
    if not isinstance(result, dict):
        return str(result)[:160]
    if name in ("pytest_gpu", "suite"):
        return f"{result.get('counts')} status {result.get('status')}"
    if name == "parity":
        differ = list(result["failures"])[:6]
        return f"{result['equal']}/{result['cases']} bit for bit; differ: {differ}"
    if name == "cuda_graph":
        return ", ".join(
            f"{k}: {'ok' if v.get('captured') else 'FAILED'}"
            for k, v in result.items()
            if isinstance(v, dict)
        )
    return ", ".join(list(result)[:8])

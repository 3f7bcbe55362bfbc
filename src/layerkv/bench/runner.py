"""Runs the chosen bench suites one after another and writes results.json, results.md (one
markdown table per suite) and the suites' PNG plots into the output directory. Driver thread
only; suites are imported lazily (torch / mooncake only when a suite needs them).
"""

from __future__ import annotations

import importlib
import json
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from layerkv.bench import OPT_IN_SUITES, SUITE_MODULES, SUITES
from layerkv.bench.common import BenchOptions, Progress, Row, SuiteResult


def run_bench(
    suites: Sequence[str], options: BenchOptions, *, progress: bool = True, command: str = ""
) -> dict[str, Any]:
    """Run `suites` (names from SUITES and OPT_IN_SUITES, in that order; none: all of SUITES),
    write the files, return the JSON dict."""
    known = SUITES + OPT_IN_SUITES
    unknown = sorted(set(suites) - set(known))
    if unknown:
        raise ValueError(f"unknown bench suite(s) {unknown}; known: {', '.join(known)}")
    chosen = [name for name in known if name in suites] if suites else list(SUITES)
    options.out_dir.mkdir(parents=True, exist_ok=True)
    bar = Progress(len(chosen), progress)
    results: list[SuiteResult] = []
    started = time.perf_counter()
    try:
        for name in chosen:
            module = importlib.import_module(SUITE_MODULES[name])
            suite_start = time.perf_counter()
            result = module.run(options, bar)
            result.seconds = time.perf_counter() - suite_start
            results.append(result)
            bar.suite_done()
    finally:
        bar.close()
    doc = {
        "command": command,
        "quick": options.quick,
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": _cpus()},
        "total_seconds": time.perf_counter() - started,
        "suites": {r.name: _clean(asdict(r)) for r in results},
    }
    (options.out_dir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    (options.out_dir / "results.md").write_text(markdown(doc))
    return doc


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def _clean(value: Any) -> Any:
    """JSON has no inf / nan: they become null (and show as '-' in the tables)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def markdown(doc: dict[str, Any]) -> str:
    """The whole report: command, then per suite its notes, headline numbers and table."""
    lines = ["# layerkv bench results", ""]
    if doc.get("command"):
        lines += [f"Command: `{doc['command']}`", ""]
    m = doc["machine"]
    lines += [
        f"Machine: {m['cpus']} CPUs, Python {m['python']}, {m['platform']}; total {doc['total_seconds']:.0f} s",
        "",
    ]
    for name, suite in doc["suites"].items():
        lines += [f"## {name}", "", f"({suite['seconds']:.1f} s)", ""]
        lines += [f"* {note}" for note in suite["notes"]]
        if suite["notes"]:
            lines.append("")
        if suite["summary"]:
            lines += ["| headline | value |", "|---|---:|"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in suite["summary"].items()]
            lines.append("")
        lines += table(suite["rows"])
        for title, rows in suite.get("tables", {}).items():
            lines += [f"### {title}", ""] + table(rows)
        lines += [f"![{p}]({p})" for p in suite["plots"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def table(rows: list[Row]) -> list[str]:
    if not rows:
        return []
    columns = list(dict.fromkeys(k for row in rows for k in row))
    out = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if _numeric(rows, c) else "---" for c in columns) + "|",
    ]
    out += ["| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |" for row in rows]
    out.append("")
    return out


def _numeric(rows: list[Row], column: str) -> bool:
    return all(
        isinstance(r.get(column), (int, float)) and not isinstance(r.get(column), bool)
        for r in rows
        if r.get(column) is not None
    )


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)

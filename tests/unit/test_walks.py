"""The walks of docs/architecture.md stay true. One load, one save and one commit verdict run on the
embedded store (tests/connector/rig.py, the default path: host caches, staging only, a group plan)
under a profiler hook on every thread (sys.setprofile, threading.setprofile: the transfer runs on
named threads), which records each layerkv function called: its module, qualified name and thread.
Each walk row must name a function that was called, in the file the row names, on the thread it
names, in the row order on each thread; each heading's "N calls in M files" must count its rows.
Every `Class.attr` the page names (prose, glossary, where to change X) must exist in src/layerkv.
A failure names the walk and the row, and where a function of that name was called instead (a
function that moved module or was renamed: fix the doc)."""

from __future__ import annotations

import ast
import itertools
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from tests.backends import EmbeddedBackend
from tests.connector.rig import BLOCK_SIZE, Req, Rig

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"
SRC = REPO / "src" / "layerkv"

# a walk's thread column -> the names (prefixes) of the threads that run it in the rig
THREADS: dict[str, tuple[str, ...]] = {
    "compute": ("MainThread",),
    "scheduler": ("MainThread",),
    "worker": ("MainThread",),
    "receive": ("layerkv-recv-",),
    "send": ("layerkv-send-",),
    "write": ("layerkv-write-",),
    # a split store call: the calling thread runs the first part, lane threads the others
    "lanes": ("layerkv-rlane-", "layerkv-slane-", "layerkv-recv-", "layerkv-write-"),
}


@dataclass(frozen=True)
class Row:
    number: int
    thread: str
    function: str  # qualified name, e.g. LoadJob.run
    floor: tuple[str, ...]  # the store calls it makes (after ->)
    file: str  # relative to src/layerkv

    @property
    def module(self) -> str:
        return "layerkv." + self.file.removesuffix(".py").replace("/", ".")

    def label(self, walk: str) -> str:
        return f"walk {walk!r}, row {self.number} (`{self.function}`, {self.file}, {self.thread})"


@dataclass(frozen=True)
class Walk:
    name: str
    calls: int
    files: int
    rows: tuple[Row, ...]


def parse_walks(text: str) -> list[Walk]:
    """The walks of the page's "## The three walks" section: `### <name>: N calls in M files`,
    then one table `| # | thread | function | file | what it does |`."""
    section = text.split("\n## The three walks\n", 1)[1].split("\n## ", 1)[0]
    walks = []
    for chunk in re.split(r"^### ", section, flags=re.M)[1:]:
        heading = chunk.splitlines()[0].strip()
        match = re.fullmatch(r"(.+): (\d+) calls in (\d+) files", heading)
        assert match, f"walk heading {heading!r} must end in 'N calls in M files'"
        rows = []
        for line in chunk.splitlines():
            if not re.match(r"\|\s*\d+\s*\|", line):
                continue
            number, thread, function, file = [cell.strip() for cell in line.strip().strip("|").split("|")][:4]
            names = re.findall(r"`([^`]+)`", function)
            assert names, f"walk {match[1]!r}: row {number} names no `function`: {line}"
            rows.append(Row(int(number), thread, names[0], tuple(names[1:]), file))
        walks.append(Walk(match[1], int(match[2]), int(match[3]), tuple(rows)))
    return walks


class Trace:
    """Every layerkv function called while installed: (sequence number, thread, module, qualname)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, str, str]] = []
        self._seq = itertools.count()

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("layerkv."):
                self.calls.append((next(self._seq), threading.current_thread().name, module, frame.f_code.co_qualname))

    def install(self) -> None:
        threading.setprofile(self._hook)  # threads started from now on (the rig starts its own)
        sys.setprofile(self._hook)

    def uninstall(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def of(self, qualname: str) -> set[tuple[str, str]]:
        """(module, thread) of every call of `qualname`."""
        return {(module, thread) for _, thread, module, name in self.calls if name == qualname}

    def named_like(self, qualname: str) -> list[str]:
        """Called functions whose last name part is `qualname`'s (where a moved or renamed one went)."""
        last = qualname.rsplit(".", 1)[-1]
        return sorted({f"{m}:{n}" for _, _, m, n in self.calls if n.rsplit(".", 1)[-1] == last})[:6]


def on(thread: str, label: str) -> bool:
    return thread.startswith(THREADS[label])


def run_default_path() -> Trace:
    """A producer saves a 10-block prompt (its verdict commits it a step later), a consumer loads it."""
    trace = Trace()
    trace.install()
    rig = None
    try:
        rig = Rig(EmbeddedBackend(), transfer_plan="groups", read_layers_per_range=2, num_layers=4)
        tokens = list(range(10 * BLOCK_SIZE + 2))
        assert rig.run(Req("producer", tokens)) == (0, set())
        consumer = Req("consumer", tokens)
        pool_tokens, scheduled = rig.admit(consumer)
        assert pool_tokens == 10 * BLOCK_SIZE
        assert rig.step([scheduled]) == set()
        assert rig.wrong_blocks(consumer, range(10)) == []
        rig.drain()
        rig.flush()
        stats = rig.workers[0].stats()
        assert (stats.committed_keys, stats.load_blocks, stats.load_failed_blocks) == (10, 10, 0)
        assert stats.load_plans_groups == 1, "the load did not take the group plan the walks follow"
    finally:
        if rig is not None:
            rig.shutdown()
        trace.uninstall()
    return trace


def row_problems(walk: Walk, trace: Trace) -> Iterator[str]:
    """Counts, numbering, and each row's function, file and thread."""
    if [row.number for row in walk.rows] != list(range(1, len(walk.rows) + 1)):
        yield f"walk {walk.name!r}: rows are numbered {[r.number for r in walk.rows]}, not 1..{len(walk.rows)}"
    if len(walk.rows) != walk.calls:
        yield f"walk {walk.name!r}: its heading says {walk.calls} calls, its table has {len(walk.rows)} rows"
    files = sorted({row.file for row in walk.rows})
    if len(files) != walk.files:
        yield f"walk {walk.name!r}: its heading says {walk.files} files, its rows name {len(files)}: {files}"
    for row in walk.rows:
        if row.thread not in THREADS:
            yield f"{row.label(walk.name)}: unknown thread {row.thread!r}; one of {sorted(THREADS)}"
            continue
        called = trace.of(row.function)
        if not called:
            yield f"{row.label(walk.name)} was never called; called with that name: {trace.named_like(row.function)}"
            continue
        modules = {module for module, _ in called}
        if row.module not in modules:
            yield f"{row.label(walk.name)} was called in {sorted(modules)}, not in {row.module}: fix its file"
        elif not any(on(thread, row.thread) for module, thread in called if module == row.module):
            yield f"{row.label(walk.name)} ran on {sorted({t for _, t in called})}, never on a {row.thread} thread"
        for floor in row.floor:
            if not any(on(thread, row.thread) for _, thread in trace.of(floor)):
                yield f"{row.label(walk.name)}: its store call `{floor}` was never made on a {row.thread} thread"


def order_problems(walk: Walk, trace: Trace) -> Iterator[str]:
    """The rows of each thread (lanes aside: they run beside their caller) in the order the calls
    ran there, within one pass: a call of a row before the last one matched starts the match again
    after that row (a loop's next pass: the next layer group, the next wave), so two rows swapped
    inside a pass do not match across passes. Rows whose function was not called in their file are
    left to row_problems."""
    by_threads: dict[tuple[str, ...], list[Row]] = {}
    for row in walk.rows:
        called = row.module in {module for module, _ in trace.of(row.function)}
        if row.thread in THREADS and row.thread != "lanes" and called:
            by_threads.setdefault(THREADS[row.thread], []).append(row)
    for prefixes, rows in by_threads.items():
        keys = [(row.module, row.function) for row in rows]
        matched = best = 0  # best: the furthest any pass got (the row to report)
        for _, thread, module, name in trace.calls:
            if matched == len(rows) or not thread.startswith(prefixes):
                continue
            if (module, name) == keys[matched]:
                matched += 1
                best = max(best, matched)
            elif (module, name) in keys[: matched - 1]:
                matched = max(i for i, key in enumerate(keys[: matched - 1]) if key == (module, name)) + 1
        if best < len(rows):
            after = f"after row {rows[best - 1].number}" if best else "first"
            yield f"{rows[best].label(walk.name)} was not called {after} in one pass on that thread (the walk's order)"


def class_attributes() -> dict[str, set[str]]:
    """Class name -> names defined in it (methods, class attributes, self.x assignments), over src."""
    found: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = found.setdefault(node.name, set())
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(inner.name)
                    elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                        names.add(inner.target.id)
                    elif isinstance(inner, (ast.Assign, ast.AnnAssign)):
                        targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                        names |= {t.id for t in targets if isinstance(t, ast.Name)}
                        names |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
    return found


@pytest.fixture(scope="module")
def trace() -> Trace:
    return run_default_path()


def test_the_page_has_its_walks() -> None:
    names = [walk.name for walk in parse_walks(ARCHITECTURE.read_text())]
    assert names == ["Load of one layer", "Save of one layer", "Write of the step's objects", "The commit verdict"]


def test_every_walk_row_was_called_in_its_file_on_its_thread(trace: Trace) -> None:
    problems = [p for walk in parse_walks(ARCHITECTURE.read_text()) for p in row_problems(walk, trace)]
    assert not problems, "docs/architecture.md walks out of date:\n" + "\n".join(problems)


def test_every_walk_runs_in_its_order_on_each_thread(trace: Trace) -> None:
    problems = [p for walk in parse_walks(ARCHITECTURE.read_text()) for p in order_problems(walk, trace)]
    assert not problems, "docs/architecture.md walks out of order:\n" + "\n".join(problems)


def test_every_class_attribute_the_page_names_exists() -> None:
    defined = class_attributes()
    named = set(re.findall(r"`([A-Z]\w*)\.(\w+)`", ARCHITECTURE.read_text()))
    missing = sorted(f"{cls}.{attr}" for cls, attr in named if attr not in defined.get(cls, set()))
    assert not missing, f"docs/architecture.md names what src/layerkv does not define: {missing}"

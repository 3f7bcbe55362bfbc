"""Each bench suite in its tiny configuration: well-formed rows, finite numbers, counts that
match the formulas. Times are never asserted (benchmarks are not tests)."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

from layerkv.bench import SUITE_MODULES, SUITES
from layerkv.bench.common import BenchOptions, Progress, SuiteResult
from layerkv.cli import main


def _run(name: str, tmp_path: Path, mooncake: bool = False) -> SuiteResult:
    options = BenchOptions(quick=True, out_dir=tmp_path, mooncake=mooncake, tiny=True)
    progress = Progress(1, enabled=False)
    try:
        return importlib.import_module(SUITE_MODULES[name]).run(options, progress)
    finally:
        progress.close()


def _numbers_finite(rows: list[dict], skip: tuple[str, ...] = ()) -> None:
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float) and key not in skip:
                assert math.isfinite(value), f"{key}={value} in {row}"


def _plots_exist(result: SuiteResult, tmp_path: Path) -> None:
    assert result.plots
    for name in result.plots:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_datapath_embedded(tmp_path: Path) -> None:
    result = _run("datapath", tmp_path)
    assert [r["range_nbytes"] for r in result.rows] == [4096, 65536]
    for row in result.rows:
        assert row["backend"] == "embedded" and row["verified"] is True
        assert row["ranges_per_step"] == row["blocks"] * (1 + 2 * row["layers"])
        assert row["get_lw_over_wo"] == pytest.approx(row["lw_get_gbps"] / row["wo_get_gbps"])
        assert row["lw_get_gbps"] > 0 and row["memcpy_gbps"] > 0
    _numbers_finite(result.rows)
    _plots_exist(result, tmp_path)


@pytest.mark.mooncake
def test_datapath_mooncake_local_and_remote_segment(tmp_path: Path) -> None:
    from tests.mooncake_master import require_mooncake

    require_mooncake()
    result = _run("datapath", tmp_path, mooncake=True)
    assert sorted({r["backend"] for r in result.rows}) == ["embedded", "mooncake-local", "mooncake-remote"]
    assert all(r["verified"] for r in result.rows)
    _numbers_finite(result.rows)


def test_descriptors_lists_identical(tmp_path: Path) -> None:
    result = _run("descriptors", tmp_path)
    assert {(r["shape"], r["blocks"]) for r in result.rows} == {
        (s, b) for s in ("gqa kv[2,N,16,8,128]", "mla [N,16,576]") for b in (64, 512)
    }
    for row in result.rows:
        assert row["identical"] is True
        assert row["ranges_per_layer"] == row["blocks"] * (2 if row["shape"].startswith("gqa") else 1)
    assert result.summary["all_identical"] == 1.0
    _numbers_finite(result.rows)


def test_descriptor_loop_matches_template_lists() -> None:
    import numpy as np

    from layerkv.bench.micro.descriptors import build_layout, loop_ranges

    layout = build_layout("gqa kv[2,N,16,8,128]", 32)
    ids = np.array([5, 0, 31, 7])
    got = layout.template(1).ranges(ids)
    assert (got.ptrs, got.sizes, got.offsets) == loop_ranges(layout, 1, ids.tolist())
    assert loop_ranges(layout, 1, [5])[0] != loop_ranges(layout, 1, [6])[0]


def test_lookup_counts(tmp_path: Path) -> None:
    result = _run("lookup", tmp_path)
    rows = {(r["hit_rate"], r["variant"]): r for r in result.rows}
    blocks = 1024 // 16
    for hit in (0.0, 0.1, 0.5, 1.0):
        windowed, one = rows[(hit, "windowed")], rows[(hit, "one query")]
        assert windowed["hit_blocks"] == one["hit_blocks"] == int(blocks * hit)
        assert one["keys_queried"] == blocks and one["exists_calls"] == 1
        # windows of 32 up to and including the first window with a miss
        assert windowed["keys_queried"] == min(blocks, (int(blocks * hit) // 32 + 1) * 32)
        assert windowed["backend_exists_calls"] == windowed["exists_calls"]
    _numbers_finite(result.rows)


def test_objects_counts_match_formula(tmp_path: Path) -> None:
    result = _run("objects", tmp_path)
    L, B, R = 2, 3, 2
    rows = {(r["scheme"], r["phase"]): r for r in result.rows}
    lk_save, lk_load = rows[("block x rank (layerkv)", "save")], rows[("block x rank (layerkv)", "load")]
    pl_save, pl_load = rows[("block x layer x rank", "save")], rows[("block x layer x rank", "load")]
    assert lk_save["objects_created"] == B * R and pl_save["objects_created"] == B * L * R
    assert lk_save["sessions"] == B * R and lk_load["sessions"] == B * R
    assert lk_save["data_calls"] == R  # per rank one write of the object images staged layer by layer
    assert lk_load["data_calls"] == L * R  # one per layer per rank into staging (the header travels with layer 0)
    assert lk_load["loaded_tokens"] == B * 16
    assert pl_save["exists_keys"] == pl_load["exists_keys"] == B * L * R
    assert pl_save["data_calls"] == pl_load["data_calls"] == L * R
    assert pl_load["verified"] is True
    assert result.summary["L2 B3 R2.objects_ratio"] == L


def test_a_failing_overlap_run_gives_the_callers_torch_threads_back(tmp_path: Path, monkeypatch) -> None:
    """overlap runs torch on 1 thread; a run that fails must still restore the caller's count: the
    bits of every later forward in the process depend on it (a test computing local compute after
    a failed run would differ from an engine in another process)."""
    import torch

    from layerkv.bench.micro import overlap

    def fail(*args, **kwargs):
        raise RuntimeError("a measurement failed")

    threads = torch.get_num_threads()
    monkeypatch.setattr(overlap, "_conditions", fail)
    with pytest.raises(RuntimeError, match="a measurement failed"):
        _run("overlap", tmp_path)
    assert torch.get_num_threads() == threads


def test_overlap_rows(tmp_path: Path) -> None:
    result = _run("overlap", tmp_path)
    conditions = ("no delay", "transfer ~ compute", "transfer ~ 2x compute")
    variants = ("recompute all", "load all, then compute", "layerwise prefetch 1", "layerwise prefetch 2")
    saves = "saves (whole prompt computed, every block saved)"
    deep = "transfer ~ compute, 4 layers"  # the deep model (32 layers; 4 in the tiny configuration)
    saving = [(saves, "saving, defaults (staged images)"), (saves, "saving, register_kv_cache, per-layer writes")]
    assert [(r["condition"], r["variant"]) for r in result.rows] == (
        [(c, v) for c in conditions for v in variants] + saving + [(deep, v) for v in variants]
    )
    for row in result.rows[:-6] + result.rows[-4:]:
        assert row["ttft_ms"] > 0 and row["transfer_alone_ms"] > 0 and row["compute_alone_ms"] > 0
        assert math.isnan(row["hidden_fraction"]) != row["variant"].startswith("layerwise")
    assert all(row["ttft_ms"] > 0 for row in result.rows[-6:-4])
    assert result.summary["saves.staged_over_no_pool_ttft"] > 0 and result.summary["saves.direct_over_no_pool_ttft"] > 0
    staged = [r for r in result.rows if r["variant"].startswith("layerwise")]
    assert all(
        r["staging_copy_ms"] > 0 and r["staging_copy_gb_s"] > 0 for r in staged
    )  # every read went through staging
    assert all(r["compute_wait_ms"] >= 0 for r in staged)
    assert all(math.isnan(r["compute_wait_ms"]) for r in result.rows if not r["variant"].startswith("layerwise"))
    assert (
        result.summary["transfer_eq_compute_4_layers.best_layerwise_hidden_fraction"]
        == min((r for r in result.rows[-2:]), key=lambda r: r["ttft_ms"])["hidden_fraction"]
    )
    assert any("97.0% at 32" in note or "75.0% at 4" in note for note in result.notes)
    _numbers_finite(result.rows, skip=("hidden_fraction", "transfer_alone_ms", "compute_wait_ms"))
    _plots_exist(result, tmp_path)


def test_scale_rows(tmp_path: Path) -> None:
    result = _run("scale", tmp_path)
    assert [(r["layers"], r["prompt_tokens"]) for r in result.rows] == [(4, 1024), (4, 2048)]
    for row in result.rows:
        assert row["blocks"] == row["prompt_tokens"] // 16 and row["python_peak_mib"] > 0
    _numbers_finite(result.rows)
    _plots_exist(result, tmp_path)


def test_cli_writes_json_markdown_and_png(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert (
        main(
            ["bench", "descriptors", "lookup", "--quick", "--tiny", "--no-mooncake", "--no-progress", "--out", str(out)]
        )
        == 0
    )
    doc = json.loads((out / "results.json").read_text())
    assert list(doc["suites"]) == ["descriptors", "lookup"] and doc["quick"] is True
    md = (out / "results.md").read_text()
    assert "## descriptors" in md and "## lookup" in md and "| shape | blocks |" in md
    assert list(out.glob("*.png"))


def test_cli_rejects_unknown_suite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nosuch", "--out", str(tmp_path)]) == 2
    assert "unknown suite(s) nosuch" in capsys.readouterr().err
    assert set(SUITES) == {"datapath", "plans", "descriptors", "lookup", "objects", "overlap", "scale"}


def test_plans_rows_compare_every_plan_with_whole_objects(tmp_path: Path) -> None:
    result = _run("plans", tmp_path)
    paths = {(r["backend"], r["direction"], r["path"]) for r in result.rows}
    for backend in {r["backend"] for r in result.rows}:
        for path in ("whole object", "layerkv save (layers)", "layerkv save (auto)"):
            assert (backend, "put", path) in paths
        for plan in ("layers", "groups", "whole", "auto"):
            assert (backend, "get", f"layerkv load ({plan})") in paths
        for label in ("tenant key", "encrypted"):
            assert {
                (backend, "put", f"layerkv save (auto), {label}"),
                (backend, "get", f"layerkv load (auto), {label}"),
            } <= paths
    assert all(r["verified"] for r in result.rows if "verified" in r)
    _numbers_finite(result.rows)


@pytest.mark.mooncake
def test_network_on_a_namespace_cluster(tmp_path: Path) -> None:
    """The suite over a real three-host namespace cluster (needs root: CI runs as root); every
    cell of 3 link rates x 2 prompts, with the bound max(ceiling, transfer alone) it is judged by."""
    from layerkv.bench.cluster.pool import cluster_problems

    if cluster_problems():
        pytest.fail("suite network cannot run here: " + "; ".join(cluster_problems()), pytrace=False)
    result = _run("network", tmp_path, mooncake=True)
    assert [(r["link"], r["prompt_tokens"]) for r in result.rows] == [
        (link, n) for link in ("unshaped", "10gbit", "1gbit") for n in (128, 256)
    ]
    _numbers_finite(result.rows)
    for row in result.rows:
        assert row["bound_ms"] == max(row["ceiling_ms"], row["transfer_alone_ms"]) and row["pool_mib"] > 0
        assert row["planner"] != "-"  # the planner's choice is reported
    assert result.summary["cells"] == 6
    _plots_exist(result, tmp_path)

"""Suite `serving` without vLLM: what it runs — the grid (engines, pool and cache sizes, the
quick mode, the --prefix / --suffix / --repeats flags), the prompts, its opt-in wiring in the
CLI, and the order of each engine's calls in one step of `measure` (fake engines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerkv.bench import OPT_IN_SUITES, SUITES
from layerkv.bench.common import BenchOptions
from layerkv.bench.serving.grid import LOAD_PREFIX_TOKENS, Grid, load_prompts, prefix_ids, suffix_ids
from layerkv.bench.serving.report import CEILING, CONTENDERS, LAYERKV, LAYERKV_DIRECT, MOONCAKE, RECOMPUTE, schedule
from layerkv.cli import main


def test_prompts_are_distinct_across_cells_and_repeats() -> None:
    prefixes = {tuple(prefix_ids(p, r)) for p in (512, 2048) for r in range(-1, 3)}
    assert len(prefixes) == 8 and all(len(p) in (512, 2048) for p in prefixes)
    short, long = suffix_ids(32, 0), suffix_ids(512, 0)
    assert long[:32] != short  # the 32-token suffix is not the 512 one's first block
    assert prefix_ids(512, 0) != prefix_ids(2048, 0)[:512]
    shared, prompts = load_prompts(10, 0)
    heads = [tuple(p[:LOAD_PREFIX_TOKENS]) for p in prompts]
    hits = [h in {tuple(s) for s in shared} for h in heads]
    assert hits == [True, True, True, True, False] * 2  # 80 % share a saved prefix
    assert len(set(heads)) == len(shared) + 2 and len({tuple(p) for p in prompts}) == 10


def test_grid_sizes_the_engines_and_the_pool() -> None:
    grid = Grid((512, 2048), (32, 512), 3, load_requests=8)
    assert grid.max_model_len == 2048 + 512 + 32
    assert grid.kv_bytes_per_token == 8 * 2 * 1024 * 4
    assert grid.engine_cache_gib() == 1  # (4 shared + 1 own) x 2048 + 8 x 144 tokens of the load batch, 64 KiB each
    assert Grid((512, 2048), (32, 512), 3, load_requests=12).engine_cache_gib() == 1  # (4 + 2) x 2048 + 12 x 144
    assert Grid((512, 2048), (32, 512), 3, load_requests=16).engine_cache_gib() == 2  # 3 own prefixes: 1.04 GiB
    per_connector = (3 * (512 + 2048 + 2 * (32 + 512)) + 2 * 4 * 2048) * grid.kv_bytes_per_token
    assert 2 * per_connector < grid.pool_bytes() < 3 * per_connector
    assert Grid((8192,), (2048,), 3, load_requests=8).engine_cache_gib() == 1
    assert Grid((16384,), (2048,), 3).engine_cache_gib() == 2


def test_quick_grid_leaves_out_the_register_kv_cache_engine_and_the_load_batch(tmp_path: Path) -> None:
    quick = Grid.for_options(BenchOptions(quick=True, out_dir=tmp_path))
    assert LAYERKV_DIRECT not in quick.contenders and "layerkv-direct" not in quick.engines
    assert quick.load_repeats == 0 and quick.repeats == 1 and len(quick.engines) == 5
    full = Grid.for_options(BenchOptions(quick=False, out_dir=tmp_path))
    assert full.contenders == CONTENDERS and "layerkv-direct" in full.engines and full.load_repeats == 2
    assert all(
        c in full.contenders
        for s in schedule(full.prefixes, full.suffixes, full.repeats, full.contenders)
        for c in s.contenders
    )
    assert all(
        LAYERKV_DIRECT not in s.contenders
        for s in schedule(quick.prefixes, quick.suffixes, quick.repeats, quick.contenders)
    )


def test_prefix_suffix_and_repeats_replace_the_modes_grid(tmp_path: Path) -> None:
    options = BenchOptions(
        quick=True, out_dir=tmp_path, serving_prefixes=(512,), serving_suffixes=(512, 64), serving_repeats=5
    )
    grid = Grid.for_options(options)
    assert (grid.prefixes, grid.suffixes, grid.repeats) == ((512,), (512, 64), 5)
    assert grid.contenders == Grid.for_options(BenchOptions(quick=True, out_dir=tmp_path)).contenders  # the mode's
    assert len(schedule(grid.prefixes, grid.suffixes, grid.repeats, grid.contenders)) == 10
    with pytest.raises(ValueError, match="--prefix 500: a prefix must be whole 32-token blocks"):
        Grid.for_options(BenchOptions(quick=True, out_dir=tmp_path, serving_prefixes=(500,)))


def test_serving_is_opt_in_and_checks_the_engine_python(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "serving" in OPT_IN_SUITES and "serving" not in SUITES
    assert (
        main(
            [
                "bench",
                "serving",
                "--no-progress",
                "--engine-python",
                str(tmp_path / "no-python"),
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--engine-python" in err and "no-python" in err and "make test-env" in err


@pytest.mark.parametrize("flag", ["--prefix=0", "--suffix=-32", "--repeats=x"])
def test_grid_flags_refuse_what_is_not_a_positive_count(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "serving", flag, "--out", str(tmp_path)])
    assert flag.split("=")[0] in capsys.readouterr().err


class _Engine:
    """What `measure` calls on an engine, recorded; every reply a one-token output."""

    def __init__(self, name: str, calls: list[tuple[str, int, bool]]) -> None:
        self.name, self.calls = name, calls

    def generate(self, prompts: list[list[int]], *, reset_prefix_cache: bool = False, commit: bool = False) -> dict:
        self.calls.append((self.name, len(prompts[0]), reset_prefix_cache))
        return {
            "wall_ms": float(len(self.calls)),
            "outputs": [{"num_cached_tokens": 0, "token_ids": [1], "logprobs": ["0x0p+0"], "first_token_ms": None}],
        }


class _Reader:
    def layerkv_keys(self) -> set[str]:
        return set()

    def read_whole_ms(self, keys: list[str]) -> tuple[float, int]:
        return 1.0, 0


def test_every_timed_run_follows_the_same_work_in_its_engine() -> None:
    """Recompute and pool runs: the same request just before (cache reset both times), the second
    timed; the ceiling: the prefix's own forward just before; producers' references run once."""
    from layerkv.bench.serving.report import Step
    from layerkv.bench.serving.suite import ENGINE_OF, measure

    calls: list[tuple[str, int, bool]] = []
    rig = type("Rig", (), {})()
    rig.engines = {
        n: _Engine(n, calls) for n in ("plain", "layerkv-producer", "layerkv", "mooncake-producer", "mooncake")
    }
    rig.reader, rig.prefix_keys = _Reader(), {}
    contenders = (RECOMPUTE, CEILING, LAYERKV, MOONCAKE)
    runs = measure(rig, Step((512, 64), 0, contenders))
    timed = {r.contender: r.ttft_ms for r in runs if not r.reference and r.contender in contenders}
    for contender in (RECOMPUTE, LAYERKV, MOONCAKE):
        k = int(timed[contender]) - 1  # the timed call's index
        assert calls[k] == calls[k - 1] == (ENGINE_OF[contender], 576, True)
    k = int(timed[CEILING]) - 1
    assert calls[k - 1] == ("plain", 512, True) and calls[k] == ("plain", 576, False)
    assert sum(c == ("layerkv-producer", 576, False) for c in calls) == 1  # its reference: once, cold

from __future__ import annotations

from layerkv.cli import main
from layerkv.demos.datapath import format_report, run_datapath_demo
from layerkv.store.checked import CheckedStore
from layerkv.store.embedded import EmbeddedStore


def test_datapath_demo_round_trips_every_layer() -> None:
    store = CheckedStore(EmbeddedStore(64 << 20), max_batch_keys=8)
    report = run_datapath_demo(store, num_blocks=12, num_layers=3, block_size=4, heads=2, head_dim=8)
    assert report.identical
    assert [t.layer_idx for t in report.layers] == [0, 1, 2]
    # layer 0 carries the header range in addition to K and V
    assert [t.ranges for t in report.layers] == [36, 24, 24]
    assert store.stats()["batch_get_into_multi_buffer_ranges"].calls == 3 * 2  # 12 keys in chunks of 8
    assert format_report(report).endswith("verified: 12 blocks x 3 layers identical")
    assert store.batch_is_exist(["nothing"]) == [0]


def test_demo_command_prints_verified_line(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["demo", "--synthetic"]) == 0
    assert "verified: 32 blocks x 8 layers identical" in capsys.readouterr().out


def test_cli_prints_setup_errors_without_a_traceback(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", "/nonexistent/mooncake.json")
    assert main(["demo", "--store", "mooncake"]) == 2
    err = capsys.readouterr().err
    assert "layerkv demo: mooncake_config_path='/nonexistent/mooncake.json'" in err
    assert "Traceback" not in err


def test_demo_rejects_a_bad_read_layers_per_range(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["demo", "--read-layers-per-range", "0"]) == 2
    assert "read_layers_per_range=0 must be" in capsys.readouterr().err

from __future__ import annotations

import pickle

import pytest

from layerkv.config import LayerKVConfig
from layerkv.errors import ConfigError


def test_defaults_work_and_are_frozen() -> None:
    config = LayerKVConfig.from_dict({}, env={})
    assert (config.backend, config.prefetch_layers, config.max_transfer_blocks) == ("embedded", 2, 64)
    assert config.max_transfer_bytes == 16 << 20
    assert config.read_layers_per_range == 1
    assert LayerKVConfig.from_dict({"read_layers_per_range": 64}, env={}).read_layers_per_range == 64
    with pytest.raises(AttributeError):
        config.prefetch_layers = 3  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(config)) == config


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"prefetch_layer": 2}, r"unknown layerkv config key\(s\) 'prefetch_layer'"),
        ({"prefetch_layers": 0}, r"prefetch_layers=0 must be 1 <= value <= 64"),
        ({"prefetch_layers": "2"}, r"prefetch_layers='2' must be of type int, not str"),
        ({"prefetch_layers": True}, r"prefetch_layers=True must be of type int, not bool"),
        ({"read_layers_per_range": 0}, r"read_layers_per_range=0 must be 1 <= value <= 64; default is 1"),
        ({"read_layers_per_range": 65}, r"read_layers_per_range=65 must be 1 <= value <= 64"),
        ({"read_layers_per_range": 2.0}, r"read_layers_per_range=2.0 must be of type int, not float"),
        ({"max_transfer_bytes": 0}, r"max_transfer_bytes=0 must be 4096 <= value .*default is 16 MiB"),
        ({"max_transfer_blocks": -1}, r"max_transfer_blocks=-1 must be"),
        ({"backend": "redis"}, r"backend='redis' must be one of embedded, mooncake"),
        ({"tenant": "a@b"}, r"tenant='a@b' must be a non-empty string without '@'"),
        ({"mooncake_master": "localhost"}, r"mooncake_master='localhost' must be host:port"),
        ({"load_timeout_s": 0}, r"load_timeout_s=0 must be 0 < value"),
    ],
)
def test_bad_values_name_the_key(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LayerKVConfig.from_dict(extra, env={})


def test_environment() -> None:
    env = {"MOONCAKE_CONFIG_PATH": "/etc/mc.json", "MOONCAKE_MASTER": "127.0.0.1:5000", "LAYERKV_RANGE_DEBUG": "1"}
    config = LayerKVConfig.from_dict({}, env=env)
    assert config.mooncake_config_path == "/etc/mc.json"
    assert config.mooncake_master == "127.0.0.1:5000"
    assert config.range_debug is True
    # the engine's explicit extra config wins over the environment
    assert LayerKVConfig.from_dict({"mooncake_master": "127.0.0.1:6000"}, env=env).mooncake_master == "127.0.0.1:6000"
    assert LayerKVConfig.from_dict({}, env={"LAYERKV_RANGE_DEBUG": "0"}).range_debug is False


@pytest.mark.parametrize("value", ["", "2", "true", "yes", " 1", "1 "])
def test_range_debug_accepts_exactly_0_or_1(value: str) -> None:
    with pytest.raises(ConfigError, match=r"LAYERKV_RANGE_DEBUG=.* must be exactly '0' or '1'"):
        LayerKVConfig.from_dict({}, env={"LAYERKV_RANGE_DEBUG": value})


def test_replace_validates() -> None:
    config = LayerKVConfig.from_dict({}, env={})
    assert config.replace(prefetch_layers=4).prefetch_layers == 4
    with pytest.raises(ConfigError, match="prefetch_layers=99"):
        config.replace(prefetch_layers=99)

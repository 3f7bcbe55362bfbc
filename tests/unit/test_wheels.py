"""Which Mooncake wheel layerkv asks for, and the startup check of a device cache's data path
(store/wheels.py): the installed distributions are faked through importlib.metadata."""

from __future__ import annotations

import importlib.metadata

import pytest

from layerkv.errors import ConfigError
from layerkv.store import wheels


@pytest.fixture
def installed(monkeypatch):
    """`installed(name=version, ...)`: the Mooncake distributions importlib.metadata reports."""

    def fake(**dists: str) -> None:
        names = {k.replace("_", "-"): v for k, v in dists.items()}

        def version(name: str) -> str:
            if name in names:
                return names[name]
            raise importlib.metadata.PackageNotFoundError(name)

        monkeypatch.setattr(importlib.metadata, "version", version)

    return fake


@pytest.mark.parametrize(
    ("cuda", "extra"),
    [(None, "mooncake"), ("12.8", "mooncake-cuda12"), ("13.0", "mooncake-cuda13"), ("12", "mooncake-cuda12")],
)
def test_the_wheel_matches_the_torch_build(cuda, extra) -> None:
    assert wheels.wheel_for(cuda).extra == extra
    hint = wheels.install_hint(cuda, detect=False)
    assert hint.startswith(f"pip install '{wheels.wheel_for(cuda).distribution}==0.3.13.post1'")
    assert hint.endswith(f"pip install '.[{extra}]')")


def test_this_machines_cpu_torch_gets_the_host_only_wheel() -> None:
    assert wheels.torch_cuda() is None  # the CPU wheel of this machine
    assert "mooncake-transfer-engine-non-cuda" in wheels.install_hint()


def test_several_mooncake_wheels_are_named_as_a_clash(installed) -> None:
    installed(mooncake_transfer_engine_non_cuda="0.3.13.post1")
    assert wheels.clash() is None
    installed(mooncake_transfer_engine_non_cuda="0.3.13.post1", mooncake_transfer_engine_cuda13="0.3.14")
    message = wheels.clash()
    assert message is not None and "mooncake-transfer-engine-non-cuda 0.3.13.post1" in message
    assert "mooncake-transfer-engine-cuda13 0.3.14" in message


def test_a_cuda_cache_registered_with_the_host_only_wheel_is_refused_with_the_fix(installed) -> None:
    installed(mooncake_transfer_engine_non_cuda="0.3.13.post1")
    with pytest.raises(ConfigError) as err:
        wheels.check_device_path("cuda", register_kv_cache=True)
    message = str(err.value)
    assert "the KV caches live on cuda" in message
    hint = (
        "pip install 'mooncake-transfer-engine==0.3.13.post1' ("
        "from a layerkv checkout: pip install '.[mooncake-cuda12]')"
    )
    assert hint in message
    assert "Set register_kv_cache: false" in message
    installed(mooncake_transfer_engine_cuda13="0.3.13.post1")  # even a CUDA wheel: staging is where KV is verified
    with pytest.raises(ConfigError, match=r"the installed mooncake-transfer-engine-cuda13 could register it"):
        wheels.check_device_path("cuda", register_kv_cache=True)


def test_staging_and_host_caches_pass_with_any_wheel(installed) -> None:
    installed(mooncake_transfer_engine_non_cuda="0.3.13.post1")
    wheels.check_device_path("cuda", register_kv_cache=False)  # device KV through host staging: any wheel
    wheels.check_device_path("cpu", register_kv_cache=True)


def test_the_version_check_knows_every_wheel(installed) -> None:
    from layerkv.store import mooncake

    for dist in wheels.DISTRIBUTIONS:
        installed(**{dist.replace("-", "_"): "0.3.13.post1"})
        assert mooncake.installed_version() == "0.3.13.post1"
    installed()
    assert mooncake.installed_version() is None


def test_the_hinted_version_is_the_one_the_extras_pin() -> None:
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    pins = {w.extra: f"{w.distribution}=={wheels.VERSION}" for w in wheels.WHEELS}
    assert {extra: extras["optional-dependencies"][extra] for extra in pins} == {e: [p] for e, p in pins.items()}

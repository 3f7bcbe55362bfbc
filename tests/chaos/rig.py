"""The test side of a chaos round: a `Rig` owns a fresh mooncake_master (killed, stopped,
restarted by the round), the segment holder process, a probe client, the round's engines
(agent processes, processes.py, and in-process engines, `InProc`) and the checks every round
ends with. `Rig.close()` ends every process it started, also when the round failed. Test code
only; the test's thread drives it.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import queue
import random
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from layerkv.engine import EngineConfig, ModelConfig
from layerkv.store.mooncake_master import MIN_SEGMENT_BYTES, MasterPorts
from tests.chaos.engines import ENGINE, LAYERKV, MODEL, ChaosEngine, LocalOracle
from tests.chaos.processes import Agent, ChaosMaster, Holder, Output
from tests.store_probes import processing_keys

log = logging.getLogger(__name__)


class InProc:
    """An engine in the test process, with the Agent's serving interface."""

    def __init__(
        self,
        name: str,
        mooncake_config: dict[str, Any],
        layerkv: dict[str, Any],
        model_id: str,
        model: ModelConfig,
        engine: EngineConfig,
    ) -> None:
        self.name = name
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.chaos = ChaosEngine(
            mooncake_config, layerkv, announce=self.events.put, model_id=model_id, model=model, engine=engine
        )
        self._threads: list[threading.Thread] = []

    def serve(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Output]:
        return self.chaos.serve(prompts, max_tokens)

    def serve_later(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> threading.Thread:
        box: list[list[Output]] = []
        thread = threading.Thread(
            target=lambda: box.append(self.serve(prompts, max_tokens)), name=f"chaos-{self.name}-serve", daemon=True
        )
        thread.box = box  # type: ignore[attr-defined]
        thread.start()
        self._threads.append(thread)
        return thread

    @staticmethod
    def outputs(thread: threading.Thread, timeout_s: float = 120.0) -> list[Output]:
        thread.join(timeout_s)
        assert not thread.is_alive(), f"{thread.name} still serving after {timeout_s:.0f} s"
        return thread.box[0]  # type: ignore[attr-defined]

    def status(self) -> dict[str, Any]:
        return self.chaos.status()

    def wait_store_up(self, timeout_s: float) -> None:
        assert self.chaos.wait_store_up(timeout_s), f"{self.name}: the store did not answer within {timeout_s:.0f} s"

    def close(self) -> None:
        self.chaos.gate.open()
        for thread in self._threads:
            thread.join(60)
        self.chaos.close()


class Rig:
    """One round's deployment: a fresh master, the segment holder, a probe client, engines."""

    def __init__(
        self,
        name: str,
        seed: int,
        tmp: Path,
        oracle: LocalOracle,
        *,
        lease_ttl_ms: int | None = None,
        segment_bytes: int = MIN_SEGMENT_BYTES,
        master_args: Sequence[str] = (),
        model: ModelConfig = MODEL,
        engine: EngineConfig = ENGINE,
    ) -> None:
        from tests.mooncake_master import connect_store

        self.name = name
        self.seed = seed
        self.rng = random.Random(f"{seed}:{name}")
        self.tmp = tmp
        self.oracle = oracle
        self.model_id = f"chaos/{name}/{seed}"
        self.model, self.engine = model, engine
        self.block_size = engine.block_size
        self.engines: list[Agent | InProc] = []
        self.outputs: list[tuple[str, Output]] = []  # (engine name, output) of every request checked
        self.master = ChaosMaster(MasterPorts.pick(), lease_ttl_ms, tmp / "master.log", extra_args=tuple(master_args))
        self.holder: Holder | None = None
        self.probe: Any = None
        try:
            self.master.start()
            self.holder = Holder(self.master, segment_bytes, tmp)
            self.probe = connect_store(self.master, 0)
        except BaseException:
            self.close()
            raise

    # ---- engines -----------------------------------------------------------------------------
    def agent(self, name: str, env: dict[str, str] | None = None, **layerkv: Any) -> Agent:
        job = {
            "mooncake": self.master.config(global_segment_size=0),
            "layerkv": {**LAYERKV, **layerkv},
            "model_id": self.model_id,
            "model": dataclasses.asdict(self.model),
            "engine": dataclasses.asdict(self.engine),
        }
        agent = Agent(name, job, self.tmp, env)
        self.engines.append(agent)
        return agent

    def inproc(self, name: str, **layerkv: Any) -> InProc:
        engine = InProc(
            name,
            self.master.config(global_segment_size=0),
            {**LAYERKV, **layerkv},
            self.model_id,
            self.model,
            self.engine,
        )
        self.engines.append(engine)
        return engine

    def forget(self, engine: Agent | InProc) -> None:
        """An engine that was killed: no status, no leak check of its own."""
        self.engines.remove(engine)

    # ---- prompts ---------------------------------------------------------------------------
    def prefix(self, num_blocks: int) -> list[int]:
        return [self.rng.randrange(256) for _ in range(num_blocks * self.block_size)]

    def prompt(self, prefix: Sequence[int], extra_blocks: int = 0) -> list[int]:
        """`prefix`, `extra_blocks` more full blocks and a tail shorter than a block (never
        block-aligned: a full hit would compute only the last token, a chunk local compute has not)."""
        tail = self.rng.randrange(1, self.block_size)
        return [*prefix, *(self.rng.randrange(256) for _ in range(extra_blocks * self.block_size + tail))]

    # ---- the master ------------------------------------------------------------------------
    def kill_master(self) -> None:
        self.master.kill()

    def start_master(self, timeout_s: float = 30.0) -> float:
        """Start the master again on its ports; wait until the holder's segment is mounted on
        it (a probe put start succeeds). Returns the seconds that took."""
        start = time.monotonic()
        self.master.start()
        key = f"chaos-probe-{self.seed}"
        deadline = time.monotonic() + timeout_s
        while self.probe.batch_put_session_start([key], [4096]) != [0]:
            assert time.monotonic() < deadline, f"the holder's segment was not mounted within {timeout_s:.0f} s"
            time.sleep(0.1)  # polling the external master; nothing to wait on
        self.probe.batch_put_session_revoke([key])
        return time.monotonic() - start

    # ---- checks ----------------------------------------------------------------------------
    def check(self, engine: Agent | InProc, outputs: Sequence[Output], bound_s: float) -> None:
        """Every output equals local compute bit for bit and took at most `bound_s`."""
        for i, out in enumerate(outputs):
            where = f"round {self.name} seed {self.seed}: {engine.name} request {i}"
            assert out["error"] is None, f"{where} failed: {out['error']}"
            want = self.oracle.output(out["prompt"], out["max_tokens"])
            assert out["tokens"] == want["tokens"], f"{where}: tokens {out['tokens']} != local {want['tokens']}"
            if out["logits"] != want["logits"]:
                got, ref = (np.frombuffer(base64.b64decode(x["logits"]), dtype=np.float32) for x in (out, want))
                raise AssertionError(
                    f"{where}: logits differ from local compute (max abs {np.abs(got - ref).max():.3g})"
                )
            assert out["wall_s"] <= bound_s, f"{where} took {out['wall_s']:.2f} s > bound {bound_s:.1f} s"
            self.outputs.append((engine.name, out))

    def check_no_leaks(self, ignore: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
        """Every live engine idle (no put waiting for a verdict, no job running, no staging slot
        lent) and no key any of them put-started is PROCESSING (but `ignore`). Returns each
        engine's status."""
        statuses = {engine.name: engine.status() for engine in self.engines}
        where = f"round {self.name} seed {self.seed}"
        for name, status in statuses.items():
            assert not status["has_work"], f"{where}: {name} still has work"
            assert all(idle is not False for idle in status["idle"]), (
                f"{where}: {name} sessions left: {status['open_sessions']}"
            )
            lent = [b for b in status["staging_bytes_in_use"] if b]
            assert not lent, f"{where}: {name} staging bytes still lent to jobs: {status['staging_bytes_in_use']}"
        keys = sorted({k for s in statuses.values() for k in s["put_keys"]} - set(ignore))
        stuck = processing_keys(self.probe, keys)
        assert not stuck, f"{where}: {len(stuck)} objects left PROCESSING: {stuck[:3]}"
        return statuses

    def summary(self) -> str:
        walls = [o["wall_s"] for _, o in self.outputs]
        return (
            f"chaos round {self.name} seed {self.seed}: {len(walls)} requests equal to local compute, "
            f"max {max(walls, default=0):.2f} s, {sum(o['external'] for _, o in self.outputs)} tokens from the pool"
        )

    def close(self) -> None:
        """Stop every engine, the probe, the holder and the master, whatever state they are in."""
        errors: list[str] = []
        self.master.signal(signal.SIGCONT)  # a stopped master or holder would hang every goodbye
        if self.holder is not None:
            self.holder.signal(signal.SIGCONT)

        def close(engine: Agent | InProc) -> None:
            try:
                engine.close()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                errors.append(f"{engine.name}: {exc!r}")

        closing = [threading.Thread(target=close, args=(e,), name=f"chaos-close-{e.name}") for e in self.engines]
        for thread in closing:  # each takes 1-2 s (Mooncake clients say goodbye to the master)
            thread.start()
        for thread in closing:
            thread.join(90)
        if self.probe is not None:
            try:
                self.probe.close()
            except Exception as exc:  # noqa: BLE001
                errors.append(f"probe: {exc!r}")
        if self.holder is not None:  # nothing to say goodbye to: the master goes next
            self.holder.kill()
        self.master.kill()
        if errors:
            log.warning("chaos: closing round %s: %s", self.name, "; ".join(errors))

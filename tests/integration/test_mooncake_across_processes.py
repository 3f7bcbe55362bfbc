"""Two processes, two Mooncake clients, one master: a writer puts objects layer by layer, a
reader gets them layer by layer; bytes identical. A racing put start on a held / committed key
gets -705."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import layerkv
from layerkv.store.base import Code
from layerkv.store.mooncake_master import MasterProcess
from tests.integration.mooncake_peer import layer_entries, object_bytes

pytestmark = pytest.mark.mooncake

PEER_SCRIPT = Path(__file__).with_name("mooncake_peer.py")
REPO_ROOT = Path(__file__).resolve().parents[2]

HEADER_NBYTES, ENTRY_NBYTES, NUM_LAYERS = 128, [2048, 1024], 6
OBJECT_NBYTES = HEADER_NBYTES + NUM_LAYERS * sum(ENTRY_NBYTES)


class PeerProcess:
    """A mooncake_peer.py child; `call` sends one request and waits (with a timeout) for its answer."""

    def __init__(self, config_path: Path, name: str) -> None:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(Path(layerkv.__file__).parents[1]), str(REPO_ROOT)]),
            MC_TCP_BIND_ADDRESS="127.0.0.1",
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), str(config_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, name=f"layerkv-test-peer-{name}", daemon=True)
        self.reader.start()
        assert self.wait_answer(timeout_s=30.0) == {"ready": True}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.answers.put(json.loads(line[2:]))
        self.answers.put(None)  # EOF: the peer exited

    def wait_answer(self, timeout_s: float) -> dict[str, Any]:
        answer = self.answers.get(timeout=timeout_s)
        assert answer is not None, f"peer exited with {self.proc.poll()}"
        return answer

    def call(self, op: str, timeout_s: float = 30.0, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self.wait_answer(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.reader.join(timeout=5)


def test_layerwise_write_in_one_process_read_in_another(mooncake_master: MasterProcess, tmp_path: Path) -> None:
    config_path = tmp_path / "mooncake.json"
    config_path.write_text(json.dumps(mooncake_master.config(global_segment_size="32MB")))
    keys = [f"test@xproc-{time.monotonic_ns()}-{i}@0" for i in range(3)]
    layout = {
        "nbytes": OBJECT_NBYTES,
        "header_nbytes": HEADER_NBYTES,
        "entry_nbytes": ENTRY_NBYTES,
        "num_layers": NUM_LAYERS,
        "seed": 100,
    }
    writer, reader = PeerProcess(config_path, "writer"), PeerProcess(config_path, "reader")
    try:
        assert writer.call("put_start", keys=keys, nbytes=OBJECT_NBYTES)["codes"] == [0, 0, 0]
        # While the writer holds the sessions: another client can neither claim nor read them.
        assert reader.call("put_start", keys=keys[:1], nbytes=OBJECT_NBYTES)["codes"] == [Code.OBJECT_EXISTS]
        assert reader.call("get_start", keys=keys[:1])["codes"] == [Code.REPLICA_NOT_READY]
        answer = writer.call("put_layers", keys=keys, **layout)
        assert answer["codes"] == [[sum(ENTRY_NBYTES)] * 3] * NUM_LAYERS
        assert writer.call("put_end", keys=keys)["codes"] == [0, 0, 0]
        assert reader.call("put_start", keys=keys[:1], nbytes=OBJECT_NBYTES)["codes"] == [Code.OBJECT_EXISTS]
        answer = reader.call("read", keys=keys, out_dir=str(tmp_path), **layout)
        assert (answer["start"], answer["end"]) == ([0, 0, 0], 0)
        assert answer["codes"] == [[sum(ENTRY_NBYTES)] * 3] * NUM_LAYERS
        for i in range(len(keys)):
            got = np.frombuffer((tmp_path / f"{i}.bin").read_bytes(), np.uint8)
            want = object_bytes(100 + i, OBJECT_NBYTES)
            for layer_idx in range(NUM_LAYERS):
                for offset, nbytes in layer_entries(HEADER_NBYTES, ENTRY_NBYTES, layer_idx):
                    assert np.array_equal(got[offset : offset + nbytes], want[offset : offset + nbytes]), (i, layer_idx)
            assert not got[:HEADER_NBYTES].any()  # the header range was never written or read
        assert writer.call("remove", keys=keys)["codes"] == [0, 0, 0]
    finally:
        writer.close()
        reader.close()
    assert (writer.proc.returncode, reader.proc.returncode) == (0, 0)

"""A Mooncake client in its own process, driven by JSON lines on stdin (tests only).

Usage: python mooncake_peer.py <mooncake-config.json>. Each request line is one JSON object
with "op"; each answer is one stdout line "@@" + JSON. Objects are laid out as layerkv lays them
out: [header][layer 0: K, V][layer 1: K, V]...; a key's bytes come from a seeded generator so
any process can recompute them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from layerkv.store.mooncake import MooncakeStore
from layerkv.store.mooncake_config import load_mooncake_config


def object_bytes(seed: int, nbytes: int) -> np.ndarray:
    """The reference content of object number `seed`: [nbytes] uint8."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def layer_entries(header_nbytes: int, entry_nbytes: list[int], layer_idx: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of each entry of `layer_idx` inside the object."""
    offset = header_nbytes + layer_idx * sum(entry_nbytes)
    out = []
    for nbytes in entry_nbytes:
        out.append((offset, nbytes))
        offset += nbytes
    return out


class Peer:
    def __init__(self, store: MooncakeStore) -> None:
        self.store = store
        self.buffers: dict[str, np.ndarray] = {}  # key -> registered object image

    def buffer(self, key: str, nbytes: int, seed: int | None) -> np.ndarray:
        if key not in self.buffers:
            array = object_bytes(seed, nbytes) if seed is not None else np.zeros(nbytes, np.uint8)
            self.store.register_buffer(array.ctypes.data, array.nbytes)
            self.buffers[key] = array
        return self.buffers[key]

    def ranges(
        self, req: dict[str, Any], layer_idx: int, seeded: bool
    ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        entries = layer_entries(req["header_nbytes"], req["entry_nbytes"], layer_idx)
        ptrs, sizes, offsets = [], [], []
        for i, key in enumerate(req["keys"]):
            base = self.buffer(key, req["nbytes"], req["seed"] + i if seeded else None).ctypes.data
            ptrs.append([base + off for off, _ in entries])
            sizes.append([n for _, n in entries])
            offsets.append([off for off, _ in entries])
        return ptrs, sizes, offsets

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op, keys = req["op"], req.get("keys", [])
        if op == "put_start":
            return {"codes": self.store.batch_put_session_start(keys, [req["nbytes"]] * len(keys))}
        if op == "put_layers":
            codes = [
                self.store.batch_put_from_multi_buffer_ranges(keys, *self.ranges(req, layer_idx, True))
                for layer_idx in range(req["num_layers"])
            ]
            return {"codes": codes}
        if op == "put_end":
            return {"codes": self.store.batch_put_session_end(keys)}
        if op == "get_start":
            return {"codes": self.store.batch_get_session_start(keys)}
        if op == "read":
            start = self.store.batch_get_session_start(keys)
            codes = [
                self.store.batch_get_into_multi_buffer_ranges(keys, *self.ranges(req, layer_idx, False))
                for layer_idx in range(req["num_layers"])
            ]
            end = self.store.batch_get_session_end(keys)
            for i, key in enumerate(keys):
                Path(req["out_dir"], f"{i}.bin").write_bytes(self.buffers[key].tobytes())
            return {"start": start, "codes": codes, "end": end}
        if op == "remove":
            return {"codes": self.store.batch_remove(keys)}
        raise ValueError(f"unknown op {op!r}")


def main(config_path: str) -> int:
    store = MooncakeStore.from_mooncake_config(load_mooncake_config(config_path))
    peer = Peer(store)
    print("@@" + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        print("@@" + json.dumps(peer.handle(req)), flush=True)
    for array in peer.buffers.values():
        store.unregister_buffer(array.ctypes.data)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

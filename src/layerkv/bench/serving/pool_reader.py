"""Suite `serving`'s transfer alone: this process, with a bare Mooncake client, lists layerkv's
objects in the pool (the master's `/get_all_keys`) and reads a prefix's objects whole into its
own registered memory, no compute beside it: the bound any pool's TTFT is measured against.
Driver thread only.
"""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

import numpy as np

LAYERKV_KEY = re.compile(r"[^@]+@[0-9a-f]{16,}@[0-9]+")  # keys.block_keys: namespace @ block hash @ storage rank


class PoolReader:
    def __init__(self, metrics_url: str, client_config: dict[str, Any], object_bytes: int) -> None:
        """`object_bytes`: at least one object's size (a read buffer per key)."""
        self._metrics_url, self._client_config, self._object_bytes = metrics_url, client_config, object_bytes
        self._client: Any = None  # MooncakeStore, made on first read
        self._buffer: np.ndarray | None = None

    def layerkv_keys(self) -> set[str]:
        """layerkv's object keys in the pool; MooncakeStoreConnector's keys have another shape."""
        with urllib.request.urlopen(self._metrics_url + "/get_all_keys", timeout=30) as answer:
            lines = answer.read().decode().splitlines()
        return {k for k in lines if LAYERKV_KEY.fullmatch(k)}

    def read_whole_ms(self, keys: list[str]) -> tuple[float, int]:
        """(ms, objects read) for one whole-object batch read of `keys`."""
        from layerkv.store.mooncake import MooncakeStore

        if self._client is None:
            self._client = MooncakeStore.from_mooncake_config(self._client_config)
        need = self._object_bytes * len(keys)
        if self._buffer is None or self._buffer.nbytes < need:
            if self._buffer is not None:
                self._client.unregister_buffer(self._buffer.ctypes.data)
            self._buffer = np.ones(need, dtype=np.uint8)  # pages mapped before the timed read
            self._client.register_buffer(self._buffer.ctypes.data, need)
        base = self._buffer.ctypes.data
        start = time.perf_counter()
        got = self._client.batch_get_into(
            keys, [base + i * self._object_bytes for i in range(len(keys))], [self._object_bytes] * len(keys)
        )
        elapsed_ms = (time.perf_counter() - start) * 1e3
        return elapsed_ms, sum(1 for n in got if isinstance(n, int) and n > 0)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

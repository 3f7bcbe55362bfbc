"""`layerkv doctor`: probe a Mooncake deployment for everything layerkv relies on.

Checks version and methods, connects, names the master it reached (for a local master the pid
serving its RPC and metadata ports; two different pids fail), runs put/get session round trips with per-layer ranges on
probe keys (bytes compared), the result-code conventions, whole-object vs ranged throughput, and
removes its probe keys. One line per check; exit status 1 on any failure. Main thread only.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from layerkv.commands import add_mooncake_log_flag
from layerkv.commands.check_result import CheckResult
from layerkv.config import LayerKVConfig
from layerkv.errors import LayerKVError
from layerkv.store import port_owner
from layerkv.store.base import Code, code_name

HEADER_NBYTES = 4096
NUM_LAYERS = 8
ENTRY_NBYTES = 32 << 10  # K and V per layer
LAYER_NBYTES = 2 * ENTRY_NBYTES
OBJECT_NBYTES = HEADER_NBYTES + NUM_LAYERS * LAYER_NBYTES  # 516 KiB
NUM_KEYS = 4  # probe round trip; throughput writes 2 * NUM_KEYS more objects (~2 MiB per call)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="probe a Mooncake deployment (methods, sessions, codes, throughput)",
        description="Probe the Mooncake deployment in a Mooncake JSON config and report PASS/FAIL per check.",
    )
    parser.add_argument("--config", default=None, help="Mooncake JSON config (default: $MOONCAKE_CONFIG_PATH)")
    parser.add_argument(
        "--device",
        default=None,
        metavar="DEVICE",
        help="only a KV round trip with the caches on DEVICE (cpu, cuda, cuda:N) through layerkv's "
        "data path, on the --config deployment or an embedded store",
    )
    add_mooncake_log_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.device is not None:
        from layerkv.commands.doctor_device import check_device

        result = _report(check_device(args.device, args.config))
        return 0 if result.ok else 1
    path = args.config or os.environ.get("MOONCAKE_CONFIG_PATH")
    if not path:
        print("FAIL  config                 no --config given and MOONCAKE_CONFIG_PATH is unset", flush=True)
        return 2
    from layerkv.store import native_log

    native_log.configure(args.mooncake_log)
    results = list(_run_checks(path))
    failed = [r for r in results if not r.ok]
    print(f"layerkv doctor: {len(results) - len(failed)} passed, {len(failed)} failed ({path})", flush=True)
    return 1 if failed else 0


def _run_checks(path: str) -> Any:
    from layerkv.store import mooncake  # imports mooncake lazily

    for result in (_check_version(mooncake), _check_methods(mooncake)):
        print(result.line(), flush=True)
        yield result
    began = time.monotonic()
    try:
        config = LayerKVConfig.from_dict({"backend": "mooncake", "mooncake_config_path": path})
        store = mooncake.MooncakeStore.from_config(config)
    except LayerKVError as exc:
        result = CheckResult("connect", False, str(exc))
        print(result.line(), flush=True)
        yield result
        return
    yield _report(CheckResult("connect", True, f"master {store.master_address} in {time.monotonic() - began:.2f} s"))
    yield _report(check_master(store.master_address, _metadata_url(path)))
    probe = Probe(store)
    try:
        for check in (probe.put_session, probe.get_session, probe.codes, probe.throughput):
            yield _report(_guarded(check))
    finally:
        yield _report(_guarded(probe.cleanup))
        probe.close()


def check_master(master_address: str, metadata_url: str | None) -> CheckResult:
    """Which master this config reaches: for a master on this host, the pid listening on its RPC
    port and on the HTTP metadata port; FAIL if those are two processes (a config that mixes two
    deployments, e.g. a second `layerkv master` whose own master died)."""
    host, _, port = master_address.rpartition(":")
    if not _is_local(host):
        return CheckResult("master", True, f"{master_address} (remote: its pid is not visible from this host)")
    if not port_owner.supported():
        return CheckResult("master", True, f"{master_address} (local; no /proc to name its pid)")
    rpc = _serving_pids(int(port))
    detail = f"{master_address} served by {_holders(int(port))}"
    url = urlsplit(metadata_url or "")
    if url.scheme != "http" or not url.hostname or not _is_local(url.hostname):
        return CheckResult("master", bool(rpc), detail + (f"; metadata {metadata_url}" if metadata_url else ""))
    http = _serving_pids(url.port or 80)
    if rpc and http and rpc != http:
        return CheckResult(
            "master",
            False,
            f"{detail}, but metadata {metadata_url} by {_holders(url.port or 80)}: "
            "two processes, so this config mixes two deployments; use the config printed by the "
            "`layerkv master` that owns both ports",
        )
    same = "the same process" if rpc and rpc == http else _holders(url.port or 80)
    return CheckResult("master", bool(rpc), f"{detail}; metadata {metadata_url} by {same}")


def _is_local(host: str) -> bool:
    """True if `host` is an address of this machine (a socket can bind to it)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host.strip("[]"), 0))
    except OSError:
        return False
    return True


def _serving_pids(port: int) -> set[int]:
    return {listener.pid for listener in port_owner.listeners(port) if listener.pid is not None}


def _holders(port: int) -> str:
    found = port_owner.listeners(port)
    if not found:
        return "no process (nothing listens there now)"
    return ", ".join(sorted({listener.holder() for listener in found}))


def _metadata_url(path: str) -> str | None:
    from layerkv.store.mooncake_config import load_mooncake_config

    value = load_mooncake_config(path).get("metadata_server")
    return str(value) if value else None


def _report(result: CheckResult) -> CheckResult:
    print(result.line(), flush=True)
    return result


def _guarded(check: Callable[[], CheckResult]) -> CheckResult:
    name = check.__name__.replace("_", " ")
    try:
        return check()
    except LayerKVError as exc:
        return CheckResult(name, False, f"raised {exc}")


def _check_version(mooncake: Any) -> CheckResult:
    version = mooncake.installed_version()
    try:
        mooncake.check_version(version)
    except LayerKVError as exc:
        return CheckResult("version", False, str(exc))
    return CheckResult("version", version is not None, f"{version} (minimum {mooncake.MIN_VERSION_TEXT})")


def _check_methods(mooncake: Any) -> CheckResult:
    missing = mooncake.missing_session_methods()
    if missing:
        return CheckResult("methods", False, f"missing {', '.join(missing)} (needs >= {mooncake.MIN_VERSION_TEXT})")
    return CheckResult("methods", True, f"all {len(mooncake.SESSION_METHODS)} session/range methods present")


class Probe:
    """Probe objects laid out like layerkv's: [header][layer 0: K, V]...; buffers registered once."""

    def __init__(self, store: Any) -> None:
        self.store = store
        stamp = f"{os.getpid()}-{time.time_ns()}"
        self.keys = [f"layerkv-doctor@{stamp}-{i}@0" for i in range(NUM_KEYS)]
        self.bench_keys = [f"layerkv-doctor@{stamp}-bench-{i}@0" for i in range(2 * NUM_KEYS)]
        total = NUM_KEYS * OBJECT_NBYTES
        self.src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)  # [NUM_KEYS * OBJECT_NBYTES]
        self.dst = np.zeros(total, np.uint8)
        for array in (self.src, self.dst):
            store.register_buffer(array.ctypes.data, array.nbytes)

    def close(self) -> None:
        for array in (self.src, self.dst):
            self.store.unregister_buffer(array.ctypes.data)
        self.store.close()

    def _ranges(self, array: np.ndarray, layer_idx: int, num_keys: int) -> tuple[list[list[int]], ...]:
        offsets = [HEADER_NBYTES + layer_idx * LAYER_NBYTES + e * ENTRY_NBYTES for e in range(2)]
        bases = [array.ctypes.data + i * OBJECT_NBYTES for i in range(num_keys)]
        return ([[b + o for o in offsets] for b in bases], [[ENTRY_NBYTES] * 2] * num_keys, [offsets] * num_keys)

    def _put_layers(self, keys: list[str]) -> list[list[int]]:
        return [
            self.store.batch_put_from_multi_buffer_ranges(keys, *self._ranges(self.src, layer, len(keys)))
            for layer in range(NUM_LAYERS)
        ]

    def _get_layers(self, keys: list[str]) -> list[list[int]]:
        return [
            self.store.batch_get_into_multi_buffer_ranges(keys, *self._ranges(self.dst, layer, len(keys)))
            for layer in range(NUM_LAYERS)
        ]

    def put_session(self) -> CheckResult:
        start = self.store.batch_put_session_start(self.keys, [OBJECT_NBYTES] * NUM_KEYS)
        if start != [0] * NUM_KEYS:
            return CheckResult("put session", False, f"put start returned {_names(start)}")
        per_layer = self._put_layers(self.keys)
        bad = [(layer, codes) for layer, codes in enumerate(per_layer) if codes != [LAYER_NBYTES] * NUM_KEYS]
        if bad:
            self.store.batch_put_session_revoke(self.keys)  # never commit a partly written object
            return CheckResult(
                "put session",
                False,
                f"range writes (want {LAYER_NBYTES} B/key): layer {bad[0][0]} -> {_names(bad[0][1])}",
            )
        end = self.store.batch_put_session_end(self.keys)
        exists = self.store.batch_is_exist(self.keys)
        ok = end == [0] * NUM_KEYS and exists == [1] * NUM_KEYS
        return CheckResult(
            "put session", ok, f"{NUM_KEYS} keys x {NUM_LAYERS} layers, end {_names(end)}, exists {exists}"
        )

    def get_session(self) -> CheckResult:
        start = self.store.batch_get_session_start(self.keys)
        per_layer = self._get_layers(self.keys) if start == [0] * NUM_KEYS else []
        end = self.store.batch_get_session_end(self.keys)
        if start != [0] * NUM_KEYS:
            return CheckResult("get session", False, f"get start returned {_names(start)}")
        bad = [(layer, codes) for layer, codes in enumerate(per_layer) if codes != [LAYER_NBYTES] * NUM_KEYS]
        if bad:
            return CheckResult(
                "get session",
                False,
                f"range reads (want {LAYER_NBYTES} B/key): layer {bad[0][0]} -> {_names(bad[0][1])}",
            )
        payload = np.ones(len(self.src), bool)
        for i in range(NUM_KEYS):
            payload[i * OBJECT_NBYTES : i * OBJECT_NBYTES + HEADER_NBYTES] = False  # headers never written
        same = bool(np.array_equal(self.src[payload], self.dst[payload]))
        return CheckResult(
            "get session", same and end == 0, f"bytes {'identical' if same else 'DIFFER'}, session end {end}"
        )

    def codes(self) -> CheckResult:
        ptr = self.dst.ctypes.data
        wanted = {
            "range overflow": (
                Code.INVALID_PARAMS,
                lambda: self._in_get_session(
                    lambda: self.store.batch_get_into_multi_buffer_ranges(
                        self.keys[:1], [[ptr]], [[4096]], [[OBJECT_NBYTES - 100]]
                    )
                ),
            ),
            "missing key": (
                Code.OBJECT_NOT_FOUND,
                lambda: self.store.batch_get_session_start([self.keys[0] + "-absent"]),
            ),
            "existing key": (
                Code.OBJECT_EXISTS,
                lambda: self.store.batch_put_session_start(self.keys[:1], [OBJECT_NBYTES]),
            ),
        }
        got = {name: fn()[0] for name, (_, fn) in wanted.items()}
        wrong = [f"{n}: {code_name(got[n])} (want {code_name(c)})" for n, (c, _) in wanted.items() if got[n] != c]
        detail = "; ".join(wrong) or ", ".join(f"{n} -> {code_name(c)}" for n, (c, _) in wanted.items())
        return CheckResult("codes", not wrong, detail)

    def _in_get_session(self, fn: Callable[[], list[int]]) -> list[int]:
        self.store.batch_get_session_start(self.keys[:1])
        try:
            return fn()
        finally:
            self.store.batch_get_session_end(self.keys[:1])

    def throughput(self) -> CheckResult:
        whole, ranged = self.bench_keys[:NUM_KEYS], self.bench_keys[NUM_KEYS : 2 * NUM_KEYS]
        nbytes = NUM_KEYS * OBJECT_NBYTES
        ptrs = [self.src.ctypes.data + i * OBJECT_NBYTES for i in range(NUM_KEYS)]
        dptrs = [self.dst.ctypes.data + i * OBJECT_NBYTES for i in range(NUM_KEYS)]
        put_whole = _timed(lambda: self.store.batch_put_from(whole, ptrs, [OBJECT_NBYTES] * NUM_KEYS))
        get_whole = _timed(lambda: self.store.batch_get_into(whole, dptrs, [OBJECT_NBYTES] * NUM_KEYS))
        put_ranged = _timed(lambda: self._ranged_put(ranged))
        get_ranged = _timed(lambda: self._ranged_get(ranged))
        timings = {"whole put": put_whole, "whole get": get_whole, "ranged put": put_ranged, "ranged get": get_ranged}
        failed = [name for name, (ok, _) in timings.items() if not ok]
        rates = ", ".join(f"{name} {nbytes / max(dt, 1e-9) / 1e6:.0f} MB/s" for name, (_, dt) in timings.items())
        return CheckResult(
            "throughput",
            not failed,
            (f"failed: {', '.join(failed)}; " if failed else "") + f"{nbytes / (1 << 20):.1f} MiB each: {rates}",
        )

    def _ranged_put(self, keys: list[str]) -> bool:
        if self.store.batch_put_session_start(keys, [OBJECT_NBYTES] * len(keys)) != [0] * len(keys):
            return False
        if any(c != [LAYER_NBYTES] * len(keys) for c in self._put_layers(keys)):
            self.store.batch_put_session_revoke(keys)
            return False
        return bool(self.store.batch_put_session_end(keys) == [0] * len(keys))

    def _ranged_get(self, keys: list[str]) -> bool:
        start = self.store.batch_get_session_start(keys)
        ok = start == [0] * len(keys) and all(c == [LAYER_NBYTES] * len(keys) for c in self._get_layers(keys))
        return bool(self.store.batch_get_session_end(keys) == 0 and ok)

    def cleanup(self) -> CheckResult:
        keys = self.keys + self.bench_keys
        removed = self.store.batch_remove(keys)
        left = [k for k, e in zip(keys, self.store.batch_is_exist(keys)) if e != 0]
        gone = sum(1 for c in removed if c == 0)
        return CheckResult(
            "cleanup", not left, f"removed {gone} probe keys" + (f"; still present: {left}" if left else "")
        )


def _timed(fn: Callable[[], Any]) -> tuple[bool, float]:
    began = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - began
    ok = result if isinstance(result, bool) else all(c >= 0 for c in result)
    return ok, elapsed


def _names(codes: list[int]) -> str:
    return "[" + ", ".join(code_name(c) if c < 0 else str(c) for c in codes) + "]"

"""The Mooncake Store backend: `MooncakeStore` wraps `mooncake.store.MooncakeDistributedStore`.
The only module that imports `mooncake`, and the one place where its exceptions become
StoreError. Either side may use it; every method is safe from any thread (the Mooncake client
is thread-safe; this wrapper holds only the closed flag and the count of calls inside the client:
`close` never tears the client down under a call still inside it, which can crash the process).

Results are passed back as plain lists, unvalidated: `store/checked.py` validates them.
Master down (observed 0.3.13.post1): every call returns -900, but most after ~4.4 s spent
reconnecting, not at once; callers on a latency path need their own back-off.

The client's config (JSON file, setup arguments, loopback bind, preflight) lives in
store/mooncake_config.py, which also says why a loopback client still listens on every interface.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from layerkv.errors import ConfigError, StoreError, StoreVersionError
from layerkv.store import native_log
from layerkv.store.base import SESSION_METHODS, HitSource, ObjectKey, Placement, PoolScope, code_name
from layerkv.store.mooncake_config import bind_loopback_if_local, load_mooncake_config, preflight, setup_args
from layerkv.store.mooncake_master import MIN_SEGMENT_BYTES
from layerkv.store.wheels import DISTRIBUTIONS, clash, install_hint, installed

if TYPE_CHECKING:
    from layerkv.config import LayerKVConfig

log = logging.getLogger(__name__)

MIN_VERSION = (0, 3, 13)
MIN_VERSION_TEXT = "0.3.13"


def missing_session_methods(client_cls: type | None = None) -> list[str]:
    """SESSION_METHODS names `client_cls` (default: the installed MooncakeDistributedStore) lacks."""
    if client_cls is None:
        from mooncake.store import MooncakeDistributedStore

        client_cls = MooncakeDistributedStore
    return [name for name in SESSION_METHODS if not callable(getattr(client_cls, name, None))]


def check_session_methods(client_cls: type) -> None:
    """Raise ONE StoreVersionError naming every SESSION_METHODS name `client_cls` lacks."""
    missing = missing_session_methods(client_cls)
    if missing:
        raise StoreVersionError(
            f"{client_cls.__name__} lacks the Mooncake session/range method(s) {', '.join(missing)}; "
            f"layerkv needs Mooncake Store >= {MIN_VERSION_TEXT} "
            f"({install_hint()})"
        )


def installed_version() -> str | None:
    """The installed mooncake wheel's version, or None if no known distribution is installed."""
    found = installed()
    return found[0][1] if found else None


def check_version(version: str | None) -> None:
    """Refuse a Mooncake older than 0.3.13. None (e.g. built from source) only logs a warning;
    the method check still guards the API."""
    if version is None:
        log.warning("layerkv: no %s distribution found; relying on the method check", " / ".join(DISTRIBUTIONS))
        return
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        log.warning("layerkv: cannot parse mooncake version %r; relying on the method check", version)
        return
    if tuple(int(part) for part in match.groups()) < MIN_VERSION:
        raise StoreVersionError(
            f"mooncake {version} is installed; layerkv needs Mooncake Store >= {MIN_VERSION_TEXT} "
            f"(session/range API); {install_hint()}"
        )


def config_path_of(config: LayerKVConfig) -> str:
    """The Mooncake JSON config `config` names (its key, else $MOONCAKE_CONFIG_PATH)."""
    path = config.mooncake_config_path or os.environ.get("MOONCAKE_CONFIG_PATH")
    if not path:
        raise ConfigError(
            "backend='mooncake' needs mooncake_config_path or MOONCAKE_CONFIG_PATH (a Mooncake JSON config)"
        )
    return path


def master_address_of(config: LayerKVConfig) -> str:
    """The master address a client opened from `config` reaches, as configured (mooncake_master,
    else $MOONCAKE_MASTER, else the JSON config's master_server_address); reads the file."""
    master = config.mooncake_master or os.environ.get("MOONCAKE_MASTER")
    return master or str(load_mooncake_config(config_path_of(config)).get("master_server_address", ""))


CLOSE_WAIT_S = 10.0  # close() waits this long for calls inside the client


class MooncakeStore:
    """KVStore over a set-up Mooncake client. Build with `from_config` / `from_mooncake_config`."""

    name = "mooncake"
    pool_scope = PoolScope.SHARED
    hit_source = HitSource.P2P  # memory other processes or hosts lend (vLLM's MooncakeConnector says P2P too)
    pool_address = staticmethod(master_address_of)  # the master's host:port, as configured

    def __init__(
        self,
        client: Any,
        replicate_config_cls: Callable[[], Any],
        master_address: str,
        default_placement: Placement | None = None,
    ) -> None:
        self._client = client
        self._replicate_config_cls = replicate_config_cls
        self.master_address = master_address
        self.default_placement = default_placement or Placement()
        self._closed = False
        self._in_flight = 0  # calls inside the client now
        self._state = threading.Condition()  # guards _closed, _in_flight

    @classmethod
    def from_config(cls, config: LayerKVConfig) -> MooncakeStore:
        """From `config.mooncake_config_path` (default $MOONCAKE_CONFIG_PATH); master from
        `config.mooncake_master` / $MOONCAKE_MASTER, else the file's. Placement from config."""
        path = config_path_of(config)
        master = config.mooncake_master or os.environ.get("MOONCAKE_MASTER") or None
        return cls.from_mooncake_config(
            load_mooncake_config(path),
            master_address=master,
            placement=Placement.from_config(config),
            tenant_id=config.mooncake_tenant_id or config.tenant,
        )

    @classmethod
    def from_mooncake_config(
        cls,
        mooncake_config: Mapping[str, Any],
        *,
        master_address: str | None = None,
        placement: Placement | None = None,
        client_cls: type | None = None,
        tenant_id: str | None = None,
    ) -> MooncakeStore:
        """Check version and methods, then set up a client. `client_cls` defaults to
        MooncakeDistributedStore (tests pass stand-ins / recording subclasses).

        Raises StoreVersionError (too old / methods missing), ConfigError (bad config), StoreError
        (master unreachable or setup rc != 0; the message names the master and the rc).
        """
        args = setup_args(mooncake_config, master_address, tenant_id)
        bind_loopback_if_local(args["local_hostname"])
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # the only mooncake import

        check_version(installed_version())
        if (clashing := clash()) is not None:
            log.warning("layerkv: %s", clashing)
        client_cls = client_cls or MooncakeDistributedStore
        check_session_methods(client_cls)
        preflight(args)
        raised: Exception | None = None
        with native_log.capture_startup() as captured:  # quiet: Mooncake's start-up glog lines
            client = client_cls()
            try:
                rc = client.setup(args)
            except Exception as exc:  # pybind11 raises arbitrary types; translate here only
                raised = exc
        said = f"; mooncake logged: {captured.problems()}" if captured.problems() else ""
        if raised is not None:
            raise StoreError(
                f"mooncake setup against master {args['master_server_addr']} raised {raised!r}{said}"
            ) from raised
        if rc != 0:
            segment = args["global_segment_size"]
            hint = "; global_segment_size must be 0 or >= 16 MiB" if 0 < segment < MIN_SEGMENT_BYTES else ""
            raise StoreError(
                f"mooncake setup against master {args['master_server_addr']} failed: rc={code_name(rc)} "
                f"(local_hostname={args['local_hostname']}, global_segment_size={segment}, "
                f"protocol={args['protocol']}){hint}{said}"
            )
        return cls(client, ReplicateConfig, args["master_server_addr"], placement)

    # -- helpers -----------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        with self._state:
            if self._closed:
                raise StoreError(f"MooncakeStore.{method} called after close()")
            self._in_flight += 1
        try:
            return getattr(self._client, method)(*args)
        except Exception as exc:  # pybind11 raises arbitrary types; translate here only
            raise StoreError(f"mooncake {method} raised {exc!r} (master {self.master_address})") from exc
        finally:
            with self._state:
                self._in_flight -= 1
                self._state.notify_all()

    def _replicate_config(self, placement: Placement | None) -> Any:
        placement = placement or self.default_placement
        rc = self._replicate_config_cls()
        rc.replica_num = placement.replica_num
        rc.preferred_segment = placement.preferred_segment
        rc.prefer_alloc_in_same_node = placement.prefer_alloc_in_same_node
        return rc

    @property
    def segment_name(self) -> str:
        """This client's segment name (`host:port`), usable as Placement.preferred_segment."""
        return str(self._call("get_hostname"))

    # -- KVStore -----------------------------------------------------------------------------

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        rc = self._call("register_buffer", int(ptr), int(nbytes))
        if rc != 0:
            raise StoreError(f"mooncake register_buffer(ptr={ptr:#x}, nbytes={nbytes}) failed: rc={code_name(rc)}")

    def unregister_buffer(self, ptr: int) -> None:
        rc = self._call("unregister_buffer", int(ptr))
        if rc != 0:
            raise StoreError(f"mooncake unregister_buffer(ptr={ptr:#x}) failed: rc={code_name(rc)}")

    def batch_is_exist(self, keys: Sequence[ObjectKey]) -> list[int]:
        return list(self._call("batch_is_exist", list(keys)))

    def batch_put_session_start(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], placement: Placement | None = None
    ) -> list[int]:
        return list(
            self._call(
                "batch_put_session_start", list(keys), [int(s) for s in sizes], self._replicate_config(placement)
            )
        )

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        dst_offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        return list(
            self._call(
                "batch_put_from_multi_buffer_ranges", list(keys), _lists(ptrs), _lists(sizes), _lists(dst_offsets)
            )
        )

    def batch_put_session_end(self, keys: Sequence[ObjectKey]) -> list[int]:
        return list(self._call("batch_put_session_end", list(keys)))

    def batch_put_session_revoke(self, keys: Sequence[ObjectKey]) -> list[int]:
        return list(self._call("batch_put_session_revoke", list(keys)))

    def batch_get_session_start(self, keys: Sequence[ObjectKey]) -> list[int]:
        return list(self._call("batch_get_session_start", list(keys)))

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[ObjectKey],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        return list(
            self._call(
                "batch_get_into_multi_buffer_ranges", list(keys), _lists(ptrs), _lists(sizes), _lists(src_offsets)
            )
        )

    def batch_get_session_end(self, keys: Sequence[ObjectKey]) -> int:
        return self._call("batch_get_session_end", list(keys))  # type: ignore[no-any-return]

    def batch_put_from(
        self, keys: Sequence[ObjectKey], ptrs: Sequence[int], sizes: Sequence[int], placement: Placement | None = None
    ) -> list[int]:
        return list(
            self._call(
                "batch_put_from",
                list(keys),
                [int(p) for p in ptrs],
                [int(s) for s in sizes],
                self._replicate_config(placement),
            )
        )

    def batch_get_into(self, keys: Sequence[ObjectKey], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return list(self._call("batch_get_into", list(keys), [int(p) for p in ptrs], [int(s) for s in sizes]))

    def batch_remove(self, keys: Sequence[ObjectKey]) -> list[int]:
        """Force-remove (also objects with live leases): used for probe / test cleanup."""
        return list(self._call("batch_remove", list(keys), True))

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Unmount this client's segment and disconnect, once no call is inside the client (up
        to `wait_s`; a call still inside then, e.g. a read to a host that vanished, leaves the
        client open for the process to drop at exit: closing under it can crash the process).
        Idempotent; later calls raise StoreError."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            if not self._state.wait_for(lambda: self._in_flight == 0, timeout=wait_s):
                log.warning(
                    "layerkv: %d Mooncake calls still inside the client after %.0f s (master %s); "
                    "left open rather than closed under them",
                    self._in_flight,
                    wait_s,
                    self.master_address,
                )
                return
        try:
            rc = self._client.close()
        except Exception as exc:  # pybind11 raises arbitrary types; translate here only
            raise StoreError(f"mooncake close raised {exc!r}") from exc
        if rc != 0:
            log.warning("layerkv: mooncake close returned %s (master %s)", code_name(rc), self.master_address)


def _lists(rows: Sequence[Sequence[int]]) -> list[list[int]]:
    return [[int(v) for v in row] for row in rows]

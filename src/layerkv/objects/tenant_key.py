"""The tenant's secret (config `tenant_key_file`, or $LAYERKV_TENANT_KEY_FILE) and the subkeys
derived from it. Read once at start-up by whoever names or verifies objects (the scheduler and
each worker); immutable afterwards, any thread.

Key file: text, one key per line as hex (at least 32 random bytes = 64 hex digits); blank lines
and lines starting with '#' are ignored. The file must be a regular file readable by its owner
only (no group or other permission bits, as ssh requires of private keys). `layerkv keygen FILE`
writes a new one (`--rotate` puts a new key first and keeps the older ones after it).

The first key names, signs and encrypts what this process writes. Every key in the file reads:
objects named under an older key are found (keys.tenant_namespaces, connector.lookup.PoolLookup.locate)
and verified and decrypted with that key (docs/security.md §2, rotation).

Subkeys: BLAKE3's key derivation mode with one context string per purpose, so a subkey of one
purpose says nothing about another and none reveals the tenant key. Nothing here ever shows a
key: `repr` and error messages name the file and a key id (a hash of the key, safe to log).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import blake3

from layerkv.errors import ConfigError

MIN_KEY_NBYTES = 32
ENV_VAR = "LAYERKV_TENANT_KEY_FILE"
_CONTEXT = "layerkv 2026-12 {purpose}"
_PURPOSES = ("names", "mac", "encryption", "key id")


def _derive(key: bytes, purpose: str) -> bytes:
    assert purpose in _PURPOSES
    return blake3.blake3(key, derive_key_context=_CONTEXT.format(purpose=purpose)).digest(32)


class TenantKey:
    """One tenant key's derived subkeys. `key_id` (16 hex digits) may be logged; nothing else."""

    __slots__ = ("names_key", "mac_key", "encryption_key", "key_id")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_KEY_NBYTES:
            raise ConfigError(f"a tenant key must be at least {MIN_KEY_NBYTES} bytes")
        self.names_key = _derive(secret, "names")
        self.mac_key = _derive(secret, "mac")
        self.encryption_key = _derive(secret, "encryption")
        self.key_id = _derive(secret, "key id")[:8].hex()

    def __repr__(self) -> str:
        return f"TenantKey(id={self.key_id})"


class TenantKeys:
    """The keys of one key file: `current` writes, every one in `all` verifies."""

    __slots__ = ("path", "all")

    def __init__(self, path: str, keys: list[TenantKey]) -> None:
        if not keys:
            raise ConfigError(f"tenant_key_file={path!r} holds no key")
        self.path = path
        self.all = tuple(keys)

    @property
    def current(self) -> TenantKey:
        return self.all[0]

    def __repr__(self) -> str:
        return f"TenantKeys(path={self.path!r}, ids={[k.key_id for k in self.all]})"


def tenant_keys(key_file: str | None) -> TenantKeys | None:
    """The keys of config `tenant_key_file` (None: no key, objects unauthenticated)."""
    return read_key_file(key_file) if key_file else None


def read_key_file(path: str | os.PathLike[str]) -> TenantKeys:
    """Read and check a key file. ConfigError naming `tenant_key_file` and the path (never the
    contents) when it is missing, not a regular file, readable by group or others, malformed,
    or holds a key shorter than 32 bytes."""
    shown = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ConfigError(f"tenant_key_file={shown!r} cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"tenant_key_file={shown!r} must be a regular file")
        if info.st_mode & 0o077:
            raise ConfigError(
                f"tenant_key_file={shown!r} is readable by group or others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); chmod 600 it"
            )
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    keys = []
    for number, line in enumerate(raw.decode("ascii", errors="replace").splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            raise ConfigError(f"tenant_key_file={shown!r} line {number} is not hex") from None
        if len(secret) < MIN_KEY_NBYTES:
            raise ConfigError(
                f"tenant_key_file={shown!r} line {number} holds {len(secret)} bytes; a tenant key "
                f"needs at least {MIN_KEY_NBYTES} (layerkv keygen writes one)"
            )
        keys.append(TenantKey(secret))
    return TenantKeys(shown, keys)


def write_key_file(path: str | os.PathLike[str], rotate: bool = False) -> TenantKeys:
    """A new key file (mode 0600, refused if the file exists), or with `rotate` a new key put
    first in an existing one (the older keys kept after it). Returns what the file now holds."""
    target = Path(path)
    new = secrets.token_bytes(MIN_KEY_NBYTES).hex()
    if rotate:
        old = read_key_file(target)  # checks the existing file first
        lines = [new] + [line for line in target.read_text().splitlines() if line.strip() and not line.startswith("#")]
        tmp = target.with_name(target.name + ".new")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write("# layerkv tenant keys: the first writes, all verify\n" + "\n".join(lines) + "\n")
        os.replace(tmp, target)
        assert len(old.all) + 1 == len(read_key_file(target).all)
    else:
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(f"{str(target)!r} exists; use --rotate to add a new key to it") from None
        with os.fdopen(fd, "w") as out:
            out.write("# layerkv tenant keys: the first writes, all verify\n" + new + "\n")
    return read_key_file(target)

"""Who listens on a local TCP port: LISTEN sockets from /proc/net/tcp{,6} and the pids whose
open file descriptors hold them (Linux /proc; processes of other users are not visible).
Used to prove that a started `mooncake_master` is the process serving its ports, and by
`layerkv doctor` to name the pid behind a local master. Pure reads, no state, any thread.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_TCP_TABLES = ("tcp", "tcp6")
_STATE_LISTEN = "0A"


@dataclass(frozen=True, slots=True)
class Listener:
    """One LISTEN socket on a port. `pid` is None when no process we can inspect holds it."""

    address: str
    port: int
    inode: int
    pid: int | None

    def holder(self) -> str:
        """`pid 123 (mooncake_master)`, or why the holder is unknown."""
        if self.pid is None:
            return "a process this user cannot inspect"
        return f"pid {self.pid} ({process_name(self.pid)})"


def supported() -> bool:
    """True where /proc/net/tcp exists (Linux)."""
    return (PROC / "net" / "tcp").is_file()


def listeners(port: int, *, likely_pid: int | None = None) -> list[Listener]:
    """Every LISTEN socket on `port` (any address, IPv4 and IPv6) with its holder's pid.
    `likely_pid` is checked first, so the common case reads one process's fd table."""
    found = [(address, inode) for address, sock_port, inode in _listen_sockets() if sock_port == port]
    if not found:
        return []
    inodes = {inode for _, inode in found}
    owners: dict[int, int] = {}
    if likely_pid is not None:
        owners.update({inode: likely_pid for inode in socket_inodes(likely_pid) & inodes})
    if inodes - owners.keys():
        owners.update(_find_owners(inodes - owners.keys()))
    return [Listener(address, port, inode, owners.get(inode)) for address, inode in found]


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets `pid` has open; empty if it is gone or not ours to inspect."""
    inodes: set[int] = set()
    try:
        fds = os.listdir(PROC / str(pid) / "fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(PROC / str(pid) / "fd" / fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def process_name(pid: int) -> str:
    """The command name of `pid` (/proc/<pid>/comm), or `?` if it is gone."""
    try:
        return (PROC / str(pid) / "comm").read_text().strip() or "?"
    except OSError:
        return "?"


def _find_owners(inodes: set[int]) -> dict[int, int]:
    owners: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            for inode in socket_inodes(int(entry.name)) & inodes:
                owners[inode] = int(entry.name)
            if len(owners) == len(inodes):
                break
    return owners


def _listen_sockets() -> list[tuple[str, int, int]]:
    """(address, port, inode) of every LISTEN socket in /proc/net/tcp and tcp6."""
    sockets = []
    for table in _TCP_TABLES:
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue  # no IPv6 on this host
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _STATE_LISTEN:
                continue
            address_hex, port_hex = fields[1].split(":")
            sockets.append((_decode_address(address_hex), int(port_hex, 16), int(fields[9])))
    return sockets


def _decode_address(address_hex: str) -> str:
    """/proc/net/tcp addresses are 32-bit words in host byte order."""
    raw = bytes.fromhex(address_hex)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))

"""port_owner reads who listens on a port from /proc, with real sockets of this process."""

from __future__ import annotations

import os
import socket

import pytest

from layerkv.store import port_owner

pytestmark = pytest.mark.skipif(not port_owner.supported(), reason="needs Linux /proc/net/tcp")


def test_listeners_name_this_process_for_ipv4_and_ipv6() -> None:
    with socket.socket() as v4, socket.socket(socket.AF_INET6) as v6:
        v4.bind(("127.0.0.1", 0))
        v4.listen()
        v6.bind(("::1", 0))
        v6.listen()
        for sock, address in ((v4, "127.0.0.1"), (v6, "::1")):
            port = sock.getsockname()[1]
            (found,) = port_owner.listeners(port)
            assert (found.address, found.port, found.pid) == (address, port, os.getpid())
            assert found.inode in port_owner.socket_inodes(os.getpid())
            assert found.holder() == f"pid {os.getpid()} ({port_owner.process_name(os.getpid())})"


def test_a_bound_or_connected_socket_is_not_a_listener() -> None:
    with socket.socket() as server, socket.socket() as bound:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server_port = server.getsockname()[1]
        bound.bind(("127.0.0.1", 0))  # bound, never listening
        with socket.create_connection(server.getsockname()) as client:
            assert port_owner.listeners(bound.getsockname()[1]) == []
            assert port_owner.listeners(client.getsockname()[1]) == []
            assert len(port_owner.listeners(server_port)) == 1
    assert port_owner.listeners(server_port) == []  # closed: nobody listens


def test_unknown_pid_has_no_sockets_and_no_name() -> None:
    assert port_owner.socket_inodes(2**22 + 1) == set()
    assert port_owner.process_name(2**22 + 1) == "?"

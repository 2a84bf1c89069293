"""Ports handed to the processes tests and the demo start."""

import socket

from deploy.procs import free_port


def test_a_port_span_is_free_and_never_handed_out_again() -> None:
    """An engine with data-parallel ranks binds port + rank: the whole span must be free, and no
    later call may hand out a port inside it."""
    base = free_port(3)
    for p in range(base, base + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free now
    later = {free_port() for _ in range(200)}
    assert not later & {base, base + 1, base + 2}

"""side_by_side starts each server on a port nothing else listens on: a server already there would answer
/health in place of the one it started, and the run would measure that one."""

import socket

from server.bench.side_by_side import _free_port


def test_a_taken_port_is_not_reused():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        port = _free_port(taken)
        assert port != taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free indeed


def test_a_free_preferred_port_is_kept():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert _free_port(free) == free

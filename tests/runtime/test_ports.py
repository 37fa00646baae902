"""free_port: a deployment's ports are picked one after another, and must differ."""

from __future__ import annotations

import socket

from dynamo_pd.runtime.ports import free_port


def test_free_ports_picked_in_a_row_never_repeat_and_are_free():
    # Plain probes (bind port 0, close) repeat 1 to 4 times in 300 picks here: the kernel may hand a closed
    # probe's port to the next one. CI once gave a test's HTTP and discovery ports the same number.
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))

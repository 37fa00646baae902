"""Addresses: a free TCP port, and the address a bound endpoint is advertised under.

A server binds `--host` (127.0.0.1 by default; 0.0.0.0 for every interface) and advertises
`--advertise-host` in discovery, the address its peers on other hosts reach it at. A wildcard bind
without one advertises the address of the interface that routes towards discovery.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

WILDCARDS = ("0.0.0.0", "::", "*", "")


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host`, and none this process was given before: once the probe socket closes the
    kernel may hand the same port to the next probe, and two picks in a row (an HTTP and a discovery port)
    would then collide."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port on {host} that this process was not already given (100 probes)")


def advertise_host(host: str, advertise: str = "", toward: str = "") -> str:
    """`advertise` if given; else `host` unless it is a wildcard; else this machine's address on the
    route to `toward` (a URL such as the discovery's), or 127.0.0.1 without one."""
    if advertise:
        return advertise
    if host not in WILDCARDS:
        return host
    target = urlsplit(toward).hostname if toward else None
    if not target or target in WILDCARDS:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # UDP: nothing is sent, the kernel only picks the route and source address
            return s.getsockname()[0]
    except OSError as exc:
        raise ValueError(f"no route from this host to {target} to find the address to advertise "
                         f"({exc.strerror}): pass --advertise-host") from None


def advertised(endpoint: str, host: str) -> str:
    """`endpoint` (a bound tcp://ADDR:PORT) with `host` in place of ADDR; other transports unchanged."""
    if not host or not endpoint.startswith("tcp://"):
        return endpoint
    port = endpoint.rpartition(":")[2]
    return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"

"""--frontend-processes: several frontend processes serve one port (SO_REUSEPORT), each routes every request
it takes and learns the others' placements on the event plane, and they stop with the process that started
them (SIGTERM, or the kernel's signal when it is killed)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from tests.e2e.conftest import MODEL, Deployment, start_deployment

pytestmark = pytest.mark.slow


def siblings_of(pid: int) -> list[int]:
    """The frontend processes `pid` started (its children running dynamo_pd.frontend)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"dynamo_pd.frontend" in cmdline:
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is gone too
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"


def chat(deployment: Deployment, i: int) -> str:
    """One request on a connection of its own; the process that answered it."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}],
                       "max_tokens": 4}).encode()
    request = urllib.request.Request(deployment.url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return response.headers["x-dynamo-pd-frontend"]


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_two_frontend_processes_share_one_port_and_their_placements(tmp_path, stop):
    deployment = start_deployment(tmp_path, "--aggregated", "2", "--engine", "mocker", "--speedup", "10",
                                  "--frontend-processes", "2")
    primary = deployment.procs["frontend"]
    try:
        deployment.wait_for(lambda: len(siblings_of(primary.pid)) == 1, 60, "the second frontend process")
        sibling = siblings_of(primary.pid)[0]
        # the sibling routes too once its discovery follows the workers: until then it may answer 503
        deployment.wait_for(lambda: all(deployment.post("/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "warm"}], "max_tokens": 1})[0] == 200
            for _ in range(8)), 120, "both processes routing")
        answered = {chat(deployment, i) for i in range(40)}
        assert answered == {str(primary.pid), str(sibling)}  # the kernel spread the connections

        def both_applied() -> bool:
            """Each process applied the other's placements (a process alone applies none): each publishes them
            once it heard the other's hello, within a second or two of the other's start."""
            for i in range(8):
                chat(deployment, i)
            return min(deployment.rendered_metric("dynamo_pd_router_replica_updates") for _ in range(12)) > 0

        deployment.wait_for(both_applied, 30, "each process applying the other's placements")
    except BaseException:
        deployment.stop()
        raise
    if stop == "sigterm":
        codes = deployment.stop()
        assert codes["frontend"] == 0, codes
    else:
        deployment.kill("frontend")
        deployment.stop()
    deadline = time.monotonic() + 30
    while alive(sibling) and time.monotonic() < deadline:
        time.sleep(0.1)  # its parent's SIGTERM (or the kernel's, on its death) is on its way
    try:
        assert not alive(sibling), f"the sibling frontend {sibling} outlived the frontend ({stop})"
    finally:
        if alive(sibling):
            os.kill(sibling, signal.SIGKILL)

"""Secrets come from a file or the environment; NATS and etcd take credentials and TLS (real servers)."""

from __future__ import annotations

import argparse
import shutil
import subprocess

import pytest

from dynamo_pd.credentials import add_security_args, security_argv, security_from_args
from dynamo_pd.runtime import DiscoveryUnavailableError, EventPlaneError, connect_discovery
from dynamo_pd.runtime.events_nats import NatsEventPlane
from dynamo_pd.runtime.ports import free_port
from dynamo_pd.runtime.security import SECRET_ENV, EtcdAuth, NatsAuth, Security, Tls
from tests.servers import binary, etcd_server, running_server

SECRET = "a-cluster-secret-of-32-characters"


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_security_args(p)
    return p.parse_args(argv)


def test_the_cluster_secret_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert not security_from_args(parse()).enabled
    monkeypatch.setenv(SECRET_ENV, SECRET)
    from_env = security_from_args(parse())
    (tmp_path / "secret").write_text(SECRET + "\n")
    from_file = security_from_args(parse("--cluster-secret-file", str(tmp_path / "secret")))
    assert from_env.server_public == from_file.server_public  # the trailing newline is not part of it
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(SystemExit, match="at least 16 characters"):
        security_from_args(parse())
    with pytest.raises(SystemExit, match="cannot read --cluster-secret-file"):
        security_from_args(parse("--cluster-secret-file", str(tmp_path / "missing")))


def test_only_paths_and_names_are_passed_on(tmp_path):
    args = parse("--cluster-secret-file", "/run/secret", "--nats-user", "u", "--etcd-tls-ca", "/ca.pem")
    assert security_argv(args) == ["--cluster-secret-file", "/run/secret", "--nats-user", "u",
                                   "--etcd-tls-ca", "/ca.pem"]


@pytest.fixture
def tls(tmp_path):
    """A CA and a server certificate for 127.0.0.1 it signed (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (tmp_path / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "1", "-extfile", "san.cnf")
    return tmp_path


@pytest.mark.nats
@pytest.mark.parametrize("server_auth, good, bad", [
    (["--user", "u", "--pass", "pw-123"], NatsAuth(user="u", password="pw-123"), NatsAuth(user="u", password="no")),
    (["--auth", "tok-123"], NatsAuth(token="tok-123"), NatsAuth()),
])
async def test_nats_takes_a_user_and_password_or_a_token(tmp_path, server_auth, good, bad):
    port = free_port()
    with running_server([binary("nats-server"), "-a", "127.0.0.1", "-p", str(port), *server_auth], port,
                        tmp_path / "nats.log"):
        with pytest.raises(EventPlaneError, match="Authorization Violation"):
            await NatsEventPlane.connect(f"nats://127.0.0.1:{port}", connect_timeout_s=2.0, auth=bad)
        plane = await NatsEventPlane.connect(f"nats://127.0.0.1:{port}", connect_timeout_s=5.0, auth=good)
        async with await plane.subscribe("x") as sub:
            await plane.publish("x.y", b"m")
            assert await anext(sub) == ("x.y", b"m")
        await plane.close()


@pytest.mark.nats
async def test_nats_over_tls(tmp_path, tls):
    port = free_port()
    args = [binary("nats-server"), "-a", "127.0.0.1", "-p", str(port), "--tls",
            "--tlscert", str(tls / "server.pem"), "--tlskey", str(tls / "server.key")]
    with running_server(args, port, tmp_path / "nats.log"):
        with pytest.raises(EventPlaneError):  # the server wants TLS
            await NatsEventPlane.connect(f"nats://127.0.0.1:{port}", connect_timeout_s=2.0)
        plane = await NatsEventPlane.connect(f"tls://127.0.0.1:{port}", connect_timeout_s=5.0,
                                             auth=NatsAuth(tls=Tls(ca=str(tls / "ca.pem"))))
        await plane.publish("x", b"m")
        await plane.close()


def etcdctl(url: str, *args: str) -> None:
    subprocess.run([binary("etcdctl"), "--endpoints", url.replace("etcd://", "http://"), *args],
                   check=True, capture_output=True, timeout=30)


@pytest.mark.etcd
async def test_etcd_takes_a_user_and_password(tmp_path):
    with etcd_server(tmp_path) as url:
        etcdctl(url, "user", "add", "root:pw-123")
        etcdctl(url, "auth", "enable")
        with pytest.raises(DiscoveryUnavailableError):
            async with await connect_discovery(url, request_timeout_s=2.0) as discovery:
                await discovery.advertise("k", b"v")
        security = Security(etcd=EtcdAuth("root", "pw-123"))
        async with await connect_discovery(url, security=security) as discovery:
            await discovery.advertise("k", b"v")
            assert await discovery.get_prefix("") == {"k": b"v"}


@pytest.mark.etcd
async def test_etcd_over_tls(tmp_path, tls):
    port, peer = free_port(), free_port()
    args = [binary("etcd"), "--data-dir", str(tmp_path / "data"), "--name", "t",
            "--listen-client-urls", f"https://127.0.0.1:{port}", "--advertise-client-urls", f"https://127.0.0.1:{port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--cert-file", str(tls / "server.pem"),
            "--key-file", str(tls / "server.key"), "--log-level", "error"]
    with running_server(args, port, tmp_path / "etcd.log"):
        with pytest.raises(DiscoveryUnavailableError):  # plaintext gRPC to a TLS port
            await connect_discovery(f"etcd://127.0.0.1:{port}", request_timeout_s=2.0)
        security = Security(etcd=EtcdAuth(tls=Tls(ca=str(tls / "ca.pem"))))
        async with await connect_discovery(f"etcd://127.0.0.1:{port}", security=security) as discovery:
            await discovery.advertise("k", b"v")
            assert await discovery.get_prefix("") == {"k": b"v"}

"""Who may talk to a deployment: one cluster secret guards every ZMQ plane; every ZMQ socket has a size limit;
NATS and etcd take the credentials and TLS their clients support.

    security = Security.from_secret(secret)        # None: no secret (the default, loopback-only deployments)
    configure(security)                            # once, at the process's entry point
    current().server(sock, RPC_MAX_BYTES)          # a socket that binds, before bind()
    current().client(sock, RPC_MAX_BYTES)          # a socket that connects, before connect()

With a secret, every ZMQ socket speaks ZMQ's own CURVE (authenticated, encrypted), with keys DERIVED
from the secret, so nothing is distributed and no plane depends on another to start:
  - server keypair = Curve25519 secret key HMAC-SHA256(secret, "server"); every socket that binds (RPC
    ROUTER, discovery ROUTER, event-plane PUB, KV event PUB and replay ROUTER, KV side channel ROUTER)
    is a CURVE server with it;
  - client keypair = the same from "client"; every socket that connects (DEALER, SUB) is a CURVE client
    with it and knows the server public key.
A peer without the secret cannot take part: a plaintext peer fails the handshake (mechanism
mismatch), a CURVE peer cannot even say HELLO without the server public key, and one that has it but
another client key is refused by the ZAP handler (zmq.auth, one thread per process) whose domain for
this secret admits only the derived client key. Everyone holding the secret is equally trusted (a
shared cluster credential, like a token), so it must be random: at least MIN_SECRET_CHARS characters,
e.g. `openssl rand -hex 32`. It comes from `DYNAMO_PD_CLUSTER_SECRET` or `--cluster-secret-file`,
never from argv (`ps` shows argv to every user).

Without a secret the sockets stay plaintext (bind 127.0.0.1 unless told otherwise). Either way each
socket refuses inbound message parts larger than what it carries (zmq.MAXMSGSIZE; ZMQ drops the
connection of a peer that sends one, the server's task goes on).

NATS (nats-py): user + password or a token, TLS with a CA to verify the server and optionally a client
certificate. etcd (aetcd): user + password, TLS likewise (see discovery_etcd). They ride in the same
Security object: `Security(secret, nats=NatsAuth(...), etcd=EtcdAuth(...))`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import ssl
import threading
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

SECRET_ENV = "DYNAMO_PD_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16

# Inbound limits per message part: what each plane carries, with room to spare.
RPC_MAX_BYTES = 64 << 20  # an EngineRequest (a long prompt's token ids, a hand-off descriptor) or output
DISCOVERY_MAX_BYTES = 16 << 20  # a snapshot of every registered worker's WorkerInfo
EVENTS_MAX_BYTES = 16 << 20  # load reports, router-replica updates
KV_EVENTS_MAX_BYTES = 64 << 20  # one flush of KV events (a long prefill stores thousands of blocks)
CONTROL_MAX_BYTES = 64 << 10  # sockets that receive only subscriptions or replay requests


class SecretError(ValueError):
    """The cluster secret is unusable (too short, unreadable file)."""


@dataclass(frozen=True)
class Tls:
    """Verify the server with `ca` (the system's CAs when empty); present `cert` + `key` when given."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert)

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key or None)
        return ctx


@dataclass(frozen=True)
class NatsAuth:
    user: str = ""
    password: str = ""
    token: str = ""
    tls: Tls = field(default_factory=Tls)

    def connect_kwargs(self) -> dict:
        """nats.connect's keyword arguments for these credentials."""
        kwargs: dict = {"user": self.user or None, "password": self.password or None, "token": self.token or None}
        if self.tls.enabled:
            kwargs["tls"] = self.tls.context()
        return kwargs


@dataclass(frozen=True)
class EtcdAuth:
    user: str = ""
    password: str = ""
    tls: Tls = field(default_factory=Tls)


class Security:
    """CURVE keys for one cluster secret, or none (plaintext), plus the NATS and etcd credentials;
    `refused` counts ZMQ peers ZAP turned away."""

    def __init__(self, secret: str | None = None, *, nats: NatsAuth = NatsAuth(), etcd: EtcdAuth = EtcdAuth()):
        self.nats, self.etcd = nats, etcd
        self.enabled = secret is not None
        self.refused = 0
        if secret is None:
            return
        if len(secret) < MIN_SECRET_CHARS:
            raise SecretError(f"the cluster secret must have at least {MIN_SECRET_CHARS} characters "
                              f"(e.g. `openssl rand -hex 32`), got {len(secret)}")
        self.server_public, self._server_secret = _keypair(secret, b"server")
        self._client_public, self._client_secret = _keypair(secret, b"client")
        self._domain = "dynamo_pd-" + hashlib.sha256(self.server_public).hexdigest()[:16]

    def server(self, sock: zmq.Socket, max_bytes: int) -> None:
        """Set up a socket that binds: its size limit and, with a secret, CURVE server + ZAP."""
        sock.maxmsgsize = max_bytes
        if self.enabled:
            _authenticator(sock.context).configure_curve_callback(self._domain, self)
            sock.zap_domain = self._domain.encode()
            sock.curve_secretkey, sock.curve_publickey = self._server_secret, self.server_public
            sock.curve_server = True

    def client(self, sock: zmq.Socket, max_bytes: int) -> None:
        """Set up a socket that connects: its size limit and, with a secret, CURVE client keys."""
        sock.maxmsgsize = max_bytes
        if self.enabled:
            sock.curve_secretkey, sock.curve_publickey = self._client_secret, self._client_public
            sock.curve_serverkey = self.server_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP (zmq.auth credentials provider): admit only this secret's client key."""
        if hmac.compare_digest(client_key, self._client_public):
            return True
        self.refused += 1
        log.warning("refused a ZMQ peer whose CURVE key does not come from the cluster secret")
        return False


def _keypair(secret: str, role: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Curve25519 keys, z85; any 32 bytes are a secret key (the curve clamps them)."""
    secret_key = z85.encode(hmac.new(secret.encode(), b"dynamo_pd curve " + role, hashlib.sha256).digest())
    return zmq.curve_public(secret_key), secret_key


_AUTH: dict[int, ThreadAuthenticator] = {}  # libzmq context address -> its ZAP handler
_AUTH_LOCK = threading.Lock()


def _authenticator(context: zmq.Context) -> ThreadAuthenticator:
    """The context's ZAP handler (one per context: it binds inproc://zeromq.zap.01), started once. In a
    thread, so handshakes go on while the process's event loop is busy."""
    with _AUTH_LOCK:
        auth = _AUTH.get(context.underlying)
        if auth is None:
            auth = _AUTH[context.underlying] = ThreadAuthenticator(zmq.Context.shadow(context.underlying))
            auth.start()
        return auth


_current = Security()


def configure(security: Security) -> None:
    """Set this process's security; sockets made afterwards use it."""
    global _current
    _current = security


def current() -> Security:
    return _current

"""Where secrets come from: an environment variable or a file, never only argv (`ps` shows argv to anyone).

    add_security_args(parser)            # --cluster-secret-file, --nats-*, --etcd-* (every process)
    security = security_from_args(args)  # a runtime.security.Security; the entry point configure()s it
    add_api_key_args(parser); key = api_key_from_args(args)   # the frontend's HTTP API key

| secret             | environment variable        | file flag              |
|--------------------|-----------------------------|------------------------|
| cluster secret     | DYNAMO_PD_CLUSTER_SECRET    | --cluster-secret-file  |
| NATS password      | DYNAMO_PD_NATS_PASSWORD     | --nats-password-file   |
| NATS token         | DYNAMO_PD_NATS_TOKEN        | --nats-token-file      |
| etcd password      | DYNAMO_PD_ETCD_PASSWORD     | --etcd-password-file   |
| HTTP API key       | DYNAMO_PD_API_KEY           | --api-key-file (or --api-key) |

A file wins over the variable; its trailing newline is dropped. The flags themselves name only paths
and user names, so the launcher passes them on to its children as given, and children inherit the
variables.
"""

from __future__ import annotations

import argparse
import os

from dynamo_pd.runtime.security import SECRET_ENV, EtcdAuth, NatsAuth, SecretError, Security, Tls

API_KEY_ENV = "DYNAMO_PD_API_KEY"
_SECRET_FILES = (  # (file flag's dest, environment variable)
    ("cluster_secret_file", SECRET_ENV), ("nats_password_file", "DYNAMO_PD_NATS_PASSWORD"),
    ("nats_token_file", "DYNAMO_PD_NATS_TOKEN"), ("etcd_password_file", "DYNAMO_PD_ETCD_PASSWORD"),
)


def add_security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (secrets come from a file or the environment, see dynamo_pd/credentials.py)")
    g.add_argument("--cluster-secret-file", default=None,
                   help=f"a file holding the cluster secret (or ${SECRET_ENV}): every ZMQ plane then speaks CURVE "
                        "and refuses peers without it; the same on every process of the deployment")
    g.add_argument(
        "--nats-user", default="", help="NATS user (password: --nats-password-file or $DYNAMO_PD_NATS_PASSWORD)"
    )
    g.add_argument("--nats-password-file", default=None)
    g.add_argument("--nats-token-file", default=None, help="a file holding the NATS token (or $DYNAMO_PD_NATS_TOKEN)")
    g.add_argument("--nats-tls-ca", default="", help="CA bundle to verify the NATS server (turns TLS on)")
    g.add_argument("--nats-tls-cert", default="", help="client certificate for NATS (turns TLS on)")
    g.add_argument("--nats-tls-key", default="")
    g.add_argument(
        "--etcd-user", default="", help="etcd user (password: --etcd-password-file or $DYNAMO_PD_ETCD_PASSWORD)"
    )
    g.add_argument("--etcd-password-file", default=None)
    g.add_argument("--etcd-tls-ca", default="", help="CA bundle to verify etcd (turns TLS on)")
    g.add_argument("--etcd-tls-cert", default="", help="client certificate for etcd (turns TLS on)")
    g.add_argument("--etcd-tls-key", default="")


def security_from_args(args: argparse.Namespace) -> Security:
    secrets = {
        dest: read_secret(getattr(args, dest), env, "--" + dest.replace("_", "-")) for dest, env in _SECRET_FILES
    }
    if bool(args.etcd_user) != bool(secrets["etcd_password_file"]):
        raise SystemExit("error: etcd credentials need both --etcd-user and a password "
                         "(--etcd-password-file or $DYNAMO_PD_ETCD_PASSWORD)")
    nats = NatsAuth(args.nats_user, secrets["nats_password_file"] or "", secrets["nats_token_file"] or "",
                    Tls(args.nats_tls_ca, args.nats_tls_cert, args.nats_tls_key))
    etcd = EtcdAuth(args.etcd_user, secrets["etcd_password_file"] or "",
                    Tls(args.etcd_tls_ca, args.etcd_tls_cert, args.etcd_tls_key))
    try:
        return Security(secrets["cluster_secret_file"], nats=nats, etcd=etcd)
    except SecretError as exc:
        raise SystemExit(f"error: {exc} (--cluster-secret-file or ${SECRET_ENV})") from None


def security_argv(args: argparse.Namespace) -> list[str]:
    """The security flags given in `args`, to pass on to a child process (paths and names only)."""
    p = argparse.ArgumentParser(add_help=False)
    add_security_args(p)
    argv = []
    for dest, default in vars(p.parse_args([])).items():
        if getattr(args, dest) != default:
            argv += ["--" + dest.replace("_", "-"), getattr(args, dest)]
    return argv


def add_api_key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health and /ready; visible in "
                        f"`ps`: prefer --api-key-file or ${API_KEY_ENV}")
    p.add_argument("--api-key-file", default=None, help=f"a file holding the API key (or ${API_KEY_ENV})")


def api_key_from_args(args: argparse.Namespace) -> str | None:
    return args.api_key or read_secret(args.api_key_file, API_KEY_ENV, "--api-key-file")


def read_secret(path: str | None, env: str, flag: str) -> str | None:
    """The secret in the file at `path`, else in the environment variable `env`, else None."""
    if path is None:
        return os.environ.get(env) or None
    try:
        with open(path) as f:
            value = f.read().rstrip("\r\n")
    except OSError as exc:
        raise SystemExit(f"error: cannot read {flag} {path}: {exc.strerror}") from None
    if not value:
        raise SystemExit(f"error: {flag} {path} is empty")
    return value

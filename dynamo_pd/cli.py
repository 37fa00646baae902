"""Command-line plumbing shared by every process: engine flags in, EngineConfig out.

Flags this project does not know are passed to the engine untouched (`--foo-bar 3` becomes
`EngineConfig.extra["foo_bar"] = 3`), so each engine's own options work without a wrapper.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from dynamo_pd.engines.base import EngineConfig, EngineRole, EngineUnavailableError, check_installed, engine_names
from dynamo_pd.handoff import HandoffTimes
from dynamo_pd.frontend.tools import REASONING_PARSERS, TOOL_PARSERS
from router.service import POLICIES, RouterConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--engine", default="native", help=f"one of {', '.join(engine_names())} (default: native)")
    g.add_argument(
        "--model", default=None, help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (native engine)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="the KV cache's size in GiB (default 1)")
    size.add_argument("--kv-cache-memory-fraction", type=float, default=None, metavar="F",
                      help="instead: this fraction (0 < F <= 1) of the memory free when the worker starts (the "
                           "host's MemAvailable; on CUDA the device's free memory); serve splits it between workers")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--kv-host-gb", type=float, default=0.0,
                   help="a host tier below the KV pool, in GiB of pinned RAM: blocks the pool evicts go "
                        "there and are copied back, not recomputed (it matters when the pool is on a GPU; "
                        "default 0: none)")
    g.add_argument("--kv-disk-gb", type=float, default=0.0,
                   help="a disk tier below the pool (and host tier), GiB of files in --kv-disk-dir; a block "
                        "goes there once it has been used twice (default 0: none)")
    g.add_argument("--kv-disk-dir", default=None,
                   help="where the disk tier keeps its files, in a directory of each worker's own, gone "
                        "when it stops (default: the system's temporary directory)")
    g.add_argument("--no-peer-prefixes", action="store_true",
                   help="neither lend this worker's cached prefixes to peers nor read theirs: a prefix it lacks "
                        "is computed (default: the router may plan a read from the peer that holds it)")
    g.add_argument("--handoff-lease-s", type=float, default=30.0, help="prefill: how long held KV waits for decode")


def add_kv_args(parser: argparse.ArgumentParser) -> None:
    """How workers hand KV to each other (the launcher passes these to every worker)."""
    parser.add_argument("--kv-transport", default="zmq", choices=["zmq", "nixl"])
    parser.add_argument("--kv-handoff", default="pull", choices=["pull", "push"],
                        help="prefill workers: decode reads the held KV (pull) or prefill writes it into blocks "
                             "decode reserved, SGLang style (push); decode workers follow each request's mode")


NAMESPACE_HELP = "deployment name: keys in discovery and event subjects live under it (default dynamo_pd)"


def check_namespace(namespace: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", namespace):
        raise SystemExit(f"error: --namespace must be letters, digits, '_' or '-', got {namespace!r}")
    return namespace


def _positive(name: str, value: float | int | None) -> None:
    if value is not None and value <= 0:
        raise SystemExit(f"error: {name} must be positive, got {value}")


def free_memory_bytes(device: str) -> int:
    """Memory free now: the CUDA device's, else the host's MemAvailable (what can be had without swapping)."""
    if device.startswith("cuda"):
        import torch  # a worker's import anyway; the frontend never gets here

        return torch.cuda.mem_get_info(torch.device(device))[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("error: --kv-cache-memory-fraction: /proc/meminfo has no MemAvailable; give --kv-cache-memory-gb")


def engine_config(args: argparse.Namespace, role: EngineRole, passthrough: list[str]) -> EngineConfig:
    if args.engine not in engine_names():
        raise SystemExit(f"error: --engine {args.engine!r} is unknown; choose one of {', '.join(engine_names())}")
    try:
        check_installed(args.engine)  # a missing package is one line now, not a traceback later
    except EngineUnavailableError as exc:
        raise SystemExit(f"error: {exc}") from None
    for flag in ("block_size", "kv_cache_memory_gb", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "handoff_lease_s"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    for flag in ("kv_host_gb", "kv_disk_gb"):
        if getattr(args, flag) < 0:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    kv_gb = args.kv_cache_memory_gb
    if args.kv_cache_memory_fraction is not None:
        if not 0 < args.kv_cache_memory_fraction <= 1:
            raise SystemExit(
                f"error: --kv-cache-memory-fraction must be in (0, 1], got {args.kv_cache_memory_fraction}"
            )
        kv_gb = args.kv_cache_memory_fraction * free_memory_bytes(args.device) / 2**30
    return EngineConfig(
        role=role,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory_gb=kv_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_host_gb=args.kv_host_gb,
        kv_disk_gb=args.kv_disk_gb,
        kv_disk_dir=args.kv_disk_dir,
        peer_prefixes=not args.no_peer_prefixes,
        handoff=HandoffTimes(lease_s=args.handoff_lease_s),
        extra=parse_passthrough(passthrough),
    )


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    """The frontend's routing and request-handling options; `serve` takes the same ones and forwards
    what it is given (`frontend_argv`)."""
    g = p.add_argument_group("frontend")
    g.add_argument("--config", default=None, metavar="TOML",
                   help="models (fallbacks, their own limits), rate limits and health checks from a TOML file "
                        "(dynamo_pd/frontend/config.py), re-read on SIGHUP; a flag given a non-default value wins")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20)
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the format every model writes tool calls in (dynamo_pd/frontend/tools; default: "
                        "each model's own, from its config and vocabulary; hermes for a template without tools)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="think: the text in <think>...</think> is the answer's reasoning_content (default: "
                        "none)")
    g.add_argument("--router-policy", default=RouterConfig.policy, choices=POLICIES,
                   help="time: the least predicted latency, from the costs workers measure (router/policies.py); "
                        "kv: Dynamo's overlap_weight * prefill blocks + active blocks; or a baseline "
                        f"(default {RouterConfig.policy})")
    g.add_argument("--overlap-weight", type=float, default=1.0, help="the kv policy's weight of a prefill block")
    g.add_argument("--router-temperature", type=float, default=0.0)
    g.add_argument("--busy-kv-fraction", type=float, default=0.95,
                   help="a worker whose active KV blocks reach this share of its capacity gets no new request; "
                        "when every worker of the pool has, a request is refused at once with a 503 (overloaded)")
    g.add_argument("--local-prefill-tokens", type=int, default=0,
                   help="the decode worker prefills locally when the uncached prompt is at most this many tokens")
    g.add_argument("--on-prefill-failure", default="local", choices=["local", "fail"])
    g.add_argument("--inter-token-timeout-s", type=float, default=60.0,
                   help="a worker that sends nothing this long after the first token is wedged: its work is cancelled "
                        "and the request moves to another worker (--migration-limit), else ends with 503")
    g.add_argument("--migration-limit", type=int, default=3,
                   help="how often one request may move to another worker when its worker fails (died, stalled, "
                        "drained): retried before its first token, continued from the tokens sent after (0: never)")
    g.add_argument("--key-requests-per-s", type=float, default=0.0, help="rate limit per API key (0: none)")
    g.add_argument("--key-tokens-per-s", type=float, default=0.0,
                   help="rate limit per API key in prompt + max_tokens tokens (0: none)")
    g.add_argument("--model-requests-per-s", type=float, default=0.0, help="rate limit per model (0: none)")
    g.add_argument("--model-tokens-per-s", type=float, default=0.0, help="rate limit per model in tokens (0: none)")
    g.add_argument("--key-limit", action="append", default=[], metavar="KEY=RPS[/TPS]",
                   help="this API key's own limits in requests/s and optionally tokens/s, over the per-key ones "
                        "(0: none; repeatable)")
    g.add_argument("--model-limit", action="append", default=[], metavar="MODEL=RPS[/TPS]",
                   help="this model's own limits in requests/s and optionally tokens/s, over the per-model ones "
                        "(0: none; repeatable)")
    g.add_argument("--rate-burst-s", type=float, default=1.0, help="a rate limit's bucket holds this many seconds")
    g.add_argument("--max-queued-requests", type=int, default=0,
                   help="per model: requests waiting for their first token beyond this are a 503 (0: no cap)")
    g.add_argument("--fallback-model", action="append", default=[], metavar="MODEL=FALLBACK",
                   help="requests for MODEL go to FALLBACK while MODEL cannot take them (no worker ready, circuits "
                        "open, queue full); the answer names the model that answered (repeatable)")
    g.add_argument("--health-check-interval-s", type=float, default=10.0,
                   help="how often each worker gets a canary request (one token); a worker that fails it leaves "
                        "routing until it passes again (0: no health checks)")
    g.add_argument("--health-check-timeout-s", type=float, default=10.0, help="a canary slower than this fails")
    g.add_argument("--frontend-processes", type=int, default=1, metavar="N",
                   help="frontend processes serving one port (SO_REUSEPORT: the kernel spreads connections), each "
                        "with its own router; they share their placements on the event plane (use the cores of "
                        "the frontend's host)")


def check_frontend_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.frontend_processes < 1:
        p.error(f"--frontend-processes must be >= 1, got {args.frontend_processes}")
    if args.inter_token_timeout_s <= 0:
        p.error(f"--inter-token-timeout-s must be > 0, got {args.inter_token_timeout_s}")
    if args.migration_limit < 0:
        p.error(f"--migration-limit must be >= 0, got {args.migration_limit}")
    if not 0 < args.busy_kv_fraction <= 1:
        p.error(f"--busy-kv-fraction must be in (0, 1], got {args.busy_kv_fraction}")
    for flag in ("key_requests_per_s", "key_tokens_per_s", "model_requests_per_s", "model_tokens_per_s",
                 "max_queued_requests"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.rate_burst_s <= 0:
        p.error(f"--rate-burst-s must be > 0, got {args.rate_burst_s}")
    if args.health_check_interval_s < 0:
        p.error(f"--health-check-interval-s must be >= 0, got {args.health_check_interval_s}")
    if args.health_check_timeout_s <= 0:
        p.error(f"--health-check-timeout-s must be > 0, got {args.health_check_timeout_s}")
    for flag in ("key_limit", "model_limit"):
        for value in getattr(args, flag):
            try:
                parse_limit(value)
            except ValueError as exc:
                p.error(f"--{flag.replace('_', '-')}: {exc}")
    for pair in args.fallback_model:
        model, _, fallback = pair.partition("=")
        if not model or not fallback or model == fallback:
            p.error(f"--fallback-model must be MODEL=FALLBACK with two different models, got {pair!r}")


def parse_limit(value: str) -> tuple[str, dict[str, float]]:
    """`NAME=RPS[/TPS]` -> (NAME, its rates as the config file's keys); ValueError saying what is wrong."""
    name, _, rates = value.partition("=")
    requests, slash, tokens = rates.partition("/")
    try:
        limit = {"requests_per_s": float(requests), **({"tokens_per_s": float(tokens)} if slash else {})}
    except ValueError:
        limit = {}
    if not name or not limit or any(v < 0 or v != v for v in limit.values()):
        raise ValueError(f"expected NAME=REQUESTS_PER_S[/TOKENS_PER_S] with rates >= 0, got {value!r}")
    return name, limit


def frontend_defaults() -> dict:
    """Every frontend option's default, by its argparse dest."""
    p = argparse.ArgumentParser(add_help=False)
    add_frontend_args(p)
    return vars(p.parse_args([]))


def frontend_argv(args: argparse.Namespace) -> list[str]:
    """The frontend options in `args` that differ from their defaults, as flags."""
    argv = []
    for dest, default in frontend_defaults().items():
        value = getattr(args, dest)
        if value != default:
            for one in value if isinstance(value, list) else [value]:  # repeatable flags: once a value
                argv += ["--" + dest.replace("_", "-"), str(one)]
    return argv

def parse_passthrough(tokens: list[str]) -> dict:
    """`--key value` / `--flag` pairs for the engine; values parse as JSON when they can."""
    extra: dict = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise SystemExit(f"error: unexpected argument {token!r} (engine flags look like --name value)")
        key, _, inline = token[2:].partition("=")
        key = key.replace("-", "_")
        if inline:
            value, i = inline, i + 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            value, i = tokens[i + 1], i + 2
        else:
            value, i = "true", i + 1
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    return extra


def main() -> None:
    """`dynamo-pd serve|prefill|decode|aggregated|frontend ...`: the same as `python -m dynamo_pd.<command>`."""
    commands = ("serve", "prefill", "decode", "aggregated", "frontend")
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        raise SystemExit(f"usage: dynamo-pd {{{','.join(commands)}}} [options]")
    command = sys.argv.pop(1)
    sys.argv[0] = f"dynamo-pd {command}"
    import importlib

    module = f"dynamo_pd.{command}" + (".__main__" if command == "frontend" else "")
    importlib.import_module(module).main()

"""The gateway's configuration file (--config, TOML): models and their fallbacks, rate limits and
health checks, re-read on SIGHUP (requests in flight keep going; the next ones see the new file).
Every setting is also a flag, and a flag given a value other than its default wins over the file,
at start and at every reload (so a reload never undoes the command line).

    [health]
    interval_s = 10.0                        # --health-check-interval-s (0: none)
    timeout_s = 10.0                         # --health-check-timeout-s

    [limits]
    burst_s = 1.0                            # --rate-burst-s
    max_queued = 0                           # --max-queued-requests, per model (0: no cap)
    per_key = { requests_per_s = 2.0 }       # --key-requests-per-s, --key-tokens-per-s
    per_model = { tokens_per_s = 5000.0 }    # --model-requests-per-s, --model-tokens-per-s
    keys."sk-team-a" = { requests_per_s = 20.0 }   # this API key's own limits (--key-limit sk-team-a=20)

    [models."SmolLM2-135M-Instruct"]
    fallback = "smol-b"                      # --fallback-model SmolLM2-135M-Instruct=smol-b
    requests_per_s = 5.0                     # this model's own limits, tokens_per_s too
                                             # (--model-limit SmolLM2-135M-Instruct=5/2000)
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynamo_pd.cli import parse_limit
from dynamo_pd.frontend.health import HealthConfig
from dynamo_pd.frontend.limits import Limit, LimitsConfig


class ConfigError(ValueError):
    """A bad configuration file: the message names the file and the key."""


@dataclass
class GatewayConfig:
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    fallbacks: dict[str, str] = field(default_factory=dict)
    health: HealthConfig = field(default_factory=HealthConfig)


def _number(minimum: float, inclusive: bool = True, integer: bool = False) -> Callable[[Any, str], None]:
    def check(value: Any, key: str) -> None:
        kind = int if integer else (int, float)
        if (
            isinstance(value, bool)
            or not isinstance(value, kind)
            or value < minimum
            or (not inclusive and value == minimum)
        ):
            what = "an integer" if integer else "a number"
            raise ConfigError(f"{key} must be {what} {'>=' if inclusive else '>'} {minimum:g}, got {value!r}")
    return check


def _name(value: Any, key: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a model name, got {value!r}")


_RATE = {"requests_per_s": _number(0), "tokens_per_s": _number(0)}
_SCHEMA = {  # a table: its keys; str: any name
    "health": {"interval_s": _number(0), "timeout_s": _number(0, inclusive=False)},
    "limits": {"burst_s": _number(0, inclusive=False), "max_queued": _number(0, integer=True),
               "per_key": _RATE, "per_model": _RATE, "keys": {str: _RATE}},
    "models": {str: {"fallback": _name, **_RATE}},
}
# flag (its argparse dest) -> where it lives in the file
FLAGS = {
    "health_check_interval_s": ("health", "interval_s"),
    "health_check_timeout_s": ("health", "timeout_s"),
    "rate_burst_s": ("limits", "burst_s"),
    "max_queued_requests": ("limits", "max_queued"),
    "key_requests_per_s": ("limits", "per_key", "requests_per_s"),
    "key_tokens_per_s": ("limits", "per_key", "tokens_per_s"),
    "model_requests_per_s": ("limits", "per_model", "requests_per_s"),
    "model_tokens_per_s": ("limits", "per_model", "tokens_per_s"),
}


def _validate(value: Any, schema: Any, key: str) -> None:
    if not isinstance(schema, dict):
        return schema(value, key)
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a table, got {value!r}")
    for name, item in value.items():
        sub, where = schema.get(name, schema.get(str)), f"{key}.{name}" if key else name
        if sub is None:
            raise ConfigError(f"{where} is not a setting; {key or 'the file'} takes {', '.join(schema)}")
        _validate(item, sub, where)


def load(path: str | None, args: argparse.Namespace, flag_defaults: dict[str, Any]) -> GatewayConfig:
    """The file at `path` (none: the flags alone), validated, with the flags that differ from their
    defaults (`flag_defaults`) over it; ConfigError naming the key."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config {path}: {exc}") from None
        try:
            _validate(raw, _SCHEMA, "")
            for model, table in raw.get("models", {}).items():
                if table.get("fallback") == model:
                    raise ConfigError(f"models.{model}.fallback names the model itself")
        except ConfigError as exc:
            raise ConfigError(f"config {path}: {exc}") from None
    for dest, where in FLAGS.items():
        if getattr(args, dest) != flag_defaults[dest]:
            table = raw
            for part in where[:-1]:
                table = table.setdefault(part, {})
            table[where[-1]] = getattr(args, dest)
    for value in args.key_limit:
        key, limit = parse_limit(value)
        raw.setdefault("limits", {}).setdefault("keys", {}).setdefault(key, {}).update(limit)
    models = raw.setdefault("models", {})
    for value in args.model_limit:
        model, limit = parse_limit(value)
        models.setdefault(model, {}).update(limit)
    for pair in args.fallback_model:
        model, _, fallback = pair.partition("=")
        models.setdefault(model, {})["fallback"] = fallback
    return _build(raw.get("health", {}), raw.get("limits", {}), models)


def _build(health: dict, limits: dict, models: dict) -> GatewayConfig:
    def limit(table: dict, default: Limit = Limit()) -> Limit:  # an override's unset rate: the default's
        return Limit(
            table.get("requests_per_s", default.requests_per_s), table.get("tokens_per_s", default.tokens_per_s)
        )

    per_key, per_model = limit(limits.get("per_key", {})), limit(limits.get("per_model", {}))
    return GatewayConfig(
        limits=LimitsConfig(
            per_key=per_key,
            per_model=per_model,
            keys={k: limit(v, per_key) for k, v in limits.get("keys", {}).items()} or None,
            models={m: limit(v, per_model) for m, v in models.items() if v.keys() & _RATE.keys()} or None,
            burst_s=limits.get("burst_s", LimitsConfig.burst_s),
            max_queued=limits.get("max_queued", LimitsConfig.max_queued),
        ),
        fallbacks={m: v["fallback"] for m, v in models.items() if "fallback" in v},
        health=HealthConfig(
            health.get("interval_s", HealthConfig.interval_s), health.get("timeout_s", HealthConfig.timeout_s)
        ),
    )

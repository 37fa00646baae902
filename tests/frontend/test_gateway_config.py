"""The gateway's configuration file: validated with errors naming the file and the key (one line
at start-up, no traceback), built into limits (with per-key and per-model overrides), fallbacks
and health checks, and the flags given over it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dynamo_pd.frontend.__main__ import parse_args
from dynamo_pd.frontend.health import HealthConfig
from dynamo_pd.frontend.limits import Limit

GOOD = """
[health]
interval_s = 2.5

[limits]
burst_s = 2
max_queued = 8
per_key = { requests_per_s = 2.0 }
keys."sk-vip" = { tokens_per_s = 500 }

[models.a]
fallback = "b"
requests_per_s = 5

[models.b]
fallback = "c"
"""


def parse(tmp_path, text: str, *flags: str):
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return parse_args(["--config", str(path), *flags]), str(path)


def test_the_file_builds_limits_with_overrides_fallbacks_and_health(tmp_path):
    args, _ = parse(tmp_path, GOOD)
    config = args.gateway
    assert config.health == HealthConfig(interval_s=2.5, timeout_s=10.0)
    assert config.fallbacks == {"a": "b", "b": "c"}
    limits = config.limits
    assert (limits.burst_s, limits.max_queued, limits.per_key, limits.per_model) == (2, 8, Limit(2.0, 0.0), Limit())
    assert limits.keys == {"sk-vip": Limit(requests_per_s=2.0, tokens_per_s=500)}  # unset: the per-key default's
    assert limits.models == {"a": Limit(requests_per_s=5)}


def test_flags_given_win_over_the_file(tmp_path):
    args, _ = parse(tmp_path, GOOD, "--key-requests-per-s", "7", "--fallback-model", "a=z",
                    "--health-check-timeout-s", "3", "--health-check-interval-s", "10")
    config = args.gateway
    assert config.limits.per_key == Limit(7.0, 0.0) and config.fallbacks == {"a": "z", "b": "c"}
    # a flag at its default says nothing: the file's 2.5 stays (the rule: non-default flags win)
    assert config.health == HealthConfig(interval_s=2.5, timeout_s=3.0)


def test_every_limit_in_the_file_is_also_a_flag(tmp_path):
    from_file = parse(tmp_path, GOOD)[0].gateway.limits
    flags = parse_args(["--rate-burst-s", "2", "--max-queued-requests", "8", "--key-requests-per-s", "2",
                        "--key-limit", "sk-vip=2/500", "--model-limit", "a=5"]).gateway.limits
    assert flags == from_file
    over = parse(tmp_path, GOOD, "--key-limit", "sk-vip=9", "--model-limit", "b=1/100")[0].gateway.limits
    assert over.keys == {"sk-vip": Limit(9.0, 500)}  # the flag's rate over the file's, its unset one kept
    assert over.models == {"a": Limit(5.0, 0.0), "b": Limit(1.0, 100.0)}


@pytest.mark.parametrize("flag, value", [("--key-limit", "sk=fast"), ("--key-limit", "=3"),
                                         ("--model-limit", "a=-1"), ("--model-limit", "a=1/x"), ("--model-limit", "a")])
def test_a_bad_limit_flag_is_one_line_naming_it(flag, value, capsys):
    with pytest.raises(SystemExit):
        parse_args([flag, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: {flag}: expected NAME=REQUESTS_PER_S[/TOKENS_PER_S] with rates >= 0, got {value!r}" in err


@pytest.mark.parametrize("text, message", [
    ("[limits]\nburst_s = 0\n", "limits.burst_s must be a number > 0, got 0"),
    ("[limits]\nper_key = { requests_per_s = -1 }\n", "limits.per_key.requests_per_s must be a number >= 0, got -1"),
    ("[limits]\nmax_queued = 1.5\n", "limits.max_queued must be an integer >= 0, got 1.5"),
    ('[limits.keys.k1]\nrequests_per_s = "fast"\n', "limits.keys.k1.requests_per_s must be a number >= 0, got 'fast'"),
    ("[health]\ninterval = 3\n", "health.interval is not a setting; health takes interval_s, timeout_s"),
    ("[healthz]\n", "healthz is not a setting; the file takes health, limits, models"),
    ("[models.a]\nfallback = 3\n", "models.a.fallback must be a model name, got 3"),
    ("[models.a]\nfallback = \"a\"\n", "models.a.fallback names the model itself"),
    ("[models.a]\nrequests_per_s = true\n", "models.a.requests_per_s must be a number >= 0, got True"),
    ("models = 3\n", "models must be a table, got 3"),
    ("[limits\n", "Expected ']'"),
])
def test_errors_name_the_file_and_the_key(tmp_path, text, message):
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exited:
        parse_args(["--config", str(path)])
    assert str(exited.value).startswith(f"error: config {path}: ") and message in str(exited.value)


def test_a_bad_file_stops_the_frontend_with_one_line(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text("[limits]\nburst_s = -2\n")
    done = subprocess.run([sys.executable, "-m", "dynamo_pd.frontend", "--config", str(path), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == f"error: config {path}: limits.burst_s must be a number > 0, got -2"
    missing = subprocess.run([sys.executable, "-m", "dynamo_pd.frontend", "--config", str(tmp_path / "none.toml")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert "none.toml" in missing.stderr and "Traceback" not in missing.stderr

"""benchmarks/vs_dynamo.py's own parts: the CPU it reads from /proc, the frontends it finds, the model folder it
gives Dynamo's mocker, its flags. The comparison itself needs aiperf and Dynamo's venv: benchmarks/regenerate.sh."""

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks.vs_dynamo import cpu_seconds, dynamo_model_dir, our_frontends, parse_args
from dynamo_pd.model_store import resolve_model


def test_cpu_seconds_count_what_a_process_burned():
    spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                             "while time.process_time() < end: pass\nimport sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while cpu_seconds([spin.pid]) < 0.45 and time.monotonic() < deadline:
            time.sleep(0.05)
        burned = cpu_seconds([spin.pid])
        assert 0.45 <= burned < 5
        assert cpu_seconds([spin.pid, 2 ** 22 + 1]) == burned  # a process gone (or never there) adds nothing
    finally:
        spin.communicate(b"")


def test_our_frontends_are_found_by_module_and_port():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "-m", "dynamo_pd.frontend", "--port"]
    ours, other = (subprocess.Popen([*sleeper, port]) for port in ("48123", "48124"))
    try:
        assert our_frontends(48123) == [ours.pid]
        assert os.getpid() not in our_frontends(48123)
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


@pytest.mark.slow  # the served model's files
def test_dynamos_mocker_gets_our_model_with_its_architecture(tmp_path):
    folder = dynamo_model_dir(tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"]
    source = resolve_model(None)
    assert {f.name for f in folder.iterdir()} == {f.name for f in source.iterdir() if f.is_file()}
    assert (folder / "tokenizer.json").resolve() == (source / "tokenizer.json").resolve()


@pytest.mark.parametrize("argv, message", [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
                                           (["--mocker-speedup", "0"], "--mocker-speedup must be > 0")])
def test_bad_flags_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_quick_takes_one_round_of_fewer_requests():
    quick, full = parse_args(["--quick"]), parse_args([])
    assert (quick.rounds, quick.requests) == (1, 400) and (full.rounds, full.requests) == (3, 1200)
    assert full.speedup == 1.0  # the session's times are real ones: the mockers' clocks are theirs

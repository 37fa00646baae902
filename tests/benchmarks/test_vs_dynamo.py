"""benchmarks/vs_dynamo.py's own parts: the CPU it reads from /proc, the frontends it finds, the model folder it
gives Dynamo's mocker, the one engine timing both mockers read, its flags. The comparison itself needs aiperf
and Dynamo's venv: benchmarks/regenerate.sh."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks.vs_dynamo import (busiest_thread, cpu_seconds, dynamo_model_dir, dynamo_tables, one_timing,
                                  our_frontends, parse_args, thread_seconds)
from dynamo_pd.engines.mocker.profile import Profile, h100_llama8b
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


def _bilinear(xs, ys, table, x, y):
    """What Dynamo's mocker does with its decode table (ndarray_interp's Bilinear), inside the grid."""
    i = min(np.searchsorted(xs, x, side="right") - 1, len(xs) - 2)
    j = min(np.searchsorted(ys, y, side="right") - 1, len(ys) - 2)
    tx, ty = (x - xs[i]) / (xs[i + 1] - xs[i]), (y - ys[j]) / (ys[j + 1] - ys[j])
    low = table[i, j] + ty * (table[i, j + 1] - table[i, j])
    high = table[i + 1, j] + ty * (table[i + 1, j + 1] - table[i + 1, j])
    return low + tx * (high - low)


def test_dynamos_tables_time_a_decode_step_as_our_profile_does():
    profile = h100_llama8b()
    t = dynamo_tables(profile)
    assert t["decode_itl"].shape == (len(t["decode_active_kv_tokens"]), len(t["decode_context_length"]))
    worst = 0.0
    for batch in (1, 3, 7, 16, 33, 64):
        for context in (100, 700, 1500, 3000, 4100, 7900):
            got = _bilinear(t["decode_active_kv_tokens"], t["decode_context_length"], t["decode_itl"],
                            batch * context, context)
            worst = max(worst, abs(got / profile.decode_time_ms(batch, context) - 1))
    assert worst < 0.02
    for tokens in (64, 1000, 2048, 4160):
        assert np.interp(tokens, t["prefill_isl"], t["prefill_ttft_ms"]) == pytest.approx(
            profile.prefill_time_ms(tokens, 0))


def test_one_timing_writes_both_mockers_files_prefill_by_new_tokens(tmp_path):
    ours, theirs = one_timing(tmp_path)
    profile = Profile.load(ours)
    assert profile.prefill_time_ms(64, 4096) == pytest.approx(h100_llama8b().prefill_time_ms(64, 0))
    assert profile.decode_time_ms(16, 4000) == h100_llama8b().decode_time_ms(16, 4000)
    with np.load(theirs) as npz:  # the five arrays Dynamo's mocker checks for (is_mocker_format_npz)
        assert set(npz.files) == {"prefill_isl", "prefill_ttft_ms", "decode_active_kv_tokens",
                                  "decode_context_length", "decode_itl"}
        assert np.interp(4160, npz["prefill_isl"], npz["prefill_ttft_ms"]) == pytest.approx(
            profile.prefill_time_ms(4160, 0))


@pytest.mark.parametrize("argv, message", [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
                                           (["--mocker-speedup", "0"], "--mocker-speedup must be > 0"),
                                           (["--workloads", "prefix,chat"], "--workloads: unknown chat")])
def test_bad_flags_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_quick_takes_one_round_of_fewer_requests():
    quick, full = parse_args(["--quick"]), parse_args([])
    assert (quick.rounds, quick.requests) == (1, 400) and (full.rounds, full.requests) == (3, 1200)
    assert full.speedup == 1.0  # the session's times are real ones: the mockers' clocks are theirs


def test_the_busiest_thread_is_the_one_that_burned():
    spin = subprocess.Popen([sys.executable, "-c", "import sys, threading, time\ndef burn():\n"
                             "    end = time.thread_time() + 0.5\n    while time.thread_time() < end: pass\n"
                             "sys.stdin.readline()\nthreading.Thread(target=burn).start()\nsys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        before = thread_seconds([spin.pid])
        spin.stdin.write(b"go\n")
        spin.stdin.flush()
        deadline = time.monotonic() + 30
        while busiest_thread(before, thread_seconds([spin.pid])) < 0.45 and time.monotonic() < deadline:
            time.sleep(0.05)
        after = thread_seconds([spin.pid])
        assert 0.45 <= busiest_thread(before, after) <= cpu_seconds([spin.pid]) < 5
        assert sorted(after[t] - before.get(t, 0.0) for t in after)[-2] < 0.3  # the main thread only waited
        assert busiest_thread({}, {}) == 0.0
    finally:
        spin.communicate(b"")

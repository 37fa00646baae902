"""benchmarks/deploy.py: a benchmark that is sent SIGTERM still stops what it started."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_runs_the_benchmarks_cleanup(tmp_path):
    """CI's timeout sends SIGTERM: the `finally` that stops a benchmark's deployment must run, as on Ctrl-C."""
    done = tmp_path / "stopped"
    code = textwrap.dedent(f"""
        import time
        from benchmarks import deploy
        deploy.stop_on_sigterm()
        try:
            print("running", flush=True)
            time.sleep(60)
        finally:
            open({str(done)!r}, "w").write("the deployment would be stopped here")
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "running"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert done.exists() and time.monotonic() - started < 30
    finally:
        proc.kill()
        proc.wait()

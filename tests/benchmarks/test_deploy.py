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


def test_a_deployment_routes_with_serves_default_policy_unless_it_names_one():
    """Benchmarks measure what users get: the kv_tiers comparison said "the time router" while every
    Deployment passed --router-policy kv (no peer pull was ever planned: only `time` weighs peers)."""
    from benchmarks import deploy
    from dynamo_pd import serve
    from router.service import RouterConfig

    def policy(d: deploy.Deployment) -> str:
        argv = deploy.command(d, port=8000, discovery_port=8001)
        args, _ = serve.parse_args(argv[argv.index("dynamo_pd.serve") + 1:])
        return args.router_policy

    assert policy(deploy.Deployment("default", "mocker", aggregated=2)) == RouterConfig.policy == "time"
    assert policy(deploy.Deployment("kv", "mocker", aggregated=2, router_policy="kv")) == "kv"

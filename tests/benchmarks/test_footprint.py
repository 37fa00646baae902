"""benchmarks/footprint.py, run as docs/benchmarks.md runs it (on the mocker here, the lightest deployment):
it starts serve, gets an answer, and prints every process of the deployment with its resident memory."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_footprint_lists_every_process_of_the_deployment_with_its_memory(model_dir):
    argv = ["--", "--aggregated", "2", "--engine", "mocker"]
    done = subprocess.run([sys.executable, "benchmarks/footprint.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Command: `python benchmarks/footprint.py {' '.join(argv)}`" in done.stdout
    assert re.search(r"^Ready \(/v1/models answers\) in [\d.]+ s; the first chat answered at [\d.]+ s", done.stdout,
                     re.M), done.stdout
    rows = {name.split()[0]: int(mib) for name, mib in re.findall(r"^\| `?([^`|]+?)`? \| (\d+) \|$", done.stdout,
                                                                  re.M)}
    assert set(rows) == {"dynamo_pd.serve", "dynamo_pd.frontend", "dynamo_pd.mocker", "total"}, done.stdout
    assert all(mib > 10 for mib in rows.values()), rows
    assert abs(rows.pop("total") - sum(rows.values())) <= len(rows), rows  # each row rounded

"""The Berkeley Function Calling Leaderboard's simple, multiple and parallel categories (bfcl-eval's own data
and AST checker) through this project's frontend and through vLLM's OpenAI server, on the same model
directory, the same chat template (for SmolLM2, whose template has no tools section, both get the Hermes
tool prompt: ours as the frontend's fallback, vLLM's from `chatml_tools.jinja`, the same text token for
token, as tests/frontend/test_tools_http.py checks) and the same parser (hermes), greedy. Prints both
scores side by side and writes them with the command, commit and host.

    pip install --no-deps --target .bfcl bfcl-eval    # its data and checker, not its dependencies
    python -m benchmarks.bfcl --bfcl-path .bfcl --limit 50 [--concurrency 8] [--tool-choice required]

Each case's row goes to <out>/rows/<server>-<category>.jsonl as it ends (a long run stopped part way keeps
them); the table and results.json are written at the end.

bfcl-eval's checker module imports its whole model registry (every vendor's SDK) for one flag, whether a
model's calls name `a.b` as `a_b`: the registry is given the one entry it reads here, True, as for
OpenAI's function calling (tool names cannot hold a dot). Tools are converted as bfcl's `convert_to_tool`
does for an OpenAI-style model: dots to underscores, its types to JSON schema's (bfcl's
GORILLA_TO_OPENAPI).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks import deploy
from benchmarks.provenance import collect
from dynamo_pd.model_store import default_model_path
from dynamo_pd.runtime.ports import free_port

CATEGORIES = ("simple_python", "multiple", "parallel")
TEMPLATE = Path(__file__).resolve().parent.parent / "dynamo_pd" / "frontend" / "tools" / "chatml_tools.jinja"
CHECKER_MODEL = "openai-compatible"
_READY_TIMEOUT_S = 600.0


def load_bfcl(path: str | None) -> types.SimpleNamespace:
    if path:
        sys.path.insert(0, str(Path(path).resolve()))
    registry = types.ModuleType("bfcl_eval.constants.model_config")
    registry.MODEL_CONFIG_MAPPING = {CHECKER_MODEL: types.SimpleNamespace(underscore_to_dot=True)}
    sys.modules["bfcl_eval.constants.model_config"] = registry
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    import bfcl_eval

    return types.SimpleNamespace(data=Path(bfcl_eval.__file__).parent / "data", checker=ast_checker,
                                 python=Language.PYTHON, types=GORILLA_TO_OPENAPI)


def cases(bfcl: types.SimpleNamespace, category: str, limit: int) -> list[tuple[dict, dict]]:
    def rows(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    questions = rows(bfcl.data / f"BFCL_v4_{category}.json")[:limit]
    answers = {row["id"]: row for row in rows(bfcl.data / "possible_answer" / f"BFCL_v4_{category}.json")}
    return [(q, answers[q["id"]]) for q in questions]


def openai_tools(functions: list[dict], mapping: dict[str, str]) -> list[dict]:
    def cast(properties: dict) -> dict:
        out = {}
        for name, schema in properties.items():
            schema = dict(schema)
            schema["type"] = mapping.get(schema.get("type"), "string")
            if schema["type"] == "array" and isinstance(schema.get("items"), dict):
                schema["items"] = cast({"_": schema["items"]})["_"]
            if schema["type"] == "object" and isinstance(schema.get("properties"), dict):
                schema["properties"] = cast(schema["properties"])
            out[name] = schema
        return out

    tools = []
    for function in json.loads(json.dumps(functions)):
        function["name"] = re.sub(r"\.", "_", function["name"])
        function["parameters"]["type"] = "object"
        function["parameters"]["properties"] = cast(function["parameters"].get("properties", {}))
        tools.append({"type": "function", "function": function})
    return tools


def served(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def score(url: str, model: str, bfcl: types.SimpleNamespace, category: str, limit: int, max_tokens: int,
          tool_choice: str, concurrency: int, rows_path: Path) -> dict[str, Any]:
    """The category's accuracy through the server at `url`, `concurrency` cases in flight; each case's row is
    appended to `rows_path` as it ends, so a run stopped part way keeps what it asked."""
    todo = cases(bfcl, category, limit)
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    started = time.monotonic()
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    rows_path.unlink(missing_ok=True)

    def ask(client: httpx.Client, question: dict, answer: dict) -> None:
        body = {"model": model, "messages": question["question"][0], "temperature": 0,
                "max_tokens": max_tokens, "tools": openai_tools(question["function"], bfcl.types),
                "tool_choice": tool_choice}
        reply = client.post("/v1/chat/completions", json=body)
        reply.raise_for_status()
        message = reply.json()["choices"][0]["message"]
        try:
            calls = [{c["function"]["name"]: json.loads(c["function"]["arguments"])}
                     for c in message.get("tool_calls") or []]
            verdict = bfcl.checker(question["function"], calls, answer["ground_truth"], bfcl.python,
                                   category, CHECKER_MODEL) if calls else {"valid": False}
        except ValueError:
            verdict = {"valid": False}
        row = {"id": question["id"], "valid": bool(verdict["valid"]), "content": message.get("content"),
               "tool_calls": message.get("tool_calls")}
        with lock:
            rows.append(row)
            with rows_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            right = sum(r["valid"] for r in rows)
            print(f"{url} {category}: {len(rows)}/{len(todo)}, {right} right, {time.monotonic() - started:.0f} s",
                  flush=True)

    with httpx.Client(base_url=url, timeout=600) as client, ThreadPoolExecutor(concurrency) as pool:
        for done in [pool.submit(ask, client, question, answer) for question, answer in todo]:
            done.result()  # a failed request ends the run with its error
    rows.sort(key=lambda r: r["id"])
    right = sum(r["valid"] for r in rows)
    return {"accuracy": 100.0 * right / max(1, len(rows)), "cases": len(rows), "rows": rows}


@contextlib.contextmanager
def server(name: str, argv: list[str], port: int, log_dir: Path) -> Iterator[str]:
    """A server's base URL once its /v1/models answers (a model is served); SIGINT stops it on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_RPC_BASE_PATH": str(log_dir), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with (log_dir / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not _up(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: {name} did not come up (log: {log_dir / f'{name}.log'})")
            time.sleep(1)  # polling a child process's port: there is nothing to wait on
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ours(model_dir: Path, log_dir: Path) -> contextlib.AbstractContextManager[str]:
    port = free_port()
    return server("dynamo-pd", [sys.executable, "-m", "dynamo_pd.serve", "--aggregated", "1", "--model",
                                str(model_dir), "--port", str(port), "--discovery-port", str(free_port()),
                                "--tool-call-parser", "hermes"], port, log_dir)


def vllm(model_dir: Path, log_dir: Path, concurrency: int) -> contextlib.AbstractContextManager[str]:
    port = free_port()
    return server("vllm", [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", model_dir.name, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", str(concurrency), "--enforce-eager",
        "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--uvicorn-log-level", "warning"], port, log_dir)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/v1/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.bfcl", description=__doc__.split(". ")[0])
    p.add_argument("--bfcl-path", default=None, help="where bfcl_eval is (pip install --no-deps --target)")
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct's)")
    p.add_argument("--limit", type=int, default=50, help="cases per category")
    p.add_argument("--categories", default=",".join(CATEGORIES))
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8, help="cases in flight on each server")
    p.add_argument("--tool-choice", default="auto", choices=["auto", "required"],
                   help="auto (BFCL's protocol) or required: each server's grammar makes the output a call, so a "
                        "model too small to call on its own is scored on the calls' names and arguments")
    p.add_argument("--out", default="benchmarks/results/bfcl")
    args = p.parse_args(argv)
    provenance = collect("python -m benchmarks.bfcl", argv)  # the commit the run starts on
    deploy.stop_on_sigterm()
    bfcl = load_bfcl(args.bfcl_path)
    model_dir = Path(args.model) if args.model else default_model_path()
    out = Path(args.out)
    categories = args.categories.split(",")
    results: dict[str, dict[str, Any]] = {}
    if args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    for name, start in (("dynamo-pd", lambda: ours(model_dir, out / "logs")),
                        ("vllm", lambda: vllm(model_dir, out / "logs", args.concurrency))):
        with start() as url:
            results[name] = {c: score(url, served(url), bfcl, c, args.limit, args.max_tokens, args.tool_choice,
                                      args.concurrency, out / "rows" / f"{name}-{c}.jsonl") for c in categories}
    lines = ["| category | dynamo-pd | vLLM | cases |", "|---|---|---|---|"]
    for c in categories:
        ours_c, theirs = results["dynamo-pd"][c], results["vllm"][c]
        lines.append(f"| {c} | {ours_c['accuracy']:.1f} | {theirs['accuracy']:.1f} | {ours_c['cases']} |")
    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(provenance.markdown() + "\n\n" + table + "\n")
    record = {"provenance": vars(provenance), "host": socket.gethostname(), "results": results}
    (out / "results.json").write_text(json.dumps(record, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()

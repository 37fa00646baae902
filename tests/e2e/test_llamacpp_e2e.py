"""llama.cpp workers as `python -m dynamo_pd.serve --engine llamacpp` starts them, driven by the openai
client: 1 prefill + 1 decode worker (the sequence state pulled, and pushed) give the aggregated worker's
greedy text with and without stop strings, streamed and not; the same deployment with the state dropped on
import (the test-only switch) does not; and the KV-aware router sends a repeated long prefix to the
llama.cpp worker that holds it."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import MODEL, Deployment, start_deployment
from tests.e2e.test_parity import fallbacks, run_everywhere, stop_strings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'dynamo-pd[llamacpp]')")

# no health-check canaries: a canary would replace the prefix a llama.cpp context holds between the cases
LLAMACPP = [
    "--engine",
    "llamacpp",
    "--max-model-len",
    "2048",
    "--kv-cache-memory-gb",
    "0.25",
    "--health-check-interval-s",
    "0",
]
PROMPTS = [
    "List three colors:",
    "User: What is the capital of France?\n\nAssistant:",
    "Le café et la crème brûlée, en français:",
    "Here is a long list of fruits, one per line, with their colours: apple red, banana yellow, "
    "cherry red, grape purple, lemon yellow, lime green, orange orange, plum purple, and",
]


def stopped(deployments: dict[str, Deployment]) -> None:
    codes = {name: d.stop() for name, d in deployments.items()}
    assert all(code == 0 for c in codes.values() for code in c.values()), codes


def greedy_cases(deployments: dict[str, Deployment], client_for) -> tuple[dict, list]:
    """Each prompt's greedy output and first token on every deployment, then stop strings cut from
    what the aggregated worker said (hit by the first token, straddling it, later, never)."""
    probes = [({"prompt": p, "max_tokens": n, "temperature": 0}, n == 1) for p in PROMPTS for n in (16, 1)]
    done = run_everywhere(deployments, client_for, probes)
    said = [r["text"] for r in done["aggregated"]]
    cases = [({"prompt": prompt, "max_tokens": 16, "temperature": 0, "stop": stop}, (p + i) % 2 == 0)
             for p, prompt in enumerate(PROMPTS) for i, stop in enumerate(stop_strings(said[2 * p], said[2 * p + 1]))]
    rest = run_everywhere(deployments, client_for, cases)
    return {name: done[name] + rest[name] for name in deployments}, probes + cases


def test_prefill_and_decode_move_the_sequence_state_and_give_the_aggregated_text(tmp_path_factory,
                                                                              openai_client_factory, monkeypatch):
    deployments = {}
    try:
        for name, args in (("aggregated", ["--aggregated", "1"]), ("pull", ["--prefill", "1", "--decode", "1"]),
                           ("push", ["--prefill", "1", "--decode", "1", "--kv-handoff", "push"])):
            deployments[name] = start_deployment(tmp_path_factory.mktemp(f"llamacpp-{name}"), *args, *LLAMACPP)
        monkeypatch.setenv("DYNAMO_PD_TEST_DROP_SEQ_STATE", "1")  # read by the control's decode worker
        deployments["control"] = start_deployment(tmp_path_factory.mktemp("llamacpp-control"), "--prefill", "1",
                                                  "--decode", "1", *LLAMACPP)
        results, cases = greedy_cases(deployments, openai_client_factory)
        assert len(cases) >= 20
        for mode in ("pull", "push"):
            differ = [(body, a, b) for (body, _), a, b in zip(cases, results["aggregated"], results[mode]) if a != b]
            assert not differ, (mode, differ[:3])
            assert deployments[mode].metric("dynamo_pd_kv_transfer_bytes_total") > 0
            assert not any(fallbacks(deployments[mode]).values()), fallbacks(deployments[mode])
        assert any(r["finish"] == "stop" for r in results["aggregated"]), "a stop string ended some case"
        # Without the state the decode side continues from the first token alone: the texts part.
        longer = [i for i, (body, _) in enumerate(cases) if body["max_tokens"] > 1 and "stop" not in body]
        differ = [i for i in longer if results["control"][i]["text"] != results["aggregated"][i]["text"]]
        assert len(differ) == len(longer), [results["control"][i]["text"] for i in longer]
        assert not any(fallbacks(deployments["control"]).values())  # the state moved; only its import was skipped
    finally:
        stopped(deployments)


def holds(deployment: Deployment, blocks: int) -> bool:
    """The router indexes `blocks` blocks for some worker (each topic's prompts have their own count)."""
    return any(deployment.metric("dynamo_pd_router_indexed_blocks", worker=w) == blocks
               for w in ("aggregated-0", "aggregated-1"))


def test_the_kv_router_sends_a_repeated_prefix_to_the_llamacpp_worker_that_holds_it(tmp_path, openai_client_factory):
    """Each llama.cpp worker holds one sequence: per topic, a cold request, then one sharing its long
    prefix, served from cache only where it went to the same worker (half the time by chance)."""
    deployment = start_deployment(tmp_path, "--aggregated", "2", "--router-policy", "kv", *LLAMACPP)
    try:
        client = openai_client_factory(deployment)
        for n, topic in enumerate(("rivers", "mountains", "deserts", "forests", "glaciers")):
            prefix = f"Here is a long document about {topic}. " + " ".join(f"{topic}-{i}" for i in range(40 + 12 * n))
            first = client.completions.create(model=MODEL, prompt=prefix, max_tokens=1, temperature=0)
            assert first.usage.prompt_tokens > 150
            deployment.wait_for(lambda: holds(deployment, first.usage.prompt_tokens // 16), 20,
                                "the KV events of the first request reached the router")
            second = client.completions.create(
                model=MODEL, prompt=prefix + " And here is one more line, longer than a whole block of tokens.",
                max_tokens=1, temperature=0)
            cached = second.usage.prompt_tokens_details.cached_tokens
            assert cached >= first.usage.prompt_tokens - 1, (topic, cached, first.usage.prompt_tokens)
            deployment.wait_for(lambda: holds(deployment, second.usage.prompt_tokens // 16), 20,
                                "the KV events of the second request reached the router")
    finally:
        stopped({"kv": deployment})

"""Output tokens/s of the native engine with a JSON schema against unconstrained, at batch 1, 8 and 32.

    python benchmarks/structured_throughput.py [--max-tokens 64] [--batches 1 8 32] [--threads N] [--rounds 3]

One engine (one process, the SmolLM2 default unless --model) runs every mode, alternating, so the machine's
noise hits them alike (each pair's order swapped every round); each cell keeps its best round, and each ratio is
given both from the best rounds and as the median of the rounds' own ratios (a pair runs back to back, so this
one is the less bothered by the machine's drift, which moved one mode's rate by up to 30% between rounds).
Greedy and sampled (temperature 1, a seed per request) are measured apart: a row needs the grammar's mask only
where its first pick is one the grammar refuses (sampler.py), which differs between them. Every request
generates exactly --max-tokens tokens: unconstrained ones ignore EOS, and the schema (an array of at least 64
small objects: strings of at most 12 characters, integers, booleans, so the grammar is never done before
max_tokens) asks for more than that. The grammar is compiled before the timings (a new schema's compile is once
per engine, when its first request arrives). A batch is timed end to end, prefill included. Prints where the
figures came from, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.engine_throughput import make_prompts, wait_for_quiet  # noqa: E402
from benchmarks.provenance import collect  # noqa: E402

SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "required": ["id", "name", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                   "name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(collect("python benchmarks/structured_throughput.py", sys.argv[1:]).markdown(), flush=True)

    import torch

    from dynamo_pd.llm import LLM
    from dynamo_pd.protocol import Guided, SamplingParams, StopConditions

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, enable_prefix_caching=False, max_num_seqs=max(args.batches), max_model_len=1024,
              kv_cache_memory_gb=0.5)
    prompts = make_prompts(llm.tokenizer, max(args.batches))
    guided = Guided(kind="json_schema", spec=json.dumps(SCHEMA))
    modes = {"unconstrained": SamplingParams(temperature=0),
             "json schema": SamplingParams(temperature=0, guided=guided),
             "unconstrained, sampled": SamplingParams(temperature=1.0, seed=1),
             "json schema, sampled": SamplingParams(temperature=1.0, seed=1, guided=guided)}
    stop = StopConditions(max_tokens=args.max_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.core.grammars.compile(guided)
    print(f"schema compiled in {time.perf_counter() - started:.2f} s (once per engine)", flush=True)
    for sampling in modes.values():  # warm-up: allocator, kernels, lazy imports
        llm.generate(prompts[:2], sampling, StopConditions(max_tokens=4, ignore_eos=True))

    rates: dict[str, dict[int, list[float]]] = {mode: {b: [] for b in args.batches} for mode in modes}
    for round_ in range(args.rounds):
        order = list(modes) if round_ % 2 == 0 else [list(modes)[i] for i in (1, 0, 3, 2)]  # each pair's order swaps
        for batch in args.batches:
            for mode in order:
                wait_for_quiet()
                start = time.perf_counter()
                results = llm.generate(prompts[:batch], modes[mode], stop)
                rate = batch * args.max_tokens / (time.perf_counter() - start)
                assert all(len(r.token_ids) == args.max_tokens for r in results), mode
                if mode.startswith("json schema"):
                    assert all(r.text.startswith("[{") for r in results), results[0].text
                rates[mode][batch].append(rate)
                print(f"round {round_ + 1}: {mode} batch {batch}: {rate:.1f} tok/s", flush=True)

    print()
    print("| mode | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for mode in modes:
        print(f"| {mode} | " + " | ".join(f"{max(rates[mode][b]):.1f}" for b in args.batches) + " |")
    for suffix in ("", ", sampled"):
        schema, free = rates["json schema" + suffix], rates["unconstrained" + suffix]
        best = [max(schema[b]) / max(free[b]) for b in args.batches]
        paired = [statistics.median(x / y for x, y in zip(schema[b], free[b])) for b in args.batches]
        print(f"| schema / unconstrained{suffix}, best rounds | " + " | ".join(f"{r:.3f}" for r in best) + " |")
        print(f"| schema / unconstrained{suffix}, median of the rounds' pairs | "
              + " | ".join(f"**{r:.3f}**" for r in paired) + " |")


if __name__ == "__main__":
    main()

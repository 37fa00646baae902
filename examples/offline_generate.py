"""Offline batch generation on the native engine, no servers:  python examples/offline_generate.py"""

from dynamo_pd.llm import LLM
from dynamo_pd.protocol import SamplingParams, StopConditions

llm = LLM()  # SmolLM2-135M-Instruct, fetched and converted once
greedy, short = SamplingParams(temperature=0), StopConditions(max_tokens=16)
story = ("Once upon a time, in a small village by the sea, there lived an old fisherman who every morning "
         "rowed out before dawn and came back with a story instead of fish. One day he said:")
prompts = [story, "Three colours of the rainbow are"]
for prompt, result in zip(
    prompts + [story], llm.generate(prompts, greedy, short) + llm.generate([story], greedy, short)
):
    # the story's second run reuses the KV blocks of its first: see cached_tokens
    print(f"{prompt[:24]!r} -> {result.text!r} ({result.usage.prompt_tokens} prompt tokens, "
          f"{result.usage.cached_tokens} cached)")

"""Offline batch inference on the native engine, like vLLM's `LLM`:

    llm = LLM()  # the embedded default model
    results = llm.generate(["Hello, my name is"], SamplingParams(temperature=0), StopConditions(max_tokens=32))
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from dynamo_pd.engines.base import EngineConfig, EngineRole
from dynamo_pd.engines.native.core import EngineCore
from dynamo_pd.protocol import EngineRequest, SamplingParams, StopConditions, TokenLogprob, Usage


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None


class LLM:
    def __init__(self, model: str | None = None, **engine_config: Any):
        self.core = EngineCore(EngineConfig(model=model, role=EngineRole.AGGREGATED, **engine_config))
        self.tokenizer = self.core.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling: SamplingParams | None = None,
        stop: StopConditions | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion; results come back in prompt order."""
        sampling = sampling or SamplingParams()
        stop = stop or StopConditions()
        requests = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request = EngineRequest(request_id=f"llm-{next(self._ids)}", prompt_token_ids=ids,
                                    sampling=sampling, stop=stop)
            self.core.check_request(request)  # reject a bad prompt before any work starts
            requests.append(request)
        results = {r.request_id: GenerationResult(prompt_token_ids=r.prompt_token_ids) for r in requests}
        try:
            for request in requests:
                self.core.add_request(request)
            while self.core.has_work:
                for out in self.core.step():
                    result = results[out.request_id]
                    result.token_ids += out.token_ids
                    result.text += out.text
                    if out.logprobs is not None:
                        result.logprobs = (result.logprobs or []) + out.logprobs
                    if out.finish_reason is not None:
                        result.finish_reason, result.stop_reason = out.finish_reason, out.stop_reason
                        result.usage = out.usage
        finally:  # an interrupted batch leaves no request (or block) behind
            for rid in results:
                self.core.end_request(rid, "abort")
        return list(results.values())

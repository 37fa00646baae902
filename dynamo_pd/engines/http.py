"""Any OpenAI-compatible server (vLLM's, llama.cpp's, TGI, Triton's OpenAI frontend, another
dynamo-pd) as an aggregated pool member: the worker forwards each request to `--url`'s
/completions and streams the answer back, so the frontend's routing, load, limits and metrics
apply to it like to any worker.

    python -m dynamo_pd.aggregated --engine http --url http://127.0.0.1:8080/v1 \
        --model <the model's HF directory or .gguf: its tokenizer> [--remote-model NAME] [--served-model-name NAME]

The frontend tokenizes with the model's tokenizer; the prompt goes to the server as text (every
OpenAI-compatible server takes text; not all take token ids) and must survive the round trip.
Each streamed text is tokenized again for its token ids, which count tokens (TTFT, usage when the
server reports none) but are not the server's own ids. Such a server publishes no KV events: the
router predicts its cache from its own placements (router.approx). Logprobs are refused.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from dynamo_pd.engines.base import Engine, EngineConfig, EngineRole
from dynamo_pd.model_store import resolve_model
from dynamo_pd.protocol import EngineOutput, EngineRequest, InvalidRequestError, PromptTooLongError, Usage
from dynamo_pd.runtime import RequestContext


class HttpEngine(Engine):
    def __init__(self, config: EngineConfig):
        if config.role is not EngineRole.AGGREGATED:
            raise SystemExit(f"error: --engine http runs aggregated workers only, not {config.role.value}: "
                             "a remote server's KV cannot be handed over")
        url = config.extra.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise SystemExit(f"error: --engine http needs --url http://HOST:PORT/v1 (the server's OpenAI base URL), "
                             f"got {url!r}")
        self.config, self.role, self.url = config, config.role, url.rstrip("/")
        self.remote_model: str = str(config.extra.get("remote_model", ""))
        self.timeout_s = float(config.extra.get("request_timeout_s", 600.0))
        self._client: httpx.AsyncClient | None = None
        self._tokenizer: Any = None
        self._max_model_len = 0

    async def start(self) -> None:
        from transformers import AutoConfig, AutoTokenizer

        def load():
            model_dir = resolve_model(self.config.model)
            context = AutoConfig.from_pretrained(model_dir).max_position_embeddings
            return AutoTokenizer.from_pretrained(model_dir), context

        self._tokenizer, context = await asyncio.to_thread(load)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                                         limits=httpx.Limits(max_connections=self.config.max_num_seqs))
        try:
            response = await self._client.get(f"{self.url}/models")
            response.raise_for_status()
            models = response.json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            await self._client.aclose()
            raise SystemExit(f"error: the server at --url {self.url} does not answer GET /models: {exc}") from None
        if not self.remote_model:
            self.remote_model = models[0]["id"]
        served = {m["id"]: m for m in models}
        if self.remote_model not in served:
            await self._client.aclose()
            raise SystemExit(f"error: the server at --url {self.url} serves {', '.join(served)}, not "
                             f"--remote-model {self.remote_model!r}")
        remote_len = served[self.remote_model].get("max_model_len") or context  # vLLM says; others: the model's
        self._max_model_len = min(self.config.max_model_len or remote_len, remote_len)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def _body(self, request: EngineRequest) -> dict[str, Any]:
        s, stop = request.sampling, request.stop
        if s.logprobs is not None:
            raise InvalidRequestError("the http engine does not return logprobs", "logprobs")
        self.check_guided(request)  # none: the server behind it may not enforce what it is sent
        if len(request.prompt_token_ids) + stop.max_tokens > self.max_model_len:
            raise PromptTooLongError(f"prompt ({len(request.prompt_token_ids)} tokens) plus max_tokens "
                                     f"({stop.max_tokens}) exceeds the server's context of {self.max_model_len}",
                                     "prompt")
        prompt = self._tokenizer.decode(request.prompt_token_ids)
        if self._tokenizer.encode(prompt, add_special_tokens=False) != request.prompt_token_ids:
            raise InvalidRequestError("the prompt's token ids do not survive the text round trip the server needs; "
                                      "send text", "prompt")
        body: dict[str, Any] = {"model": self.remote_model, "prompt": prompt, "max_tokens": stop.max_tokens,
                                "temperature": s.temperature, "top_p": s.top_p, "stream": True,
                                "stream_options": {"include_usage": True},
                                "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty}
        # extensions vLLM and llama.cpp share, sent only when asked for
        optional = {"seed": s.seed, "top_k": s.top_k or None, "stop": stop.stop or None,
                    "stop_token_ids": stop.stop_token_ids or None, "ignore_eos": stop.ignore_eos or None,
                    "repetition_penalty": s.repetition_penalty if s.repetition_penalty != 1.0 else None}
        body.update({k: v for k, v in optional.items() if v is not None})
        return body

    async def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        body = self._body(request)
        rid, counted, usage, finish = request.request_id, 0, None, None
        async with self._client.stream("POST", f"{self.url}/completions", json=body) as response:
            if response.status_code >= 400:
                detail = (await response.aread()).decode(errors="replace")[:500]
                if 400 <= response.status_code < 500:  # the server refused this request: the client's to fix
                    raise InvalidRequestError(f"the model server refused the request: {detail}")
                raise RuntimeError(f"the model server answered {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if context.cancelled:
                    return  # leaving the stream closes the connection: the server aborts
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage  # vLLM's last chunk, with stream_options
                for choice in chunk.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    if text := choice.get("text") or "":
                        ids = self._tokenizer.encode(text, add_special_tokens=False)
                        counted += len(ids)
                        yield EngineOutput(request_id=rid, token_ids=ids, text=text)
        if finish is None:
            raise RuntimeError("the model server ended the stream without a finish reason")
        completion = usage.get("completion_tokens", counted) if usage else counted
        yield EngineOutput(request_id=rid, token_ids=[], finish_reason="length" if finish == "length" else "stop",
                           usage=Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=completion))

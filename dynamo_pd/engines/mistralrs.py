"""mistral.rs (the `mistralrs` wheel, CPU) behind the engine contract: aggregated workers only.

mistral.rs's Python API takes text and streams only chat completions, so a prompt's token ids are
detokenized (special tokens kept; checked to tokenize back to the same ids) and sent as a pre-templated
chat whose template is the identity: mistral.rs sees exactly the prompt the frontend built. Each streamed
chunk is one sampled token's text; its id is that text tokenized again (mistral.rs does not return the
ids), usage is mistral.rs's own count.
KV events: mistral.rs's prefix cache keeps the last `prefix_cache_n` sequences (Runner's argument,
extra["prefix_cache_n"], default 16); TokenEvents publishes the prompts of the last that many requests.
PREFILL and DECODE are refused at start-up: its Python API exports no KV and no sequence state.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path

from mistralrs import ChatCompletionRequest, Runner, Which

from dynamo_pd.engines.base import Engine, EngineConfig, EngineRole
from dynamo_pd.engines.token_events import TokenEvents
from dynamo_pd.model_store import DEFAULT_MODEL, ModelNotFoundError, default_gguf_path
from dynamo_pd.protocol import EngineOutput, EngineRequest, InvalidRequestError, Usage
from dynamo_pd.runtime import RequestContext
from router.events import KVEvent

_IDENTITY_TEMPLATE = "{{ messages[0]['content'] }}"  # the prompt arrives templated by the frontend


def _which(model: str | None) -> Which:
    path = default_gguf_path() if model is None or model == DEFAULT_MODEL else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Which.GGUF(quantized_model_id=str(path.parent), quantized_filename=path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return Which.Plain(model_id=str(path))
    raise ModelNotFoundError(f"the mistralrs engine serves a .gguf file or a Hugging Face directory, got {model!r}")


class MistralRsEngine(Engine):
    def __init__(self, config: EngineConfig):
        if config.role is not EngineRole.AGGREGATED:
            raise SystemExit(f"error: --engine mistralrs runs aggregated workers only, not {config.role.value}: "
                             "mistral.rs's Python API exports no KV or sequence state to hand over "
                             "(use --engine llamacpp or native for prefill/decode)")
        self.config, self.role = config, config.role
        self._runner: Runner | None = None
        self._lock = threading.Lock()  # Runner's methods borrow it mutably: one call at a time
        self._prefix_cache_n = int(config.extra.get("prefix_cache_n", 16)) if config.enable_prefix_caching else 0
        self._cached: OrderedDict[str, None] = OrderedDict()  # request ids whose prompts mistral.rs may hold
        self._events = TokenEvents(config.block_size)

    async def start(self) -> None:
        self._runner = await asyncio.to_thread(self._load)

    def _load(self) -> Runner:
        cfg = self.config
        with tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False) as template:
            template.write(_IDENTITY_TEMPLATE)
        try:
            runner = Runner(which=_which(cfg.model), max_seqs=cfg.max_num_seqs, prefix_cache_n=self._prefix_cache_n,
                            jinja_explicit=template.name)  # no seed: candle cannot seed its CPU rng
        finally:
            Path(template.name).unlink()
        self._max_model_len = min(cfg.max_model_len or 1 << 62, runner.max_sequence_length() or 1 << 62)
        return runner

    async def stop(self) -> None:
        self._runner = None

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def drain_kv_events(self) -> list[KVEvent]:
        return self._events.drain()

    def _call(self, method: str, *args):
        with self._lock:
            return getattr(self._runner, method)(*args)

    def _prompt_text(self, request: EngineRequest) -> str:
        """The prompt as mistral.rs must see it; raises InvalidRequestError when no text gives these ids."""
        s, stop, prompt = request.sampling, request.stop, request.prompt_token_ids
        self.check_guided(request)
        for param, given in (("seed", s.seed is not None), ("logprobs", s.logprobs is not None),
                             ("stop_token_ids", bool(stop.stop_token_ids))):
            if given:
                raise InvalidRequestError(f"the mistralrs engine does not support {param}", param)
        try:
            text = self._call("detokenize_text", prompt, False)
            same = self._call("tokenize_text", text, False, None) == prompt
        except Exception as exc:  # noqa: BLE001 - an id outside the vocabulary
            raise InvalidRequestError(f"the prompt's token ids do not detokenize: {exc}", "prompt") from None
        if not same:
            raise InvalidRequestError("the prompt's token ids do not survive mistral.rs's text round trip "
                                      "(it takes text, not ids)", "prompt")
        return text

    async def generate(self, request: EngineRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        request.check_fits(self.max_model_len)  # its vocabulary is checked by the text round trip
        text = await asyncio.to_thread(self._prompt_text, request)
        s, stop, rid = request.sampling, request.stop, request.request_id
        chat = ChatCompletionRequest(
            messages=text, model="default", max_tokens=stop.max_tokens, stream=True,
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None,
            repetition_penalty=None if s.repetition_penalty == 1.0 else s.repetition_penalty,
            presence_penalty=s.presence_penalty or None, frequency_penalty=s.frequency_penalty or None,
            stop_seqs=list(stop.stop) or None, ignore_eos=stop.ignore_eos)
        chunks = iter(await asyncio.to_thread(self._call, "send_chat_completion_request", chat))
        try:
            while True:
                chunk = await asyncio.to_thread(next, chunks, None)
                if chunk is None:
                    raise RuntimeError("mistral.rs ended the stream without a finish reason")
                choice = chunk.choices[0]
                delta = choice.delta.content or ""
                ids = await asyncio.to_thread(self._call, "tokenize_text", delta, False, None) if delta else []
                finish = None if choice.finish_reason is None else \
                    {"stop": "stop", "length": "length"}.get(choice.finish_reason, "error")
                usage = chunk.usage and Usage(prompt_tokens=chunk.usage.prompt_tokens,
                                              completion_tokens=chunk.usage.completion_tokens)
                yield EngineOutput(request_id=rid, token_ids=ids, text=delta, finish_reason=finish, usage=usage,
                                   error=None if finish != "error" else f"mistral.rs finished: {choice.finish_reason}")
                if finish is not None:
                    self._cache(rid, request)
                    return
                if context.cancelled:  # dropping the stream ends the sequence in mistral.rs
                    yield EngineOutput(request_id=rid, token_ids=[], finish_reason="abort")
                    return
        except ValueError as exc:  # mistral.rs's errors arrive as ValueError from the stream
            yield EngineOutput(request_id=rid, token_ids=[], finish_reason="error", error=f"mistral.rs: {exc}")
        finally:
            del chunks

    def _cache(self, rid: str, request: EngineRequest) -> None:
        if not self._prefix_cache_n:
            return
        self._events.hold(rid, request.prompt_token_ids, request.cache_salt)
        self._cached[rid] = None
        while len(self._cached) > self._prefix_cache_n:
            self._events.drop(self._cached.popitem(last=False)[0])

"""Structured output in the native sampler (the mocker and llama.cpp sample through it too): a request's
Guided compiled against the model's vocabulary once per spec, one xgrammar GrammarMatcher per sequence, and
per step one token bitmask for the batch, filled for the rows that have a grammar and applied to their logits.

A matcher's state is the tokens it accepted and nothing else: the decode side of a hand-off and the worker a
request migrates to rebuild it by accepting the tokens emitted so far (Sequence.append), so no grammar state
crosses the wire.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dynamo_pd.engines.native.kernels import mask_logits_
from dynamo_pd.guided import grammar
from dynamo_pd.model_store import load_tokenizer
from dynamo_pd.protocol import Guided, InvalidRequestError

if TYPE_CHECKING:
    import xgrammar as xgr

_KEPT = 128  # compiled grammars kept per vocabulary: clients repeat their schemas
_COMPILE_THREADS = 2  # compiling runs beside the step thread: it must not take every core from it


class Grammars:
    """Compiles Guided specs against one vocabulary and makes their matchers; safe from any thread. The
    vocabulary's tables (xgrammar's TokenizerInfo: ~1.5 s for 49k tokens, a minute on a loaded host) are built
    in a thread of their own from the start, beside the model's loading, and the engines wait for them
    (`compiler()`) before they count as started: the build holds the GIL most of that time, so a worker that
    registered meanwhile served its first requests that much later (a mocker process's first 6,000-token
    prompt: TTFT 723 ms against 170 from the second on), and no first guided request waits for them past the
    frontend's inter-token timeout."""

    def __init__(self, tokenizer_info: Callable[[], xgr.TokenizerInfo]):
        self._tokenizer_info = tokenizer_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[Guided, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        # not a daemon: a process that exits while xgrammar builds the tables (a worker stopped right after it
        # started) must wait for them; cut short, xgrammar's own threads abort the process (SIGABRT)
        threading.Thread(target=self.compiler, name="grammar-vocabulary").start()

    def compiler(self) -> xgr.GrammarCompiler:
        """The compiler over the vocabulary's tables; blocks until they are built."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=_COMPILE_THREADS,
                                                     cache_enabled=False)  # the cache is this class's
            return self._compiler

    def compile(self, guided: Guided) -> xgr.CompiledGrammar:
        """`guided` compiled (or from the cache); InvalidRequestError naming its field when it does not
        compile."""
        compiler = self.compiler()
        with self._lock:  # one compile at a time: the same schema asked twice at once compiles once
            compiled = self._compiled.get(guided)
            if compiled is not None:
                self._compiled.move_to_end(guided)
                return compiled
            parsed = grammar(guided)
            try:
                compiled = compiler.compile_grammar(parsed)
            except Exception as exc:  # noqa: BLE001 - xgrammar's own errors, as the client's mistake
                raise InvalidRequestError(f"{guided.param}: the {guided.kind} does not compile against this "
                                          f"model's vocabulary: {exc}", guided.param) from None
            self._compiled[guided] = compiled
            if len(self._compiled) > _KEPT:
                self._compiled.popitem(last=False)
            return compiled

    def matcher(self, guided: Guided, compiled: xgr.CompiledGrammar | None = None) -> xgr.GrammarMatcher:
        """A new matcher for `guided` (compiled here unless given), at the start of the output."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled if compiled is not None else self.compile(guided))


@functools.cache
def huggingface_grammars(model_dir: Path, vocab_size: int, stop_token_ids: frozenset[int]) -> Grammars:
    """One Grammars per model in a process (the mocker runs many workers in one), over its Hugging Face
    tokenizer; stop tokens are the model's EOS ids, which a grammar allows once its output is complete."""

    def tokenizer_info() -> xgr.TokenizerInfo:
        import xgrammar as xgr

        tokenizer = load_tokenizer(model_dir)
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))

    return Grammars(tokenizer_info)


def apply_bitmask(logits: torch.Tensor, matchers: list[xgr.GrammarMatcher | None],
                  best: list[int | None]) -> list[int]:
    """In place: in each row with a matcher, every token its grammar does not allow next becomes -inf; returns
    the rows masked. One bitmask for the batch. Rows without a matcher are left as they are, and so is a row
    whose pick (`best`; None where the row must be masked first) its grammar allows: sampler.sample keeps such a
    pick as it is, and the mask is not free (4-8 ms a row inside a string of bounded length, where xgrammar
    checks most of the vocabulary token by token)."""
    rows = [row for row, matcher in enumerate(matchers)
            if matcher is not None and (best[row] is None or not _allows(matcher, best[row]))]
    if not rows:
        return rows
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    if len(rows) == 1:
        matchers[rows[0]].fill_next_token_bitmask(bitmask, rows[0])
    else:  # the rows' masks on xgrammar's own threads, at once (one after another cost 13% at batch 32)
        _batch_matcher().batch_fill_next_token_bitmask([matchers[row] for row in rows], bitmask, indices=rows)
    mask_logits_(logits, bitmask, rows)
    return rows


def _allows(matcher: xgr.GrammarMatcher, token: int) -> bool:
    """Whether `token` may come next, the matcher left as it was (a refused token does not move it; a matcher
    past its end warns on every token offered)."""
    if matcher.is_terminated() or not matcher.accept_token(token):
        return False
    matcher.rollback(1)
    return True


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads="auto")


def allowed_tokens(matcher: xgr.GrammarMatcher, vocab_size: int) -> torch.Tensor:
    """A [vocab_size] bool mask of the tokens the matcher allows next (the mocker picks without logits)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()

"""Next-token choice for a batch: logit bias, penalties, greedy or temperature / top-k / top-p sampling,
logprobs; and the logprobs of prompt tokens (SamplingParams.prompt_logprobs).

Random rows draw one uniform number each from their own generator (a request's seed, or the
engine's; choice i of a seeded request with n > 1 its seed + i), then pick by inverse CDF, so a seeded
request samples the same tokens whatever else shares its batch. Rows under a grammar (structured output)
pick from the tokens it allows next (grammar.py), masking the row only where the first pick is refused
(rows under a grammar draw twice, the second for that retry); a logit bias is added before the penalties (as
vLLM orders them); the logprobs reported stay the model's own.
"""

from __future__ import annotations

import torch

from dynamo_pd.engines.native.grammar import apply_bitmask
from dynamo_pd.engines.native.sequence import Sequence
from dynamo_pd.protocol import SamplingParams, TokenLogprob


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place. Repetition penalty covers prompt and output; presence/frequency only the output."""
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        p = seq.request.sampling
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
            scores = logits[row, seen]
            penalised = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
            logits[row, seen] = penalised
        if (p.presence_penalty or p.frequency_penalty) and len(seq.token_ids) > seq.num_prompt_tokens:
            output = torch.tensor(seq.output_token_ids, device=logits.device)
            counts = torch.bincount(output, minlength=vocab).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


LOGIT_BOUND = 1e30  # divided by the smallest sampled temperature (protocol.GREEDY_BELOW) it stays finite


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: each row's SamplingParams.logit_bias added to its tokens' logits."""
    for row, seq in enumerate(seqs):
        bias = seq.request.sampling.logit_bias
        if bias:
            ids = torch.tensor(list(bias), device=logits.device)
            logits[row, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)


def score_prompt(logits: torch.Tensor, seq: Sequence) -> None:
    """Append to seq.prompt_logprobs the logprobs of its next len(logits) prompt tokens, each row the model's
    logits at the position before its token, with the top SamplingParams.prompt_logprobs alternatives."""
    logprobs = logits.float().log_softmax(dim=-1)
    start = len(seq.prompt_logprobs)
    tokens = seq.token_ids[start:start + len(logprobs)]
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    k = seq.request.sampling.prompt_logprobs
    top = logprobs.topk(k) if k else None
    for i, token in enumerate(tokens):
        alternatives = list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else []
        seq.prompt_logprobs.append(TokenLogprob(token_id=token, logprob=chosen[i], top=alternatives))


def _filter_top_k_top_p(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (with -inf) what top-k and top-p drop, on logits sorted in descending order."""
    ranks = torch.arange(sorted_logits.shape[1], device=sorted_logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # keep a token while the mass ahead of it is < top_p
    return sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))


def _draws(params: SamplingParams) -> int:
    """Uniform numbers a random row draws for each token: under a grammar a second, for a pick made again from
    the masked row, drawn whether used or not, so that every token uses up the same draws wherever it was made."""
    return 1 if params.guided is None else 2


def _draw(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
          draws: list[torch.Tensor]) -> torch.Tensor:
    """A token for each of `rows` by inverse CDF over its temperature-scaled, top-k / top-p filtered logits, at
    its uniform draw."""
    index = torch.tensor(rows, device=logits.device)
    temperature = torch.tensor([params[i].temperature for i in rows], device=logits.device)
    scaled = logits[index] / temperature[:, None]
    vocab = scaled.shape[1]
    top_k = torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in rows])
    top_p = torch.tensor([params[i].top_p for i in rows])
    if (top_k < vocab).any() or (top_p < 1).any():
        scaled, order = scaled.sort(dim=-1, descending=True)
        scaled = _filter_top_k_top_p(scaled, top_k.to(scaled.device), top_p.to(scaled.device))
    else:
        order = None
    cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
    u = torch.stack(draws).to(logits.device)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    if order is not None:
        picked = order.gather(1, picked)
    return picked[:, 0]


def skip_draw(seq: Sequence) -> None:
    """The first token was sampled elsewhere (a prefill worker) from this request's seed: use up its
    draws, so the next one is the draw an aggregated engine would make next."""
    if seq.generator is not None and not seq.request.sampling.greedy:
        torch.rand(_draws(seq.request.sampling), generator=seq.generator)


def sample(
    logits: torch.Tensor,  # [rows, vocab] float32, the model's raw next-token logits
    seqs: list[Sequence],
    engine_generator: torch.Generator,
) -> tuple[list[int], list[TokenLogprob | None]]:
    raw_logprobs = None
    if any(seq.request.sampling.logprobs is not None for seq in seqs):
        raw_logprobs = logits.log_softmax(dim=-1)  # reported logprobs: the model's own distribution
    params = [seq.request.sampling for seq in seqs]
    if any(p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
        logits = logits.clone()  # an inference tensor: no other in-place update
        apply_logit_bias(logits, seqs)
        apply_penalties(logits, seqs)
        # an extreme repetition_penalty overflows a logit to -inf (or inf): finite again, so a grammar's allowed
        # tokens never all fall to -inf beside the ones it masks, and softmax has no inf - inf
        logits.clamp_(-LOGIT_BOUND, LOGIT_BOUND)
    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    draws = {i: torch.rand(_draws(params[i]), generator=seqs[i].generator or engine_generator) for i in random_rows}
    if random_rows:
        chosen[random_rows] = _draw(logits, random_rows, params, [draws[i][0] for i in random_rows])
    if any(seq.grammar is not None for seq in seqs):
        # A pick stands where its grammar allows it: a greedy row's is the masked row's argmax too, and for a row
        # sampled at a temperature alone a draw from the whole distribution that lands among the allowed tokens is
        # a draw from the masked one (rejection sampling, as llama.cpp samples). A refused pick is made again
        # from the masked row, a random one with its second draw; top-k / top-p rows cut their tail after the
        # mask, so they always mask. The mask is what costs (grammar.apply_bitmask).
        picks = chosen.tolist()
        candidates = [token if p.greedy or (p.top_k <= 0 and p.top_p >= 1) else None for token, p in zip(picks, params)]
        masked = apply_bitmask(logits, [seq.grammar for seq in seqs], candidates)  # in place: this step's own logits
        again = [i for i in masked if params[i].greedy]
        if again:
            chosen[again] = logits[again].argmax(dim=-1)
        again = [i for i in masked if not params[i].greedy]
        if again:
            chosen[again] = _draw(logits, again, params, [draws[i][1] for i in again])

    token_ids = chosen.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    if raw_logprobs is not None:
        for row, (seq, token) in enumerate(zip(seqs, token_ids)):
            n = seq.request.sampling.logprobs
            if n is None:
                continue
            top = raw_logprobs[row].topk(n) if n else None
            logprobs[row] = TokenLogprob(
                token_id=token,
                logprob=float(raw_logprobs[row, token]),
                top=list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
            )
    return token_ids, logprobs

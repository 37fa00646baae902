"""What a step costs this engine, measured as it runs: the figures a worker reports in LoadMetrics
and the router's `time` policy predicts with (router/policies.py).

A step's time is modelled as
    seconds = decode_s + decode_s_per_block * B + prefill_s_per_token * P
B: KV blocks of the step's decode rows (one new token each, attending to all their KV);
P: tokens of its prefill chunks (rows of more than one token, as the mocker's profile counts them).
decode_s and decode_s_per_block are an exponentially weighted least-squares line through the
decode-only steps (P = 0), its slope shrunk while B has varied by less than a block; both are 0
until such a step ran (a prefill worker never runs one). prefill_s_per_token is the weighted
ratio of what the steps with prefill took beyond that line to the tokens they prefilled (so on a
prefill worker a token carries its share of the step overhead): the figures always add up to the
step times seen. output_tokens: the weighted mean per finished request (1 on a prefill worker).
prefill_s_per_token and output_tokens are None until a prefill step ran, a request finished.

FetchCostMeter: what fetching KV costs (router.load.FetchCosts): copying blocks back from each lower tier and
pulling them from a peer, each as a fixed cost (the peer's hold round trip; 0 for a tier) and a rate (the
weighted mean of bytes over that of seconds), the same weighting as the steps'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from dynamo_pd.engines.native.scheduler import ScheduledBatch
from router.events import TIER_DISK, TIER_HOST
from router.load import FetchCosts, StepCosts

DECAY = 0.02  # the newest observation's weight: about the last 50 steps (or requests) count


class StepLoad(NamedTuple):
    prefill_tokens: int
    decode_blocks: int
    sequences: int = 0  # the batch's size (the model above does not use it; a worker's metrics do)

    @classmethod
    def of(cls, batch: ScheduledBatch) -> StepLoad:
        """Taken right after scheduling: a decode row's block table then holds its new token too."""
        return cls(sum(n for _, n in batch if n > 1), sum(len(seq.block_table) for seq, n in batch if n == 1),
                   len(batch))


def _mix(means: list[float], values: tuple[float, ...]) -> None:
    for i, v in enumerate(values):
        means[i] += DECAY * (v - means[i])


class StepCostMeter:
    def __init__(self) -> None:
        # decode-only steps: weighted means of 1, B, s, B*B, B*s (the first one corrects the start-up bias)
        self._decode = [0.0] * 5
        self._prefill = [0.0] * 2  # steps with prefill: weighted means of the excess seconds and of P
        self._output = [0.0] * 2  # finished requests: weighted means of 1 and of output tokens
        self.observer: Callable[[StepLoad, float], None] | None = None  # each step too (Engine.observe_steps)

    def observe(self, load: StepLoad, seconds: float) -> None:
        if self.observer is not None:
            self.observer(load, seconds)
        P, B = load.prefill_tokens, load.decode_blocks
        if P == 0:
            _mix(self._decode, (1.0, B, seconds, B * B, B * seconds))
            return
        decode_s, per_block = self._line()
        _mix(self._prefill, (seconds - decode_s - per_block * B, P))

    def finished(self, output_tokens: int) -> None:
        _mix(self._output, (1.0, output_tokens))

    def costs(self) -> StepCosts:
        excess, tokens = self._prefill
        weight, outputs = self._output
        return StepCosts(max(0.0, excess / tokens) if tokens else None, *self._line(),
                         outputs / weight if weight else None)

    def _line(self) -> tuple[float, float]:
        w, b, s, bb, bs = self._decode
        if not w:
            return 0.0, 0.0
        mean_b, mean_s = b / w, s / w
        # a ridge of one block^2: no slope from steps of (nearly) one size, the least-squares one once B varies
        slope = max(0.0, (bs / w - mean_b * mean_s) / (bb / w - mean_b * mean_b + 1.0))
        return max(0.0, mean_s - slope * mean_b), slope


class RateMeter:
    """Moves of bytes: weighted means of 1, bytes, seconds moving them, and the fixed seconds around them."""

    def __init__(self) -> None:
        self._means = [0.0] * 4

    def observe(self, nbytes: int, seconds: float, fixed_s: float = 0.0) -> None:
        _mix(self._means, (1.0, nbytes, seconds, fixed_s))

    def figures(self) -> tuple[float | None, float | None]:
        """(bytes per second, fixed seconds); None, None until a move was seen."""
        weight, nbytes, seconds, fixed = self._means
        if not weight or seconds <= 0:
            return None, None
        return nbytes / seconds, fixed / weight


class FetchCostMeter:
    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes  # one block's KV (the mocker's: its profiled model's)
        self.tiers = {TIER_HOST: RateMeter(), TIER_DISK: RateMeter()}
        self.pull = RateMeter()

    def costs(self) -> FetchCosts:
        host, disk = self.tiers[TIER_HOST].figures(), self.tiers[TIER_DISK].figures()
        return FetchCosts(self.block_bytes, *host, *disk, *self.pull.figures())

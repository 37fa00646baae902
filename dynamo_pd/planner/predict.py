"""The next interval's load from the intervals seen: per pool, its request rate and the prompt
lengths of its requests.

    constant   next = the last interval's value (reactive)
    trend      Holt's linear smoothing: a level and a slope, each an exponentially weighted mean of what
               the intervals showed (the level: the last interval's mean rate, its middle half an interval ago)
The rate planned for is the highest the forecast expects until the next decision's workers could serve:
from now (a falling rate: a pool shrunk now serves the rate of now) to an interval and a scale-up's time
(the last one's) ahead (a rising rate: what was decided now is all there is until then).
What the forecasts fell short by beyond chance (the arrivals past the count expected and one Poisson standard
deviation of it), averaged over the intervals (SHORTFALL_WEIGHT), is added to the rate planned for: a linear
trend lags a load that accelerates (a ramp's start) and overshoots a trough, and missing the SLO costs more
than a worker for an interval. Nothing is taken off for a forecast that was high: that only costs workers
until the trend turns.
The prompt lengths (their spread, which the TTFT model needs, and their mean) are the last WINDOW
requests', not an interval's: an interval of a few requests from a long-tailed mix (a chat trace's prompts
run from a hundred to 8,000 tokens) moved a per-interval mean 30-fold between intervals, and every
prediction with it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from dynamo_pd.planner.model import Load

PredictorName = Literal["constant", "trend"]
WINDOW = 256  # recent requests whose prompts are the next ones' lengths
LEVEL_WEIGHT = 0.9  # trend: the newest interval's weight in the level (tuned on noisy sinusoids)
SLOPE_WEIGHT = 0.8  # and in the slope
SHORTFALL_WEIGHT = 0.5  # the newest interval's weight in the shortfall planned for


@dataclass
class Series:
    """One quantity's forecast; None until it was observed."""

    kind: PredictorName
    level: float | None = None
    slope: float = 0.0

    def update(self, value: float) -> None:
        if self.level is None or self.kind == "constant":
            self.level = value
            return
        previous = self.level
        self.level = LEVEL_WEIGHT * value + (1 - LEVEL_WEIGHT) * (self.level + self.slope)
        self.slope = SLOPE_WEIGHT * (self.level - previous) + (1 - SLOPE_WEIGHT) * self.slope

    def forecast(self, steps: float = 1.0) -> float | None:
        """`steps` intervals ahead (the next one: 1)."""
        return None if self.level is None else max(0.0, self.level + self.slope * steps)


@dataclass(frozen=True)
class Arrival:
    """One request placed on a pool (router.replica_sync's "place" update)."""

    prefill_tokens: int  # uncached prompt tokens the chosen worker computes (0: it only decodes)
    blocks: int  # the prompt's KV blocks


@dataclass
class LoadForecast:
    """One pool's rate series and recent requests."""

    kind: PredictorName
    rate: Series = field(init=False)
    recent: deque[Arrival] = field(default_factory=lambda: deque(maxlen=WINDOW))
    shortfall: float = 0.0  # req/s the recent forecasts missed beyond chance, added to the rate planned for

    def __post_init__(self) -> None:
        self.rate = Series(self.kind)

    def update(self, interval_s: float, arrivals: list[Arrival]) -> None:
        if (forecast := self.rate.forecast()) is not None:
            expected = forecast * interval_s
            short = max(0.0, len(arrivals) - expected - math.sqrt(expected)) / interval_s
            self.shortfall += SHORTFALL_WEIGHT * (short - self.shortfall)
        self.rate.update(len(arrivals) / interval_s)
        self.recent.extend(arrivals)

    def load(self, output_tokens: float, ready_intervals: float = 1.0) -> Load | None:
        """The next interval's load, at the highest rate expected from now until the next decision's
        workers could serve, `ready_intervals` (a scale-up's time) after the next interval, plus the recent
        shortfall; None before any interval was seen. forecast(k) is the mean of the k-th interval ahead: the
        rate k - 1/2 ahead."""
        if self.rate.level is None:
            return None
        rate = max(self.rate.forecast(0.5), self.rate.forecast(1.5 + ready_intervals)) + self.shortfall
        blocks = sum(a.blocks for a in self.recent) / len(self.recent) if self.recent else 0.0
        return Load(rate=rate, prompt_tokens=tuple(a.prefill_tokens for a in self.recent), prompt_blocks=blocks,
                    output_tokens=output_tokens)

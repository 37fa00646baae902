"""The load forecasts: constant repeats the last interval, trend follows a ramp and leads a sinusoid."""

import math
import random

import pytest

from dynamo_pd.planner.predict import Arrival, LoadForecast, Series


def one_step_errors(kind: str, values: list[float]) -> list[float]:
    series, errors = Series(kind), []
    for value in values:
        if (forecast := series.forecast()) is not None:
            errors.append(abs(forecast - value))
        series.update(value)
    return errors


def test_constant_repeats_the_last_interval():
    series = Series("constant")
    assert series.forecast() is None
    for value in (3.0, 9.0, 5.0):
        series.update(value)
    assert series.forecast() == 5.0


def test_trend_follows_a_ramp():
    errors = one_step_errors("trend", [2.0 * t for t in range(30)])
    assert errors[-1] == pytest.approx(0.0, abs=0.01)  # on a line, the slope is learned exactly
    behind = one_step_errors("constant", [2.0 * t for t in range(30)])[-1]
    assert behind == pytest.approx(2.0)  # a step behind


@pytest.mark.parametrize("period", [8, 12, 24])
def test_trend_leads_a_noisy_sinusoid(period):
    # 1..24 req/s (the benchmark's load), counted over 10 s intervals: Poisson noise on each
    rng = random.Random(period)
    truth = [12.5 - 11.5 * math.cos(2 * math.pi * t / period) for t in range(400)]
    seen = [_poisson(rng, rate * 10) / 10 for rate in truth]
    errors = {}
    for kind in ("trend", "constant"):
        series, errors[kind] = Series(kind), 0.0
        for t, value in enumerate(seen):
            if t >= 20:  # past the warm-up
                errors[kind] += abs(series.forecast() - truth[t])
            series.update(value)
    assert errors["trend"] < 0.9 * errors["constant"]


def _poisson(rng: random.Random, mean: float) -> int:
    """Arrivals in one interval: count Poisson events of rate `mean` within a unit of time."""
    count, t = 0, rng.expovariate(1.0)
    while t < mean:
        count, t = count + 1, t + rng.expovariate(1.0)
    return count


def test_never_below_zero():
    series = Series("trend")
    for value in (20.0, 10.0, 0.0):
        series.update(value)
    assert series.forecast() == 0.0


def test_lengths_come_from_intervals_with_requests():
    forecast = LoadForecast("constant")
    assert forecast.load(100.0) is None
    forecast.update(10.0, [Arrival(3000, 188), Arrival(1000, 63)])
    forecast.update(10.0, [])  # an idle interval: the rate drops, the lengths stay
    load = forecast.load(100.0)
    assert load.rate == 0.0 and load.mean_prompt_tokens == 2000 and load.prompt_blocks == 125.5
    assert load.prompt_tokens == (3000, 1000) and load.output_tokens == 100.0


def test_the_highest_rate_until_the_next_decision_could_act_is_planned_for():
    rising, falling = LoadForecast("trend"), LoadForecast("trend")
    for t in range(20):
        rising.update(1.0, [Arrival(100, 7)] * (2 * t))  # +2 req/s an interval
        falling.update(1.0, [Arrival(100, 7)] * (80 - 2 * t))
    assert rising.rate.forecast() == pytest.approx(40.0, abs=0.1)  # the next interval's mean
    # rising: the rate when the next decision's workers would serve, an interval and a scale-up (1.5
    # intervals) from now: 3 intervals past the last one's middle
    assert rising.load(10.0, ready_intervals=1.5).rate == pytest.approx(44.0, abs=0.1)
    assert rising.load(10.0, ready_intervals=0.0).rate == pytest.approx(41.0, abs=0.1)
    # falling: the rate of now, half an interval past the last one's middle (a pool shrunk now serves it)
    assert falling.load(10.0, ready_intervals=1.5).rate == pytest.approx(41.0, abs=0.1)


def test_what_the_forecasts_missed_beyond_chance_is_planned_for():
    # the benchmark's sinusoid through a trough into a ramp (arrivals per 20 s interval): the trend overshoots
    # the trough and lags the ramp; the shortfall it showed is planned for on top of it
    counts = [96, 63, 33, 21, 11, 10, 21, 44, 81]
    forecast, planned = LoadForecast("trend"), []
    for t, count in enumerate(counts[:-1]):
        forecast.update(20.0, [Arrival(100, 7)] * count)
        trend = max(forecast.rate.forecast(0.5), forecast.rate.forecast(1.5))
        planned.append((forecast.load(10.0, ready_intervals=0.0).rate * 20, trend * 20, counts[t + 1]))
    assert forecast.shortfall > 0.3
    for with_shortfall, trend_alone, following in planned[4:]:  # the trough and the ramp
        assert following - with_shortfall < following - trend_alone  # nearer the arrivals that followed
    # Poisson noise around a steady rate is chance, not a shortfall
    rng, steady = random.Random(0), LoadForecast("trend")
    shortfalls = []
    for _ in range(200):
        steady.update(10.0, [Arrival(100, 7)] * _poisson(rng, 200.0))
        shortfalls.append(steady.shortfall)
    assert sum(shortfalls[20:]) / len(shortfalls[20:]) < 0.05 * 20.0  # under 5% of the 20 req/s


def test_prompt_lengths_are_the_recent_requests_not_one_intervals():
    # a chat trace's long tail (a fifth of the prompts 8,000 tokens, the rest 1,000; mean 2,400), five
    # requests an interval: one interval's mean runs from 1,000 to 8,000; the recent requests' stays near 2,400
    rng, forecast = random.Random(1), LoadForecast("trend")
    means = []
    for _ in range(120):
        forecast.update(5.0, [Arrival(rng.choice([1000] * 4 + [8000]), 100) for _ in range(5)])
        means.append(forecast.load(100.0).mean_prompt_tokens)
    assert all(abs(mean / 2400 - 1) <= 0.25 for mean in means[60:])  # once the window holds its requests
    assert len(forecast.load(100.0).prompt_tokens) == 256  # and the same requests give the lengths' spread

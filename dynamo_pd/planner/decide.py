"""Each pool's worker count for the next interval: the least that meets the SLOs, within limits.

Per pool, the least n in [minimum, maximum] whose model meets --ttft-slo (prefill and aggregated pools:
the share of requests within it) and --itl-slo (decode and aggregated pools: ITL at that share's
quantile). A pool whose SLO no count meets gets its maximum, or the least count predicted to do as well
as its maximum (within PLATEAU: more workers would not help, as where prompts whose prefill alone takes
longer than the TTFT SLO are more than the share it allows), and the decision says so (unmeetable).
Together the pools stay within the budget: when their needs exceed it, each keeps its minimum and
the rest goes, a worker at a time, to the pool furthest short of its need (unmeetable too: the
planner holds the budget's maximum). A pool shrinks only `cooldown_s` after it last grew, so a load
that swings around a threshold turns it at most once a cool-down; it grows at once, and a falling load
shrinks it interval after interval.
Counts are chosen for the load planned for (the forecast with its margins, predict.py); what a decision
predicts for the next interval is at the rate forecast itself (PoolPlan.expected), the planner's best guess
of what its requests will see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynamo_pd.planner.model import PoolModel, Prediction

PLATEAU = 0.01  # attainments this near the maximum's are as good: the model's resolution, not a gain


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class PoolPlan:
    """What the decision for one pool starts from."""

    pool: str
    current: int  # workers the connector has (serving or starting)
    minimum: int
    maximum: int
    model: PoolModel | None  # at the load planned for; None: too little known yet to predict
    waiting_for: str = ""  # why model is None
    last_growth: float | None = None  # clock time the pool last grew
    expected: PoolModel | None = None  # at the load forecast, without the planning's margins: what is predicted


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    target: int
    reason: str
    prediction: Prediction | None = None  # at target, of the load forecast (PoolPlan.expected)
    unmeetable: bool = False

    @property
    def change(self) -> int:
        return self.target - self.current


def describe(p: Prediction, n: int, slo: Slo) -> str:
    parts = []
    if p.ttft_p50_s is not None:
        parts.append(f"TTFT p50 {_ms(p.ttft_p50_s)}, {p.ttft_attainment:.0%} within {_ms(slo.ttft_s)} "
                     f"(prefill utilization {p.utilization:.2f})")
    if p.itl_s is not None:
        parts.append(f"ITL {_ms(p.itl_s)}, {_ms(p.itl_quantile_s)} at the quantile (SLO {_ms(slo.itl_s)})")
    return f"{n} workers: " + ", ".join(parts)


def _ms(seconds: float | None) -> str:
    return "inf" if seconds is None or seconds == float("inf") else f"{seconds * 1e3:.0f} ms"


def _need(plan: PoolPlan, slo: Slo) -> tuple[int, bool]:
    """The least count meeting the SLOs, and whether none does (then the least doing as well as the maximum)."""
    counts = range(plan.minimum, plan.maximum + 1)
    for n in counts:
        if plan.model.meets(n, slo.ttft_s, slo.itl_s):
            return n, False
    if (best := _attained(plan.model, plan.maximum, slo)) is None:
        return plan.maximum, True  # even the maximum cannot keep up: every worker counts
    return next(n for n in counts if (near := _attained(plan.model, n, slo)) is not None
                and all(a >= b - PLATEAU for a, b in zip(near, best))), True  # the maximum at the latest


def _attained(model: PoolModel, n: int, slo: Slo) -> tuple[float, float] | None:
    """How near n workers come to the SLOs: the TTFT attainment, and the ITL bound over the quantile's ITL
    (each 1 where the pool does not serve that part); None where they cannot keep up with the load."""
    ttft = itl = 1.0
    if model.prefills:
        if math.isinf(model.ttft_p50(n)):
            return None
        ttft = model.ttft_attainment(n, slo.ttft_s)
    if model.decodes:
        if math.isinf(quantile := model.itl(n)[1]):
            return None
        itl = min(1.0, slo.itl_s / quantile) if quantile > 0 else 1.0
    return ttft, itl


def _share(needs: dict[str, int], plans: list[PoolPlan], budget: int) -> dict[str, int]:
    """Counts within the budget: minimums first, then a worker at a time to the pool furthest short."""
    given = {p.pool: p.minimum for p in plans}
    while sum(given.values()) < budget:
        short = [p.pool for p in plans if given[p.pool] < needs[p.pool]]
        if not short:
            break
        pool = max(short, key=lambda q: (needs[q] - given[q]) / needs[q])
        given[pool] += 1
    return given


def decide(plans: list[PoolPlan], budget: int, slo: Slo, cooldown_s: float, now: float) -> list[Decision]:
    needs, unmeetable, why = {}, {}, {}
    for plan in plans:
        if plan.model is None:
            needs[plan.pool] = min(max(plan.current, plan.minimum), plan.maximum)
            unmeetable[plan.pool], why[plan.pool] = False, f"waiting for {plan.waiting_for}"
            continue
        needs[plan.pool], unmeetable[plan.pool] = _need(plan, slo)
        why[plan.pool] = ("the least count meeting the SLO" if not unmeetable[plan.pool]
                          else f"SLO unmeetable within the pool's maximum of {plan.maximum}"
                          if needs[plan.pool] == plan.maximum
                          else f"SLO unmeetable: {plan.maximum} workers would do no better than "
                               f"{needs[plan.pool]} (within {PLATEAU:.0%})")
    targets = dict(needs)
    if sum(needs.values()) > budget:
        targets = _share(needs, plans, budget)
        wanted = " + ".join(f"{p.pool} {needs[p.pool]}" for p in plans)
        for plan in plans:
            if targets[plan.pool] < needs[plan.pool]:
                unmeetable[plan.pool] = True
                why[plan.pool] = (f"SLO unmeetable within the budget: it needs {wanted} workers, over "
                                  f"--budget {budget}; holding the budget's maximum")
    for plan in plans:
        cooling = plan.last_growth is not None and now - plan.last_growth < cooldown_s
        if targets[plan.pool] < plan.current and cooling:
            why[plan.pool] = (f"cool-down: {needs[plan.pool]} would do, but the pool grew "
                              f"{now - plan.last_growth:.0f} s ago (< {cooldown_s:g} s)")
            targets[plan.pool] = plan.current
    # a pool held by its cool-down keeps workers another pool's growth would have taken from the budget
    for plan in sorted(plans, key=lambda p: targets[p.pool] - p.current, reverse=True):
        over = sum(targets.values()) - budget
        if over <= 0:
            break
        cut = min(over, max(0, targets[plan.pool] - plan.current))
        if cut:
            targets[plan.pool] -= cut
            unmeetable[plan.pool] = True
            why[plan.pool] = f"budget: {budget} workers in all, some held by a cool-down"
    decisions = []
    for plan in plans:
        target = targets[plan.pool]
        verb = "up" if target > plan.current else "down" if target < plan.current else "hold"
        reason = f"{verb} {plan.current} -> {target}: {why[plan.pool]}"
        prediction = None
        if plan.model is not None:
            prediction = (plan.expected or plan.model).predict(target, slo.ttft_s)
            reason += "; planned for, " + describe(plan.model.predict(target, slo.ttft_s), target, slo)
            if verb == "up" and target - 1 >= plan.minimum:
                reason += "; " + describe(plan.model.predict(target - 1, slo.ttft_s), target - 1, slo)
            if plan.expected is not None:
                reason += "; at the rate forecast, " + describe(prediction, target, slo)
        decisions.append(Decision(plan.pool, plan.current, target, reason, prediction, unmeetable[plan.pool]))
    return decisions

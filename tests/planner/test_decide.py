"""Decisions: the least count meeting the SLOs, limits, the budget, the cool-down, an SLO nothing meets."""

from dynamo_pd.planner.decide import PoolPlan, Slo, decide
from dynamo_pd.planner.model import Costs, Limits, Load, PoolModel, State

LIMITS = Limits(max_num_seqs=64, kv_blocks=20_000, block_size=16, chunk_tokens=2048)
SLO = Slo(ttft_s=0.3, itl_s=0.009)


def prefill(rate: float) -> PoolModel:
    return PoolModel(Costs(25e-6), Load(rate, (3000,)), State(), LIMITS, prefills=True, decodes=False,
                     horizon_s=10.0, attainment=0.95)


def decode(rate: float) -> PoolModel:
    return PoolModel(Costs(0.0, 6.6e-3, 0.8e-6), Load(rate, (0,), prompt_blocks=188, output_tokens=150),
                     State(), LIMITS, prefills=False, decodes=True, horizon_s=10.0, attainment=0.95)


def plans(p_rate: float, d_rate: float, current=(1, 1), last_growth=(None, None), maximum=8
          ) -> list[PoolPlan]:
    return [PoolPlan("prefill", current[0], 1, maximum, prefill(p_rate), last_growth=last_growth[0]),
            PoolPlan("decode", current[1], 1, maximum, decode(d_rate), last_growth=last_growth[1])]


def by_pool(decisions):
    return {d.pool: d for d in decisions}


def test_least_count_meeting_the_slo():
    low = by_pool(decide(plans(1.0, 1.0), budget=16, slo=SLO, cooldown_s=30, now=100))
    assert (low["prefill"].target, low["decode"].target) == (1, 1)
    assert "hold 1 -> 1" in low["prefill"].reason and not low["prefill"].unmeetable
    high = by_pool(decide(plans(24.0, 24.0), budget=16, slo=SLO, cooldown_s=30, now=100))
    for d, model in ((high["prefill"], prefill(24.0)), (high["decode"], decode(24.0))):
        assert model.meets(d.target, SLO.ttft_s, SLO.itl_s)
        assert not model.meets(d.target - 1, SLO.ttft_s, SLO.itl_s)
        assert d.target > 1 and d.reason.startswith(f"up 1 -> {d.target}")
    assert high["prefill"].prediction.ttft_attainment >= 0.95
    assert high["decode"].prediction.itl_quantile_s <= 0.009


def test_slo_no_count_meets_holds_the_maximum():
    plan = [PoolPlan("prefill", 2, 1, 5, prefill(80.0))]  # 80 x 75 ms of prefill a second: 5 workers fall short
    (d,) = decide(plan, budget=8, slo=SLO, cooldown_s=30, now=100)
    assert (d.target, d.unmeetable) == (5, True)
    assert "SLO unmeetable within the pool's maximum of 5" in d.reason


def test_slo_beyond_any_count_takes_the_least_count_doing_as_well_as_the_maximum():
    """Every prompt's prefill alone outlasts the TTFT SLO: more workers would not help, and are not taken."""
    plan = [PoolPlan("prefill", 2, 1, 5, prefill(1.0))]
    tight = Slo(ttft_s=0.05, itl_s=0.009)  # a 3000-token prompt alone takes 75 ms
    (d,) = decide(plan, budget=8, slo=tight, cooldown_s=30, now=100)
    assert (d.target, d.unmeetable) == (1, True)
    assert "SLO unmeetable: 5 workers would do no better than 1 (within 1%)" in d.reason
    # a long-tailed mix (a fifth of the prompts that long): attainment grows with workers up to a plateau
    mixed = PoolModel(Costs(25e-6), Load(20.0, (1000,) * 8 + (20_000,) * 2), State(), LIMITS, prefills=True,
                      decodes=False, horizon_s=10.0, attainment=0.95)
    (d,) = decide([PoolPlan("prefill", 1, 1, 12, mixed)], budget=16, slo=SLO, cooldown_s=30, now=100)
    assert d.unmeetable and 1 < d.target < 12
    assert mixed.ttft_attainment(d.target, SLO.ttft_s) >= mixed.ttft_attainment(12, SLO.ttft_s) - 0.01
    assert mixed.ttft_attainment(d.target - 1, SLO.ttft_s) < mixed.ttft_attainment(12, SLO.ttft_s) - 0.01


def test_budget_caps_the_pools_together():
    decisions = by_pool(decide(plans(60.0, 60.0), budget=5, slo=SLO, cooldown_s=30, now=100))
    assert sum(d.target for d in decisions.values()) == 5  # the budget's maximum, held
    assert all(d.unmeetable and "over --budget 5; holding the budget's maximum" in d.reason
               for d in decisions.values())
    assert all(d.target >= 1 for d in decisions.values())


def test_cool_down_holds_a_shrink_not_a_growth():
    held = by_pool(decide(plans(1.0, 24.0, current=(4, 1), last_growth=(90.0, 90.0)), budget=16, slo=SLO,
                          cooldown_s=30, now=100))
    assert held["prefill"].target == 4 and "cool-down: 1 would do" in held["prefill"].reason
    assert held["decode"].target > 1  # growing is never held
    later = by_pool(decide(plans(1.0, 24.0, current=(4, 1), last_growth=(90.0, 90.0)), budget=16, slo=SLO,
                           cooldown_s=30, now=121))
    assert later["prefill"].target == 1 and later["prefill"].reason.startswith("down 4 -> 1")


def test_cool_down_and_budget_together():
    # prefill may not shrink yet (cool-down) and holds 4 of 5: decode grows only into what is left
    decisions = by_pool(decide(plans(1.0, 60.0, current=(4, 1), last_growth=(95.0, None)), budget=5, slo=SLO,
                               cooldown_s=30, now=100))
    assert (decisions["prefill"].target, decisions["decode"].target) == (4, 1)
    assert decisions["decode"].unmeetable and "budget" in decisions["decode"].reason


def test_waiting_for_costs_holds():
    plan = [PoolPlan("decode", 3, 1, 8, None, waiting_for="decode step costs (a request served)")]
    (d,) = decide(plan, budget=8, slo=SLO, cooldown_s=30, now=100)
    assert (d.target, d.prediction) == (3, None)
    assert d.reason == "hold 3 -> 3: waiting for decode step costs (a request served)"


def test_the_count_is_for_the_load_planned_for_and_the_prediction_for_the_forecast():
    planned = PoolPlan("prefill", 1, 1, 8, prefill(20.0), expected=prefill(5.0))
    d = decide([planned], budget=16, slo=SLO, cooldown_s=30, now=100)[0]
    assert d.target == by_pool(decide(plans(20.0, 1.0), budget=16, slo=SLO, cooldown_s=30, now=100))["prefill"].target
    assert d.prediction == prefill(5.0).predict(d.target, SLO.ttft_s)  # not the rate planned for
    assert d.prediction.utilization < prefill(20.0).predict(d.target, SLO.ttft_s).utilization
    assert "planned for, " in d.reason and "at the rate forecast, " in d.reason

"""The planner's settings: one dataclass, built from the flags `python -m dynamo_pd.planner` and
`python -m dynamo_pd.serve --planner` share."""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass, field
from pathlib import Path

from dynamo_pd.planner.predict import PredictorName

DISAGGREGATED = ("prefill", "decode")
AGGREGATED = ("aggregated",)


@dataclass(frozen=True)
class PlannerConfig:
    pools: tuple[str, ...]  # DISAGGREGATED or AGGREGATED
    ttft_slo_s: float
    itl_slo_s: float
    attainment: float = 0.95  # the share of requests each SLO is planned for
    interval_s: float = 10.0
    predictor: PredictorName = "trend"
    budget: int = 8  # workers in all pools together
    minimum: dict[str, int] = field(default_factory=dict)  # per pool; absent: 1
    maximum: dict[str, int] = field(default_factory=dict)  # per pool; absent: the budget
    cooldown_s: float = 30.0  # a pool shrinks only this long after it last grew
    chunk_tokens: int = 2048  # the workers' --max-num-batched-tokens (prefill tokens per step)
    record: Path | None = None  # every interval's observation, prediction and decision, as JSON lines

    def min_workers(self, pool: str) -> int:
        return self.minimum.get(pool, 1)

    def max_workers(self, pool: str) -> int:
        return self.maximum.get(pool, self.budget)


def add_planner_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("planner (docs/planner.md)")
    g.add_argument("--ttft-slo", type=float, default=None, metavar="MS",
                   help="time to first token the planner sizes the prefill (or aggregated) pool for, ms")
    g.add_argument("--itl-slo", type=float, default=None, metavar="MS",
                   help="inter-token latency it sizes the decode (or aggregated) pool for, ms")
    g.add_argument("--slo-attainment", type=float, default=PlannerConfig.attainment, metavar="SHARE",
                   help="the share of requests each SLO must hold for (default %(default)s)")
    g.add_argument("--planner-interval-s", type=float, default=PlannerConfig.interval_s,
                   help="how often it observes and decides (default %(default)s)")
    g.add_argument("--predictor", choices=typing.get_args(PredictorName), default=PlannerConfig.predictor,
                   help="the next interval's load: the last one's (constant) or its trend's (default)")
    g.add_argument("--budget", type=int, default=PlannerConfig.budget,
                   help="workers in all pools together, at most (default %(default)s)")
    g.add_argument("--min-workers", action="append", default=[], metavar="POOL=N",
                   help="a pool's least workers (default 1), e.g. prefill=1; repeatable")
    g.add_argument("--max-workers", action="append", default=[], metavar="POOL=N",
                   help="a pool's most workers (default --budget), e.g. decode=6; repeatable")
    g.add_argument("--cooldown-s", type=float, default=PlannerConfig.cooldown_s,
                   help="a pool shrinks only this long after it last grew (default %(default)s)")
    g.add_argument("--planner-record", type=Path, default=None, metavar="PATH",
                   help="append every interval's observation, prediction and decision to PATH as JSON lines")


def planner_config(p: argparse.ArgumentParser, args: argparse.Namespace, pools: tuple[str, ...],
                   chunk_tokens: int = PlannerConfig.chunk_tokens) -> PlannerConfig:
    """The config from add_planner_args's flags; a bad value is p.error naming its flag."""
    if args.ttft_slo is None or args.itl_slo is None:
        p.error("the planner needs --ttft-slo and --itl-slo (ms)")
    for flag, value in (("--ttft-slo", args.ttft_slo), ("--itl-slo", args.itl_slo),
                        ("--planner-interval-s", args.planner_interval_s)):
        if not value > 0:
            p.error(f"{flag} must be positive, got {value:g}")
    if not 0.5 <= args.slo_attainment < 1:
        p.error(f"--slo-attainment must be in [0.5, 1), got {args.slo_attainment:g}")
    if args.cooldown_s < 0:
        p.error(f"--cooldown-s must be >= 0, got {args.cooldown_s:g}")
    minimum, maximum = (_pool_counts(p, flag, given, pools) for flag, given in
                        (("--min-workers", args.min_workers), ("--max-workers", args.max_workers)))
    config = PlannerConfig(
        pools=pools, ttft_slo_s=args.ttft_slo / 1e3, itl_slo_s=args.itl_slo / 1e3,
        attainment=args.slo_attainment, interval_s=args.planner_interval_s, predictor=args.predictor,
        budget=args.budget, minimum=minimum, maximum=maximum, cooldown_s=args.cooldown_s,
        chunk_tokens=chunk_tokens, record=args.planner_record)
    for pool in pools:
        if not 0 <= config.min_workers(pool) <= config.max_workers(pool):
            p.error(f"{pool}: --min-workers {config.min_workers(pool)} and --max-workers "
                    f"{config.max_workers(pool)} leave no count")
    if sum(config.min_workers(pool) for pool in pools) > args.budget:
        p.error(f"--budget {args.budget} is less than the pools' --min-workers together")
    if "decode" in pools and config.min_workers("decode") < 1 or "aggregated" in pools and (
            config.min_workers("aggregated") < 1):
        p.error("--min-workers: the decode (or aggregated) pool needs at least 1 worker")
    return config


def _pool_counts(p: argparse.ArgumentParser, flag: str, given: list[str], pools: tuple[str, ...]
                 ) -> dict[str, int]:
    counts = {}
    for item in given:
        pool, _, count = item.partition("=")
        if pool not in pools or not count.isdigit():
            p.error(f"{flag} {item!r}: give POOL=N with POOL one of {', '.join(pools)}")
        counts[pool] = int(count)
    return counts

"""The circuit breaker (router.breaker) and how KvRouter routes around it and around excluded workers."""

import pytest

from router.breaker import CircuitBreaker
from router.service import KvRouter, NoWorkers, RouterConfig
from router.worker import Role

BS = 4
PROMPT = list(range(4 * BS))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_failing_worker_stays_out_longer_each_time_in_a_row_and_a_success_resets_it():
    clock = Clock()
    breaker = CircuitBreaker(base_s=1.0, max_s=30.0, clock=clock)
    assert [breaker.failed("w") for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert breaker.is_open("w") and not breaker.is_open("other")
    clock.t = 29.9
    assert breaker.is_open("w")
    clock.t = 30.0
    assert not breaker.is_open("w")
    breaker.succeeded("w")
    assert breaker.failed("w") == 1
    with pytest.raises(ValueError):
        CircuitBreaker(base_s=0)


def router_of(decode: int, prefill: int = 0, clock: Clock | None = None) -> KvRouter:
    router = KvRouter(RouterConfig(policy="round_robin"))
    router.breaker = CircuitBreaker(clock=clock or Clock())
    for role, n in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
        for i in range(n):
            router.add_worker(f"{role.value[0]}{i}", role, capacity_blocks=100, block_size=BS)
    return router


def test_placements_avoid_a_worker_whose_breaker_is_open_until_it_closes():
    clock = Clock()
    router = router_of(decode=2, clock=clock)
    router.worker_failed("d0")
    chosen = {router.place(f"r{i}", PROMPT).decode.worker_id for i in range(4)}
    assert chosen == {"d1"}
    clock.t = 1.0
    assert {router.place(f"s{i}", PROMPT).decode.worker_id for i in range(4)} == {"d0", "d1"}


def test_when_every_worker_of_a_pool_is_out_they_are_tried_anyway():
    router = router_of(decode=1)
    router.worker_failed("d0")
    assert router.place("r", PROMPT).decode.worker_id == "d0"


def test_excluded_workers_are_never_chosen_and_excluding_all_says_so():
    router = router_of(decode=2, prefill=2)
    for i in range(4):
        placement = router.place(f"r{i}", PROMPT, exclude={"d1", "p0"})
        assert (placement.decode.worker_id, placement.prefill.worker_id) == ("d0", "p1")
    with pytest.raises(NoWorkers, match="besides d0, d1"):
        router.place("x", PROMPT, exclude={"d0", "d1"})
    # no prefill worker left: the decode worker prefills, as when every prefill worker is busy
    placement = router.place("y", PROMPT, exclude={"p0", "p1"})
    assert placement.prefill is None and isinstance(placement.prefill_refused, NoWorkers)


def test_a_worker_that_leaves_takes_its_breaker_state_with_it():
    router = router_of(decode=1)
    router.worker_failed("d0")
    router.remove_worker("d0")
    router.add_worker("d0", Role.DECODE, capacity_blocks=100, block_size=BS)
    assert not router.breaker.is_open("d0")

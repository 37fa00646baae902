"""KvRouter.place and the Placement it returns: which pools serve a request, and its life in the load."""

import pytest

from router.hashing import block_hashes
from router.service import KvRouter, LayoutMismatch, NoWorkers, Overloaded, RouterConfig
from router.worker import LoadMetrics, Role

BS = 4
PROMPT = list(range(10 * BS))  # 10 blocks


def deployment(prefill: int = 1, decode: int = 1, aggregated: int = 0) -> KvRouter:
    router = KvRouter(RouterConfig(seed=0))
    for role, n in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.AGGREGATED, aggregated)):
        for i in range(n):
            router.add_worker(f"{role.value[0]}{i}", role, capacity_blocks=100, block_size=BS)
    return router


def load(router: KvRouter, worker_id: str) -> tuple[int, int, int]:
    w = router.load.load(worker_id)
    return w.prefill_tokens, w.blocks, w.requests


def test_without_decode_workers_an_aggregated_worker_serves_it_all():
    router = deployment(prefill=0, decode=0, aggregated=1)
    placement = router.place("r", PROMPT)
    assert placement.decode.pool is Role.AGGREGATED and placement.prefill is None
    assert load(router, "a0") == (len(PROMPT), 10, 1)
    placement.first_token()
    assert load(router, "a0") == (0, 10, 1)
    placement.finished()
    assert load(router, "a0") == (0, 0, 0)


def test_a_disaggregated_placement_books_the_prompt_on_prefill_and_the_blocks_on_both():
    router = deployment()
    placement = router.place("r", PROMPT)
    assert (placement.decode.worker_id, placement.prefill.worker_id) == ("d0", "p0")
    assert load(router, "p0") == (len(PROMPT), 10, 1) and load(router, "d0") == (0, 10, 1)  # KV arrives by transfer
    placement.first_token()
    assert load(router, "p0") == (0, 10, 1)
    assert placement.failed(Role.DECODE) == 1.0  # one worker's failure frees only its load, and trips its breaker
    assert load(router, "d0") == (0, 0, 0) and load(router, "p0") == (0, 10, 1)
    assert router.breaker.is_open("d0") and not router.breaker.is_open("p0")
    placement.finished()
    placement.finished()  # again is harmless
    assert load(router, "p0") == (0, 0, 0)


def test_a_short_uncached_part_is_prefilled_on_the_decode_worker():
    router = deployment()
    router.indexer.store("d0", block_hashes(PROMPT[: 8 * BS], BS))  # 8 of 10 blocks cached on d0
    local = router.place("r1", PROMPT, local_prefill_tokens=2 * BS)
    assert local.prefill is None and local.decode.cached_tokens == 8 * BS
    assert load(router, "d0") == (2 * BS, 10, 1)  # it prefills the rest itself
    remote = router.place("r2", PROMPT, local_prefill_tokens=2 * BS - 1)
    assert remote.prefill.worker_id == "p0"


def test_busy_prefill_workers_leave_the_prompt_to_the_decode_worker_with_the_reason():
    router = deployment()
    router.update_load_metrics(LoadMetrics(worker_id="p0", num_running=9, num_waiting=0, num_free_blocks=0,
                                           num_total_blocks=100))
    placement = router.place("r", PROMPT)
    assert placement.prefill is None and isinstance(placement.prefill_refused, Overloaded)
    assert placement.decode.worker_id == "d0"


def test_the_block_size_is_the_first_workers_and_another_is_refused():
    router = KvRouter(RouterConfig())
    with pytest.raises(NoWorkers):
        router.place("r", PROMPT)
    router.add_worker("d0", Role.DECODE, 100, block_size=BS)
    assert router.block_size == router.ingestor.block_size == BS
    with pytest.raises(LayoutMismatch, match="'p0' has KV block size 16, the router 4"):
        router.add_worker("p0", Role.PREFILL, 100, block_size=16)
    assert router.workers(Role.PREFILL) == []
    router.remove_worker("d0")  # the pool emptied: the next workers may bring another size
    router.add_worker("p0", Role.PREFILL, 100, block_size=16)
    assert router.block_size == 16


def test_a_workers_success_closes_its_breaker_and_a_gone_workers_failure_is_forgotten():
    router = deployment(decode=2)
    first = router.place("r1", PROMPT)
    first.failed(Role.PREFILL)
    assert router.breaker.is_open("p0")
    second = router.place("r2", PROMPT)  # the only prefill worker sits in anyway: the whole pool is out
    assert second.prefill.worker_id == "p0"
    second.succeeded(Role.PREFILL)
    assert not router.breaker.is_open("p0")
    router.remove_worker(second.decode.worker_id)
    assert second.failed(Role.DECODE) == 0.0  # it left: nothing to keep out
    assert not router.breaker.is_open(second.decode.worker_id)

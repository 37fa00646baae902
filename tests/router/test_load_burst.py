"""A report taken before a placement reached its worker does not cancel the placement (router/load.py's
ARRIVAL_S and LoadMetrics.counted_s_ago); once the worker's counts hold it, it counts once."""

from router.load import ARRIVAL_S, LoadKey, LoadTracker
from router.service import KvRouter, RouterConfig
from router.worker import LoadMetrics, Role
from tests.router.test_load_decay import Clock


def idle(worker_id: str, counted_s_ago: float = 0.0, **held: int) -> LoadMetrics:
    return LoadMetrics(worker_id=worker_id, num_running=held.get("running", 0), num_waiting=0,
                       num_free_blocks=100 - held.get("blocks", 0), num_total_blocks=100,
                       active_prefill_tokens=held.get("prefill", 0), counted_s_ago=counted_s_ago)


def test_a_report_from_before_the_request_arrived_keeps_it():
    clock = Clock()
    tracker = LoadTracker(clock=clock)
    tracker.add_worker("w", 100)
    tracker.place(LoadKey("r1", Role.AGGREGATED), "w", prefill_tokens=7000, blocks=40)
    clock.now += 0.01
    tracker.report(idle("w"))  # sent 10 ms after the placement: r1 is still on its way
    assert tracker.load("w")[1:4] == (7000, 40, 1)
    clock.now += 0.5
    tracker.report(idle("w", counted_s_ago=0.6))  # counts from a step that began before r1 was placed
    assert tracker.load("w")[1:4] == (7000, 40, 1)
    clock.now += 0.5
    tracker.report(idle("w", counted_s_ago=0.1, running=1, blocks=40, prefill=5000))  # now its engine has it
    assert tracker.load("w")[1:4] == (5000, 40, 1)
    tracker.finish(LoadKey("r1", Role.AGGREGATED))
    clock.now += 0.5
    tracker.report(idle("w"))
    assert tracker.load("w")[1:4] == (0, 0, 0)


def test_requests_from_elsewhere_still_count():
    clock = Clock()
    tracker = LoadTracker(clock=clock)
    tracker.add_worker("w", 100)
    tracker.place(LoadKey("r1", Role.AGGREGATED), "w", prefill_tokens=0, blocks=10)
    clock.now += ARRIVAL_S / 2
    tracker.report(idle("w", running=3, blocks=30))  # two requests another frontend sent, not yet r1
    assert tracker.load("w")[1:4] == (0, 40, 4)


def test_a_burst_spreads_over_idle_workers_whatever_reports_come_between():
    """Six prompts at once on four idle workers (the Mooncake trace's first rows): each worker's report
    comes in right after the router placed something on it, taken before that reached its engine."""
    def report(w: str) -> LoadMetrics:
        return LoadMetrics(worker_id=w, num_running=0, num_waiting=0, num_free_blocks=1000, num_total_blocks=1000,
                           prefill_s_per_token=3e-5, decode_s=7e-3, decode_s_per_block=1e-6, output_tokens=400)

    clock = Clock()
    router = KvRouter(RouterConfig(block_size=16, seed=0))
    router.load = LoadTracker(clock=clock)
    workers = [f"w{i}" for i in range(4)]
    for w in workers:
        router.add_worker(w, "aggregated", 1000)
        router.update_load_metrics(report(w))
    clock.now += 1.0
    chosen = []
    for n, tokens in enumerate([6758, 7322, 7236, 2290, 6760, 4834]):
        w = router.place(f"r{n}", [n * 10_000 + t for t in range(tokens)]).decode.worker_id
        chosen.append(w)
        clock.now += 0.002
        router.update_load_metrics(report(w))
    assert sorted(chosen[:4]) == workers  # one each
    assert chosen[4] == chosen[3]  # then behind the shortest prompt

"""A worker's reported offset holds while it reports and fades to 0 once its reports stop."""

from router.load import FADE_INTERVALS, HOLD_INTERVALS, LoadKey, LoadTracker
from router.worker import LoadMetrics, Role


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def full_report(worker_id: str = "w") -> LoadMetrics:
    """The worker holds 90 of 100 blocks and runs 9 requests the router never placed."""
    return LoadMetrics(worker_id=worker_id, num_running=9, num_waiting=0, num_free_blocks=10,
                       num_total_blocks=100, active_prefill_tokens=300)


def test_silent_worker_offset_fades_to_zero_over_a_few_intervals():
    clock = Clock()
    tracker = LoadTracker(clock=clock)
    tracker.add_worker("w", 100)
    tracker.place(LoadKey("r1", Role.DECODE), "w", prefill_tokens=0, blocks=5)
    clock.now += 0.5  # the reports' counts hold r1 (test_load_burst.py: ones that cannot)
    for _ in range(3):  # reports every 0.5 s
        tracker.report(full_report())
        assert tracker.load("w")[1:4] == (300, 90, 9)
        clock.now += 0.5
    clock.now -= 0.5
    # held for HOLD_INTERVALS after the last report
    clock.now += 0.5 * HOLD_INTERVALS
    assert tracker.load("w")[1:4] == (300, 90, 9)
    # half way through the fade: half the offset (85 blocks and 8 requests of it) is left
    clock.now += 0.5 * FADE_INTERVALS / 2
    load = tracker.load("w")
    assert (load.prefill_tokens, load.blocks, load.requests) == (150, 5 + 42, 1 + 4)
    # then only what the router placed itself
    clock.now += 0.5 * FADE_INTERVALS / 2
    load = tracker.load("w")
    assert (load.prefill_tokens, load.blocks, load.requests) == (0, 5, 1)
    clock.now += 60
    assert tracker.load("w").blocks == 5
    # a new report brings the full correction back at once
    tracker.report(full_report())
    assert tracker.load("w")[1:4] == (300, 90, 9)


def test_interval_defaults_until_two_reports():
    clock = Clock()
    tracker = LoadTracker(default_report_interval_s=2.0, clock=clock)
    tracker.add_worker("w", 100)
    tracker.report(full_report())
    clock.now += 2.0 * HOLD_INTERVALS
    assert tracker.load("w").blocks == 90
    clock.now += 2.0 * FADE_INTERVALS
    assert tracker.load("w").blocks == 0


def test_worker_that_never_reported_has_no_offset_to_fade():
    tracker = LoadTracker(clock=Clock())
    tracker.add_worker("w", 100)
    tracker.place(LoadKey("r1", Role.DECODE), "w", prefill_tokens=7, blocks=3)
    assert tracker.load("w")[1:4] == (7, 3, 1)

"""benchmarks/planner_model.py's own parts: its flags, and the waits it reads off the planner's model."""

import pytest

from benchmarks import planner_model


def test_flags():
    args = planner_model.parse_args([])
    assert args.rates == [3.0, 6.0, 9.0] and args.prefill == 1 and args.speedup == 0.25
    assert planner_model.parse_args(["--quick"]).rates == [6.0]
    for bad in (["--rates", "6,x"], ["--rates", "0"], ["--prefill", "0"], ["--engine", "native"]):
        with pytest.raises(SystemExit):
            planner_model.parse_args(bad)


def test_waits_whole_prompts_against_chunked_steps():
    args = planner_model.parse_args([])
    service, p50, p90 = planner_model.model_waits(6.0, args, args.isl)  # one prompt a step: M/D/1 at rho 0.45
    assert service == pytest.approx(0.0756, rel=0.01)  # the profile's 3000-token prefill
    assert p50 == pytest.approx(0.0, abs=1e-9) and p90 > 0  # under half wait
    _, chunked_p50, chunked_p90 = planner_model.model_waits(6.0, args, planner_model.CHUNK_TOKENS)
    assert chunked_p50 > 0.01 and chunked_p90 > p90  # the next prompt shares the step ending one
    assert planner_model.model_waits(14.0, args, args.isl)[1:] == (None, None)  # past one worker's capacity

"""The mocker's performance profile: the default one is the H100 roofline it documents."""

from __future__ import annotations

import msgspec
import pytest

from dynamo_pd.engines.mocker.profile import (
    DECODE_BATCH,
    DECODE_CONTEXT,
    PREFILL_CACHED,
    PREFILL_TOKENS,
    Gpu,
    ModelShape,
    Profile,
    decode_ms,
    h100_llama8b,
    prefill_ms,
)

PROFILE = h100_llama8b()
MODEL, GPU = ModelShape(), Gpu()


def test_default_profile_is_the_h100_roofline_on_its_grid_and_close_between():
    assert PROFILE.kv_bytes_per_token == 131072  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    assert PROFILE.decode_time_ms(1, 0) == pytest.approx(6.6, abs=0.05)  # 15.0 GB at 2.68 TB/s + 1 ms
    assert PROFILE.prefill_time_ms(1024, 0) == pytest.approx(25.6, abs=0.1)  # 15.6 TFLOP at 593 TFLOPS + 1 ms
    for n in PREFILL_TOKENS:
        for c in PREFILL_CACHED:
            assert PROFILE.prefill_time_ms(n, c) == pytest.approx(prefill_ms(MODEL, GPU, n, c), abs=1e-4)
    for b in DECODE_BATCH:
        for k in DECODE_CONTEXT:
            assert PROFILE.decode_time_ms(b, k) == pytest.approx(decode_ms(MODEL, GPU, b, k), abs=1e-4)
    for n in range(1, 32768, 181):  # between grid points, kinks of the roofline included
        for c in (0, 300, 3000, 30000, 120000):
            roofline = prefill_ms(MODEL, GPU, n, c)
            assert PROFILE.prefill_time_ms(n, c) == pytest.approx(roofline, rel=0.06), (n, c)
    for b in range(1, 1024, 13):
        for k in (0, 50, 700, 5000, 50000):
            roofline = decode_ms(MODEL, GPU, b, k)
            assert PROFILE.decode_time_ms(b, k) == pytest.approx(roofline, rel=0.065), (b, k)


def test_a_profile_round_trips_as_json_and_a_malformed_one_is_refused(tmp_path):
    path = tmp_path / "profile.json"
    path.write_bytes(msgspec.json.encode(PROFILE))
    assert Profile.load(path) == PROFILE
    with pytest.raises(ValueError, match="shape"):
        msgspec.structs.replace(PROFILE, decode_ms=PROFILE.decode_ms[1:])
    with pytest.raises(ValueError, match="increasing"):
        msgspec.structs.replace(PROFILE, decode_batch=[1, 1] + PROFILE.decode_batch[2:])

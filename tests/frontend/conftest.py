import pytest

from tests.e2e.conftest import start_deployment


@pytest.fixture(scope="package")
def small_disagg(tmp_path_factory):
    """1 prefill + 1 decode worker whose KV caches hold about 1100 tokens (less than the model's
    context); the prefill worker takes 16 tokens a step, so a long prompt stays in prefill a while."""
    deployment = start_deployment(tmp_path_factory.mktemp("small_disagg"), "--prefill", "1", "--decode", "1",
                                  "--kv-cache-memory-gb", "0.05",
                                  worker_args={"prefill-0": ["--max-num-batched-tokens", "16"]})
    yield deployment
    codes = deployment.stop()
    assert all(code == 0 for code in codes.values()), codes

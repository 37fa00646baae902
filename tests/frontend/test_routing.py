"""The frontend's routing of one request: its prompt is hashed once, whichever pools it goes to."""

from __future__ import annotations

import router.service
from dynamo_pd.frontend import backend as backend_module
from dynamo_pd.frontend.backend import RemoteBackend
from dynamo_pd.metrics import Metrics
from dynamo_pd.protocol import EngineRequest
from router.hashing import block_hashes
from router.service import KvRouter, RouterConfig


def test_a_request_routed_to_decode_and_prefill_hashes_its_prompt_once(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return block_hashes(*args, **kwargs)

    monkeypatch.setattr(backend_module, "block_hashes", counted)
    monkeypatch.setattr(router.service, "block_hashes", counted)
    kv_router = KvRouter(RouterConfig(block_size=4))
    kv_router.add_worker("prefill-0", "prefill", capacity_blocks=100)
    kv_router.add_worker("decode-0", "decode", capacity_blocks=100)
    backend = RemoteBackend("model", None, 8192, None, None, kv_router, Metrics())
    request = EngineRequest(request_id="r1", prompt_token_ids=list(range(64)))
    # both by overlap: the decode worker may prefill locally (--local-prefill-tokens)
    assert backend._route("decode", request, local_prefill=True).worker_id == "decode-0"
    assert backend._route("prefill", request).worker_id == "prefill-0"
    assert len(calls) == 1

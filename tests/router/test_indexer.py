"""The indexer against a brute-force model: random stored / removed / cleared streams and worker removals."""

import hashlib
import importlib
import random
import subprocess
import sys

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from router.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from router.hashing import block_hashes
from router import indexer as indexer_module
from router.indexer import IndexerSnapshot, KvIndexer
from router.ingest import Delivery, EventIngestor

BLOCK = 4
WORKERS = 3
BYSTANDERS = [f"bystander-{i}" for i in range(66)]
# Prompts share prefixes so that workers share blocks: prompt p = common stem + its own tail.
STEM = list(range(1000, 1000 + 3 * BLOCK))
PROMPTS = [STEM[: (p % 3) * BLOCK] + [p * 100 + i for i in range(8 * BLOCK)] for p in range(4)]
CHAINS = [block_hashes(p, BLOCK) for p in PROMPTS]


@pytest.fixture(autouse=True, scope="module", params=["compiled", "python"])
def store_build(request):
    """Every test here runs on both builds of the indexer's store and match: router/_index.c and their Python
    twins."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "python":
            patch.setattr(indexer_module, "_add", indexer_module._add_py)
            patch.setattr(indexer_module, "_match", indexer_module._match_py)
        yield request.param


class Model:
    """Brute force: each worker is a set of sequence hashes; a match walks the prompt block by block."""

    def __init__(self):
        self.held: dict[int, set[int]] = {}

    def find_matches(self, hashes):
        out = {}
        for worker, held in self.held.items():
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if n:
                out[worker] = n
        return out


store = st.tuples(
    st.just("store"), st.integers(0, WORKERS - 1), st.integers(0, 3), st.integers(0, 7), st.integers(1, 8)
)
remove = st.tuples(
    st.just("remove"), st.integers(0, WORKERS - 1), st.integers(0, 3), st.integers(0, 7), st.integers(1, 3)
)
clear = st.tuples(st.just("clear"), st.integers(0, WORKERS - 1))
drop_worker = st.tuples(st.just("drop_worker"), st.integers(0, WORKERS - 1))
# Stores outnumber the rest so that state builds up between clears.
ops = st.lists(st.one_of(store, store, store, remove, remove, clear, drop_worker), min_size=5, max_size=60)


def with_bystanders(indexer, model):
    """66 workers holding prefixes of every prompt take the low slots, so the workers under test have
    mask bits past one machine word and every match reports many workers."""
    for i, worker in enumerate(BYSTANDERS):
        held = CHAINS[i % len(CHAINS)][: i % 9]
        indexer.store(worker, held)
        model.held[worker] = set(held)
    return indexer, model


def check_all(indexer, model):
    for chain in CHAINS:
        for n in (1, 3, len(chain)):
            assert indexer.find_matches(chain[:n]) == model.find_matches(chain[:n])
    for worker in range(WORKERS):
        held = model.held.get(worker, set())
        assert indexer.blocks_of(worker) == len(held)
        assert {h for chain in CHAINS for h in chain if indexer.holds(worker, h)} == held


@settings(max_examples=150, deadline=None)
@given(ops)
def test_indexer_matches_brute_force(stream):
    indexer, model = with_bystanders(KvIndexer(), Model())
    for op in stream:
        kind, worker = op[0], op[1]
        if kind == "store":
            _, _, p, start, n = op
            hashes = CHAINS[p][start : start + n]
            indexer.store(worker, hashes)
            model.held.setdefault(worker, set()).update(hashes)
        elif kind == "remove":
            _, _, p, start, n = op
            hashes = CHAINS[p][start : start + n]  # may evict the middle of a chain
            indexer.remove(worker, hashes)
            model.held.get(worker, set()).difference_update(hashes)
        elif kind == "clear":
            indexer.clear_worker(worker)
            model.held.pop(worker, None)
        else:
            indexer.remove_worker(worker)
            model.held.pop(worker, None)
        check_all(indexer, model)
    restored = KvIndexer()  # the dump holds the bystanders too
    restored.restore(msgspec.msgpack.decode(msgspec.msgpack.encode(indexer.dump()), type=IndexerSnapshot))
    check_all(restored, model)
    assert indexer.memory().resident_blocks == sum(len(s) for s in model.held.values())


def foreign(h: int) -> bytes:
    """An engine's own hash of a block: sha256 bytes, nothing like the project's."""
    return hashlib.sha256(h.to_bytes(8, "little")).digest()


@settings(max_examples=100, deadline=None)
@given(ops, st.booleans())
def test_events_through_the_wire_match_brute_force(stream, foreign_hashes):
    """Engine-valid streams (a block is stored only after its parent), engine hashes mapped via token_ids."""
    name = foreign if foreign_hashes else (lambda h: h)
    indexer, model = with_bystanders(KvIndexer(), Model())
    ingestor = EventIngestor(indexer, BLOCK)
    seq = {}
    for op in stream:
        kind, worker = op[0], op[1]
        held = model.held.setdefault(worker, set())
        events = []
        if kind == "store":
            _, _, p, start, n = op
            while start > 0 and CHAINS[p][start - 1] not in held:
                start -= 1  # engines store a block only on top of its parent
            hashes = CHAINS[p][start : start + n]
            parent = name(CHAINS[p][start - 1]) if start else None
            tokens = PROMPTS[p][start * BLOCK : (start + len(hashes)) * BLOCK]
            events.append(BlockStored([name(h) for h in hashes], parent, tokens, BLOCK))
            held.update(hashes)
        elif kind == "remove":
            _, _, p, start, n = op
            gone = [h for h in CHAINS[p][start : start + n] if h in held]
            events.append(BlockRemoved([name(h) for h in gone]))
            held.difference_update(gone)
        elif kind == "clear":
            events.append(AllBlocksCleared())
            held.clear()
        else:
            ingestor.remove_worker(worker)
            model.held.pop(worker)
            seq.pop(worker, None)
            continue
        n = seq[worker] = seq.get(worker, -1) + 1
        assert ingestor.deliver(worker, n, encode_batch(events)) is Delivery.APPLIED
        check_all(indexer, model)
    assert ingestor.stats.unknown_parent == 0 and ingestor.stats.rejected == 0


def test_mid_chain_eviction_keeps_later_blocks():
    indexer = KvIndexer()
    chain = CHAINS[0]
    indexer.store("w", chain)
    indexer.remove("w", [chain[2]])
    assert indexer.find_matches(chain) == {"w": 2}
    indexer.store("w", [chain[2]])
    assert indexer.find_matches(chain) == {"w": len(chain)}


def test_bound_refuses_new_blocks_and_counts_them():
    indexer = KvIndexer(max_nodes=3)
    indexer.store("a", CHAINS[0][:5])
    assert indexer.find_matches(CHAINS[0]) == {"a": 3}
    indexer.store("b", CHAINS[0][:2])  # existing nodes still gain members at the bound
    assert indexer.find_matches(CHAINS[0]) == {"a": 3, "b": 2}
    mem = indexer.memory()
    assert (mem.nodes, mem.resident_blocks, mem.dropped_blocks, mem.workers) == (3, 5, 2, 2)
    assert mem.approx_bytes > 0
    with pytest.raises(ValueError, match="max_nodes must be >= 0"):
        KvIndexer(max_nodes=-1)


def test_removed_worker_slot_is_reused_cleanly():
    indexer = KvIndexer()
    indexer.store("a", CHAINS[1])
    before = indexer.find_matches(CHAINS[1])
    indexer.remove_worker("a")
    indexer.store("b", CHAINS[1][:2])
    assert indexer.find_matches(CHAINS[1]) == {"b": 2}
    assert indexer.find_matches([]) == {}
    assert indexer.workers == ["b"]
    assert (
        before == {"a": len(CHAINS[1])} and before["a"] == len(CHAINS[1]) and "b" not in before
    )  # a snapshot


def test_a_churning_worker_keeps_what_the_indexer_logs_for_it_bounded():
    """The same blocks stored and mostly evicted over and over: the indexer's log of the worker's batches is
    compacted as it goes stale, and the state stays exact."""
    indexer = KvIndexer()
    chain = CHAINS[0]
    indexer.store("w", chain)
    one_round = indexer.memory().approx_bytes
    for _ in range(2000):  # 22,000 hashes stored in all
        indexer.remove("w", chain[4:])
        indexer.store("w", chain)
    indexer.remove("w", chain[4:])
    assert indexer.find_matches(chain) == {"w": 4} and indexer.blocks_of("w") == 4
    assert indexer.dump().workers == {"w": chain[:4]}
    assert indexer.memory().approx_bytes < one_round + 100_000  # the log without compaction: ~1 MB
    for _ in range(2000):  # stored again without a removal between: the log stays bounded too
        indexer.store("w", chain[:4])
    assert indexer.blocks_of("w") == 4 and indexer.memory().approx_bytes < one_round + 100_000
    indexer.clear_worker("w")
    assert indexer.find_matches(chain) == {} and indexer.memory().nodes == 0 and indexer.blocks_of("w") == 0


def test_the_install_built_the_compiled_store():
    """pyproject.toml builds router/_index.c (optional: the install goes on without a compiler, with a
    warning); the test venv must have it, or the C half of every test here would be the Python one."""
    assert importlib.import_module("router._index").add is not indexer_module._add_py
    assert importlib.import_module("router._index").match is not indexer_module._match_py


def test_the_compiled_and_python_stores_agree_block_for_block():
    compiled = importlib.import_module("router._index").add
    rng = random.Random(0)
    pool = [rng.getrandbits(64) for _ in range(40)]
    for _ in range(300):
        start = {h: rng.getrandbits(rng.choice((3, 70, 600))) | 1 for h in rng.sample(pool, rng.randrange(20))}
        batch = tuple(rng.choice(pool) for _ in range(rng.randrange(12)))  # repeats and known blocks
        bit = 1 << rng.choice((0, 1, 63, 64, 65, 513))
        ours, theirs = dict(start), dict(start)
        assert compiled(ours, batch, bit) == indexer_module._add_py(theirs, batch, bit)
        assert ours == theirs
    with pytest.raises(TypeError, match=r"add\(nodes: dict, batch: tuple, bit: int\)"):
        compiled({}, [1, 2], 1)


def test_the_compiled_and_python_matches_agree_level_for_level():
    """Masks of every width: the compiled walk runs on a machine word while the first block's holders fit 64
    bits (later masks wider than that included) and on Python ints beyond."""
    compiled = importlib.import_module("router._index").match
    rng = random.Random(1)
    pool = [rng.getrandbits(64) for _ in range(12)]
    for _ in range(500):
        width = rng.choice((3, 64, 65, 600))
        nodes = {h: rng.getrandbits(width) | (rng.random() < 0.5) << rng.choice((0, 63, 64, 599))
                 for h in rng.sample(pool, rng.randrange(13))}
        hashes = [rng.choice(pool) for _ in range(rng.randrange(10))]
        levels = compiled(nodes, hashes)
        assert levels == indexer_module._match_py(nodes, hashes) == compiled(nodes, tuple(hashes))
        assert all(mask for mask, _ in levels)
    assert compiled({1: 1 << 70 | 1, 2: 1 << 70}, [1, 2, 3]) == [(1, 1), (1 << 70, 2)]
    with pytest.raises(TypeError, match=r"match\(nodes: dict, hashes: list \| tuple\)"):
        compiled({}, iter([1]))


def test_a_store_after_a_block_the_worker_lacks_stores_nothing():
    indexer = KvIndexer()
    chain = CHAINS[0]
    assert not indexer.store("w", chain[1:], after=chain[0])  # a worker the indexer has not seen
    assert indexer.workers == []
    assert indexer.store("w", chain[:1]) and indexer.store("w", chain[1:3], after=chain[0])
    assert not indexer.store("v", chain[3:], after=chain[2])  # held, but by another worker
    assert indexer.find_matches(chain) == {"w": 3} and indexer.blocks_of("v") == 0


def test_without_the_compiled_store_the_indexer_says_so_and_works():
    code = ("import sys; sys.modules['router._index'] = None\n"  # as if the install had no compiler
            "from router.indexer import KvIndexer, _add, _add_py, _match, _match_py\n"
            "i = KvIndexer(); i.store('w', [1, 2, 3]); assert _add is _add_py and _match is _match_py\n"
            "assert i.find_matches([1, 2]) == {'w': 2}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "router._index is not built" in done.stderr and "slower event ingest and routing" in done.stderr

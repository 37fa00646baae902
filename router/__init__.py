"""KV-aware routing for dynamo-pd: a library (it imports nothing from dynamo_pd).

    hashing.py       the one block-hashing scheme (xxh3_64, seed 1337, chained sequence hashes)
    events.py        vLLM's KV event structs; decode_batch reads every form engines send
    publisher.py     a worker's KV events out: ZMQ (vLLM's wire format + replay) or NATS
    subscriber.py    a worker's KV events in, in order, with replay or rebuild on gaps
    ingest.py        engine hashes -> project hashes (via token_ids), sequence checks, snapshots
    indexer.py       which worker holds which blocks; find_matches; dump/restore; memory
    load.py          predicted active load per worker, corrected by the workers' reports
    policies.py      kv-aware (Dynamo's cost), round-robin, random, least-loaded, cache-aware (SGLang)
    replica_sync.py  router replicas share placements over ZMQ or NATS
    service.py       KvRouter, the facade the frontend calls
"""

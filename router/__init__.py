"""KV-aware routing for dynamo-pd: a pure library (no sockets, threads, ZMQ or NATS; nothing from dynamo_pd).

What delivers KV events and load reports lives in dynamo_pd.runtime; the frontend feeds them to
`EventIngestor.follow` and `KvRouter.update_load_metrics`.

    hashing.py       the one block-hashing scheme (xxh3_64, seed 1337, chained sequence hashes)
    events.py        vLLM's KV event structs; decode_batch reads every form engines send
    ingest.py        engine hashes -> project hashes (via token_ids); streams in order, replayed or rebuilt
    indexer.py       which worker holds which blocks; find_matches; dump/restore; memory
    load.py          predicted active load per worker, corrected by the workers' reports
    policies.py      kv-aware (Dynamo's cost), round-robin, random, least-loaded, cache-aware (SGLang)
    replica_sync.py  what router replicas tell each other about placements (the transport is the caller's)
    service.py       KvRouter, the facade the frontend calls
"""

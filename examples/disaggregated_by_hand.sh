#!/usr/bin/env bash
# One deployment started process by process, as across machines: etcd discovery, NATS events,
# NIXL KV transfer, two prefill workers pushing KV SGLang-style and one decode worker.
# Needs etcd and nats-server on 127.0.0.1 (tests/servers.py shows how the tests start them).
set -euo pipefail
ETCD=${ETCD:-etcd://127.0.0.1:2379}
NATS=${NATS:-nats://127.0.0.1:4222}
PORT=${PORT:-8000}
NAMESPACE=${NAMESPACE:-dynamo_pd}
common=(--discovery "$ETCD" --events "$NATS" --namespace "$NAMESPACE")
pids=()
stop() {  # every process gets SIGTERM; the script exits 0 only if each of them then exits 0
  local status=$1
  trap - EXIT
  kill "${pids[@]}" 2>/dev/null || true
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  exit "$status"
}
trap 'stop 0' INT TERM
trap 'stop $?' EXIT
python -m dynamo_pd.frontend --port "$PORT" "${common[@]}" & pids+=($!)
for i in 0 1; do
  python -m dynamo_pd.prefill "${common[@]}" --kv-transport nixl --kv-handoff push --worker-id "prefill-$i" & pids+=($!)
done
python -m dynamo_pd.decode "${common[@]}" --kv-transport nixl --worker-id decode-0 & pids+=($!)
# ready once all three workers registered: /ready alone turns true with the first decode worker, and a
# request before the prefill workers join is prefilled on the decode worker (no KV moves)
python - "$PORT" <<'PY'
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/health"
for _ in range(300):
    try:
        models = json.load(urllib.request.urlopen(url, timeout=2))["models"]
        if sum(len(model["workers"]) for model in models.values()) >= 3:
            break
    except OSError:  # not up yet, or not ready (503)
        pass
    time.sleep(1)
else:
    sys.exit(f"not all 3 workers registered after 300 s: {url}")
PY
echo "ready: http://127.0.0.1:$PORT/v1 (Ctrl-C stops everything)"
wait

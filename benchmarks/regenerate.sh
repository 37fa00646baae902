#!/usr/bin/env bash
# Regenerate every result docs/benchmarks.md quotes, into benchmarks/results/, from the checked-out commit (each
# file records its command, commit, host CPU and date). About an hour on 2 cores; run it on a quiet machine.
#   benchmarks/regenerate.sh            # all of them
#   benchmarks/regenerate.sh footprint  # those named
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=benchmarks/results
all=(footprint engine_throughput structured_throughput transfer router_bench agg_vs_disagg_mocker
     agg_vs_disagg_native router_policies_mocker router_policies_native tracing_overhead
     planner_quick kv_tiers_quick vs_dynamo vs_dynamo_routing)
# NVIDIA Dynamo 1.6.1 beside it, in .venv-dynamo (python3 -m venv .venv-dynamo; pip install ai-dynamo-runtime==1.6.1;
# pip install --no-deps ai-dynamo==1.6.1; then its other dependencies, docs/benchmarks.md): router_bench adds its Rust
# RadixTree to the table when it can import it, vs_dynamo runs its frontend and mocker
dynamo_site=$(ls -d .venv-dynamo/lib/python3*/site-packages 2>/dev/null | head -1 || true)
mkdir -p "$out"
for name in "${@:-${all[@]}}"; do
  echo "== $name ($(date -u +%H:%M:%S))" >&2
  case $name in
    footprint) $py benchmarks/footprint.py > "$out/footprint.md" ;;
    engine_throughput) $py benchmarks/engine_throughput.py --threads 2 --engines native transformers vllm-cpu \
                         > "$out/engine_throughput.md" ;;
    structured_throughput) $py benchmarks/structured_throughput.py --threads 2 --rounds 5 > "$out/structured_throughput.md" ;;
    transfer) $py benchmarks/transfer_bench.py > "$out/transfer.md" ;;
    router_bench) PYTHONPATH="$dynamo_site" $py benchmarks/router_bench.py > "$out/router_bench.md" ;;
    agg_vs_disagg_mocker) $py -m benchmarks.agg_vs_disagg --engine mocker --out "$out/$name" ;;
    agg_vs_disagg_native) $py -m benchmarks.agg_vs_disagg --engine native --quick --out "$out/$name" ;;
    router_policies_mocker) $py -m benchmarks.router_policies --engine mocker --out "$out/$name" ;;
    router_policies_native) $py -m benchmarks.router_policies --engine native --quick --out "$out/$name" ;;
    planner_quick) $py -m benchmarks.planner --quick --workloads sinusoid --out "$out/$name" ;;
    tracing_overhead) $py -m benchmarks.tracing_overhead --out "$out/$name" ;;
    kv_tiers_quick) $py -m benchmarks.kv_tiers --quick --out "$out/$name" ;;
    vs_dynamo) $py -m benchmarks.vs_dynamo --workloads overhead --out "$out/$name" ;;
    vs_dynamo_routing) $py -m benchmarks.vs_dynamo --workloads prefix,mooncake --out "$out/$name" ;;
    *) echo "error: unknown result '$name' (one of: ${all[*]})" >&2; exit 2 ;;
  esac
done

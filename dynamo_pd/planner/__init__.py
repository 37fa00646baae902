"""The planner: sizes the prefill and decode pools (or the aggregated one) from live load.

    python -m dynamo_pd.planner ...            beside a deployment on Kubernetes (__main__.py)
    python -m dynamo_pd.serve --planner ...    on this host, starting and draining worker processes

Every interval: observe.py reads the deployment's planes (arrivals per pool, queued prefill, running
requests, the step costs workers measure); predict.py forecasts the next interval's load; model.py turns
load, state and costs into TTFT (queue wait + prefill) and ITL (the decode batch the load implies) for a
worker count; decide.py picks the least counts meeting --ttft-slo and --itl-slo within the limits, the
budget and a cool-down; connectors/ carry it out (local, kubernetes); loop.py ties them together, with
metrics.py's dynamo_pd_planner_* series; app.py runs it in a process. docs/planner.md has the details.
"""

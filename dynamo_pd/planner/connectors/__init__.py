"""Connectors carry out the planner's decisions: one small interface, one module per way of running workers.

    local       (connectors/local.py) worker processes on this host, as `python -m dynamo_pd.serve` starts
                them
    kubernetes  (connectors/kubernetes.py) the scale of each pool's Deployment, through the official client

A connector never kills a serving worker: a pool shrinks by draining (the worker leaves discovery, finishes
or hands on what it serves, then stops). A call that fails raises ConnectorError and leaves the pool as it
was; the planner tries again at its next interval.
"""

from __future__ import annotations

import abc


class ConnectorError(RuntimeError):
    """A scaling call failed; the pool is as it was."""


class Connector(abc.ABC):
    @abc.abstractmethod
    async def replicas(self) -> dict[str, int]:
        """Each pool's workers as this connector has set it: serving or starting, not draining."""

    @abc.abstractmethod
    async def set_replicas(self, pool: str, count: int) -> None:
        """Grow (returns once the new workers registered) or shrink (drains) `pool` to `count` workers."""

    def worker_seconds(self) -> dict[str, float] | None:
        """Per pool, the seconds its workers have existed so far (started to stopped, draining
        included); None where the connector cannot tell."""
        return None

    async def close(self) -> None:
        """Stop what the connector started itself (its workers stay unless it owns them)."""

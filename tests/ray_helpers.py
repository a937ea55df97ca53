"""Ray helpers shared by the tests that need a task to land on a given node."""

from __future__ import annotations

from typing import Any

__all__ = ["occupy_node_cpu"]


def occupy_node_cpu(node_id: str) -> Any:
    """An actor holding the only CPU of ``node_id`` until killed, so the next task lands on the other node.
    The class is local to this function: cloudpickle ships it by value (Ray's workers cannot import the
    tests package)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    class _HoldsCpu:
        def ready(self) -> bool:
            return True

    actor = ray.remote(num_cpus=1)(_HoldsCpu).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    ray.get(actor.ready.remote())
    return actor

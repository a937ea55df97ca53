"""What the tasks of a run need to reach its storage, and a check, before any task, that every node can.

**Settings** (``task_env``): the driver's non-secret object-store settings (endpoint, region, addressing
style, plain http, an Azure account: each backend's ``carried_settings``) go to every task as environment variables
in its Ray ``runtime_env``, so a node started by ``ray start`` without them reaches the same server in the
same region. They override the node's own. Credentials do not travel: each node uses its own environment,
profile or instance role, unless ``pass_credentials`` (``--pass-credentials``), which adds the driver's key,
secret and token to the same ``env_vars``. Ray then keeps them with the job's task specs in the GCS: they are
visible in the Ray dashboard and to anyone who can reach the cluster, and temporary ones (SSO, a role)
expire with the run still going.

**Check** (``check_cluster_access``): one probe task per node with CPUs, pinned there, in the tasks'
``runtime_env``: a HEAD of one input per bucket (a ``stat`` of one local input), and a small object created
and removed in the output directory (``.tmp-access-probe-*``: a killed probe's leftover is removed by the
next run's clean-up like any temp file). A node that cannot is named with what failed (the store errors
name the endpoint, the status or network error and the likely fix) and the run is refused
(``NodeAccessError``, exit 2) before anything is processed or committed.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray

from preprocess.cluster.ray_cluster import BUILD_CHECK_TIMEOUT_S, on_every_node
from shardio.write import directory as dataset_dir
from shardio.store.root import open_input
from shardio.errors import NodeAccessError, ShardioError

__all__ = ["task_env", "check_cluster_access", "probe_access"]


def task_env(paths: list[str], pass_credentials: bool = False) -> dict[str, str]:
    """Environment variables every task of a run over ``paths`` (inputs and output) gets: the driver's
    non-secret object-store settings, plus its credentials if ``pass_credentials``. Empty for local paths."""
    env: dict[str, str] = {}
    remote = {id(opened.storage): opened.storage for opened in map(open_input, paths) if not opened.is_local}
    for backend in remote.values():  # one per cloud the run touches
        env.update(backend.carried_settings())  # type: ignore[attr-defined]
        if pass_credentials:
            env.update(backend.driver_credentials())  # type: ignore[attr-defined]
    return env


def _inputs_to_probe(inputs: list[str]) -> list[str]:
    """One input per bucket (a store, its credentials and policy are per bucket) and the first local one."""
    chosen: dict[str, str] = {}
    for path in inputs:
        where = "" if open_input(path).is_local else path.split("/", 3)[2]
        chosen.setdefault(f"{path.split('://', 1)[0]}://{where}" if where else "local", path)
    return list(chosen.values())


def probe_access(inputs: list[str], output: str) -> list[str]:
    """On this node: what of ``inputs`` cannot be read and whether ``output`` cannot be written, one line
    each (empty: all good)."""
    problems = []
    for path in inputs:
        try:
            source = open_input(path)  # on this node: its backend, as a task of the run would open it
            source.storage.info(path)
        except FileNotFoundError:
            if source.is_local:  # a remote one was listed a moment ago: the store answered
                problems.append(f"{path}: not on this node's disk (on a cluster, local inputs must be on a disk "
                                "every node mounts at the same path; or put them in a bucket)")
        except (ShardioError, OSError) as e:
            problems.append(f"reading {e}" if str(e).startswith(path) else f"reading {path}: {e}")
    try:
        dataset_dir.check_writable(output, f"{socket.gethostname()}-{os.getpid()}")
    except (ShardioError, OSError) as e:
        problems.append(f"writing the output: {e}")
    return problems


def check_cluster_access(inputs: list[str], output: str, env: dict[str, str],
                         credentials_passed: bool = False) -> int:
    """Run ``probe_access`` on every node in the tasks' environment ``env``; raise ``NodeAccessError``
    naming each node that cannot read the inputs or write the output. Returns how many nodes were checked."""
    sample = _inputs_to_probe(inputs)
    try:
        answers: dict[str, Any] = on_every_node(probe_access, sample, output, env=env)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
        raise NodeAccessError(
            f"could not check that every Ray node reaches {output} ({str(e).splitlines()[0]}; waited up to "
            f"{BUILD_CHECK_TIMEOUT_S:.0f} s): a node that cannot run a probe task cannot run the job either; "
            "check `ray status`") from None
    failing = {node: problems for node, problems in answers.items() if problems}
    if not failing:
        return len(answers)
    lines = "; ".join(f"node {node}: {' | '.join(problems)}" for node, problems in sorted(failing.items()))
    hint = ""
    if env or not all(open_input(p).is_local for p in [*inputs, output]):
        secret = ("SECRET", "TOKEN", "_KEY")  # AWS_SECRET_ACCESS_KEY, AZURE_STORAGE_ACCOUNT_KEY, SAS tokens
        carried = ", ".join(sorted(k for k in env if not any(part in k for part in secret)
                                   and k != "AWS_ACCESS_KEY_ID")) or "none set on this driver"
        hint = f" The tasks get this driver's object-store settings ({carried})"
        if credentials_passed:
            hint += " and its credentials (--pass-credentials)."
        else:
            hint += ("; credentials come from each node's own environment, profile or instance role: give the "
                     "node(s) theirs, or pass this driver's with --pass-credentials (they are then kept in the "
                     "tasks' Ray runtime_env, visible in the Ray dashboard).")
    raise NodeAccessError(
        f"{len(failing)} of {len(answers)} Ray node(s) cannot reach what this run reads or writes: {lines}. "
        f"Nothing was processed.{hint}")

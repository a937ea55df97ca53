"""The Ray cluster a run uses: joined or started, one build on every node, stopped again.

Joining ``--ray-address`` is checked before the output is touched (``check_cluster_address``: unreachable,
token authentication, not a Ray GCS, each said with its fix in about a second, where ``ray.init`` retries
for ~20 s). A local Ray is started with token authentication asked for, SIGINT / SIGTERM left to the CLI's
handler, its output routed (``preprocess.cluster.ray_output``) and its processes and session directory cleaned
by ``preprocess.cluster.ray_watchdog``, also when this process is killed; ``ray_session`` stops only what it started.

One build across the cluster (``check_cluster_build``): before any task, one probe task per node that has
CPUs, pinned to it (``NodeAffinitySchedulingStrategy``, hard), reports the node's pixel libraries; a node
whose answer differs from the driver's is named and the run refused (``NodeBuildMismatch``, exit 2). Refused
rather than left out of the run: leaving a node out needs a custom resource or a placement group around every
task, and a cluster half on another Pillow is a set-up mistake to fix, not to work around quietly. A node that
joins after the check is caught by its tasks: each returns the versions it ran with (the job checks them).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import ray

import preprocess
import shardio
from preprocess.cluster.ray_output import RayOutput
from preprocess.cluster.ray_watchdog import start_watchdog
from preprocess.image.versions import build_difference, pixel_build
from shardio.errors import NodeBuildMismatch, RayUnavailable

__all__ = ["RayUnavailable", "ray_session", "check_cluster_address", "GCS_PROBE_TIMEOUT_S",
           "check_cluster_build", "node_name", "BUILD_CHECK_TIMEOUT_S", "on_every_node"]

CONNECT_TIMEOUT_S = 5.0
# A Ray GCS answers a new client in well under a second (0.4 s here, refusing one for its token included);
# a port that is something else keeps Ray's client waiting 40 s before it gives up.
GCS_PROBE_TIMEOUT_S = 10.0
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
# A node's probe is one task on an idle worker (~1-2 s to start one); a node that cannot start one in this
# long could not run the job's tasks either.
BUILD_CHECK_TIMEOUT_S = 120.0


def _check_reachable(address: str) -> None:
    """Fail in seconds on a dead address: ``ray.init`` itself can retry for minutes."""
    if address in ("auto", "local"):
        return
    host_port = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise RayUnavailable(f"Ray address {address!r}: expected HOST:PORT, ray://HOST:PORT or 'auto'")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise RayUnavailable(
            f"Ray cluster at {address} is unreachable ({e.strerror or e}); check the head node is up and "
            "the address/port (`ray status` on the head), or drop --ray-address to run locally"
        ) from None


def check_cluster_address(address: str | None, on_output: Callable[[str], None] | None = None) -> None:
    """Before a run touches its output: can this process join the Ray cluster at ``address`` (default
    ``RAY_ADDRESS``)? ``RayUnavailable`` (exit 2) naming the cause and the fix, in about a second, where
    ``ray.init`` retries for ~20 s and then says only "Failed to connect to Ray cluster".

    Checked: the address parses and accepts a TCP connection (``_check_reachable``); then, for a GCS
    address (HOST:PORT; not ``ray://``, ``auto``), one Ray ``GcsClient`` asks the cluster's id, which is
    where a cluster with token authentication (Ray's default for ``ray start --head``) refuses a client
    that sends no token (``RAY_AUTH_MODE`` unset here) or another token, at once; a port that is not a
    Ray GCS never answers, so the probe runs on a daemon thread and gives up after
    ``GCS_PROBE_TIMEOUT_S``. Nothing to check when Ray is already initialised in this process (it is used
    as found). ``on_output`` receives the lines Ray's C++ client prints meanwhile (``ray_session``'s)."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    if not address:
        return
    _check_reachable(address)
    if ray.is_initialized() or address in ("auto", "local") or "://" in address:
        return
    output = RayOutput(on_output) if on_output is not None else None
    try:
        if output is not None:
            with output.fd2():
                answer = _probe_gcs(address)
        else:
            answer = _probe_gcs(address)
    finally:
        if output is not None:
            output.release()
    if answer is None:
        raise RayUnavailable(
            f"Ray cluster at {address} accepts connections but no Ray GCS answered in {GCS_PROBE_TIMEOUT_S:g} s: "
            "is it the head's GCS port (6379 unless `ray start --head --port` said otherwise; `ray status` on "
            "the head shows the address)? A Ray Client address is ray://HOST:10001; nothing was read or written"
        )
    if isinstance(answer, BaseException):
        raise RayUnavailable(_connect_failure(address, answer))


def _probe_gcs(address: str) -> object:
    """The cluster id the GCS at ``address`` gives this client, the exception it raised, or None if none
    came in ``GCS_PROBE_TIMEOUT_S`` (the thread is left to end with the process)."""
    try:  # Ray's own client (private): the same authentication as ray.init's
        from ray._raylet import GcsClient
    except ImportError:  # another Ray: ray.init says what it says
        return True
    answer: list[object] = []

    def ask() -> None:
        try:
            answer.append(GcsClient(address=address).cluster_id)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who says what it means
            answer.append(e)

    probe = threading.Thread(target=ask, name="ray-gcs-probe", daemon=True)
    probe.start()
    probe.join(GCS_PROBE_TIMEOUT_S)  # GcsClient waits with the GIL released
    return answer[0] if answer else None


def _connect_failure(address: str, error: BaseException) -> str:
    """What a failure to join ``address`` means and what to do: token authentication (the usual cause on
    Ray 2.5x, whose ``ray start --head`` enables it) said as such, anything else with Ray's words."""
    # An AuthenticationError's str() appends Ray's general advice (~600 characters); its message is the cause.
    said = " ".join(str(getattr(error, "message", "") or error).split()) or type(error).__name__
    auth = getattr(ray.exceptions, "AuthenticationError", ())
    if isinstance(error, auth) or "InvalidAuthToken" in said or "Unauthenticated" in said:
        mode = os.environ.get(RAY_AUTH_MODE_ENV)
        if (mode or "").lower() != "token":
            why = (f"{RAY_AUTH_MODE_ENV} is {mode!r} here" if mode else f"{RAY_AUTH_MODE_ENV} is not set here") + \
                ", so this client sent no token"
        else:
            why = ("the token this client sent is missing or not the cluster's (RAY_AUTH_TOKEN, the file "
                   "RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token)")
        return (f"Ray cluster at {address} uses token authentication and refused this client: {why} (Ray: "
                f"{said}). Set {RAY_AUTH_MODE_ENV}=token and give the cluster's token: RAY_AUTH_TOKEN=... or the "
                "file ~/.ray/auth_token (RAY_AUTH_TOKEN_PATH=FILE for another), as on the head, where "
                "`ray get-auth-token` prints it; nothing was read or written")
    return (f"cannot join the Ray cluster at {address} ({type(error).__name__}: {said}); check `ray status` on "
            "the head, that this machine runs the cluster's Ray and Python versions, or drop --ray-address to "
            "run locally; nothing was read or written")


def _init_deferring_signals(**init_args: Any) -> None:
    """``ray.init`` that leaves SIGINT and SIGTERM to whoever handled them before (the CLI's handler only
    records a signal; the job acts on it once Ray is up).

    Ray's ``init`` sets its own SIGTERM handler (``sys.exit``) first thing, and its C++ core installs
    crash handlers: a SIGTERM would then tear through a half-initialised core worker, as a KeyboardInterrupt
    did for SIGINT (9 segfaults in 23 trials, rc -11). So Ray's hook is a no-op for the duration, and the
    Python handlers are set again afterwards. (``ray.init`` cannot run in a helper thread instead: the
    processes it starts are fate-shared via PR_SET_PDEATHSIG, which fires when the starting *thread* ends.)
    """
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    utils = getattr(ray._private, "utils", None)
    set_sigterm_handler = getattr(utils, "set_sigterm_handler", None)
    if set_sigterm_handler is not None:
        utils.set_sigterm_handler = lambda handler: None
    try:
        ray.init(**init_args)
    finally:
        if set_sigterm_handler is not None:
            utils.set_sigterm_handler = set_sigterm_handler
        if threading.current_thread() is threading.main_thread():
            for signum, handler in previous.items():
                if handler is not None:
                    signal.signal(signum, handler)


def _local_session() -> tuple[str, list[int]] | None:
    """The session directory and raylet pid(s) of the local Ray this process started (Ray's private API:
    None if it moved, and then the watchdog is not started)."""
    try:
        node = ray._private.worker._global_node
        raylets = node.all_processes.get(ray._private.ray_constants.PROCESS_TYPE_RAYLET, [])
        return node.get_session_dir_path(), [info.process.pid for info in raylets]
    except AttributeError:
        return None


def _ray_temp_dir() -> str:
    """Where the local Ray this run starts makes its session directory (Ray's own rule: ``RAY_TMPDIR``,
    else ``TMPDIR``, else ``/tmp``, then ``ray``; its private API when it has it)."""
    common = getattr(getattr(ray, "_common", None), "utils", None)
    default = getattr(common, "get_default_ray_temp_dir", None)
    if default is not None:
        return default()
    return os.path.join(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp", "ray")


def _ask_for_token_auth() -> None:
    """Token authentication for the local Ray this run starts, asked for explicitly.

    Ray (2.5x) turns it on for a new local instance when ``RAY_AUTH_MODE`` is unset, and then prints a
    4-line warning saying so ("Set RAY_AUTH_MODE=disabled to opt out") on every run. Set explicitly, the
    mode is, in Ray's words, respected without warning: the same protection, no noise. Ray caches its
    config, so it is re-read as Ray's own ``_enable_token_auth`` does (private API: a Ray without it keeps
    its default, and its warning). A user's own ``RAY_AUTH_MODE`` wins; a joined cluster's mode is the
    cluster's, never touched."""
    config = getattr(getattr(ray, "_raylet", None), "Config", None)
    if RAY_AUTH_MODE_ENV in os.environ or not hasattr(config, "initialize"):
        return
    os.environ[RAY_AUTH_MODE_ENV] = "token"
    config.initialize("")


@contextmanager
def ray_session(
    address: str | None, workers: int | None, on_output: Callable[[str], None] | None = None
) -> Iterator[dict[str, Any]]:
    """Use Ray as found (already initialised: tests, notebooks), join ``address``, or start it locally.

    Yields a small description (address, nodes, CPUs) for the report. Shuts down only what it started; a
    local Ray it started is cleaned up by ``preprocess.cluster.ray_watchdog`` (processes and session directory),
    also when this process is killed. ``on_output``: where the Ray it starts prints (see
    ``preprocess.cluster.ray_output``); None leaves Ray's output as Ray sends it.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        _check_reachable(address)
    started = False
    output = RayOutput(on_output) if on_output is not None else None
    watchdog = None
    if not ray.is_initialized():
        # Workers' prints reach the driver only when nothing asked for quiet or JSON-only output; a task's
        # failure still comes back as its exception.
        common: dict[str, Any] = {"include_dashboard": False, "log_to_driver": output is None,
                                  "configure_logging": True, "logging_level": "WARNING"}
        if address:
            # Ship our two packages to nodes that may not have them (their deps must be installed there).
            runtime_env = {"py_modules": [os.path.dirname(preprocess.__file__), os.path.dirname(shardio.__file__)]}
            init_args = {"address": address, "runtime_env": runtime_env, **common}
        else:
            # address="local": always a new local instance, never an existing one found on this machine.
            init_args = {"address": "local", "num_cpus": workers or os.cpu_count() or 1, **common}
            _ask_for_token_auth()
            # Before ray.init: a driver killed during its 5-9 s of start-up leaves nothing either.
            watchdog = start_watchdog(_ray_temp_dir())
        try:
            try:
                with watchdog.marking() if watchdog is not None else nullcontext():
                    if output is not None:
                        with output.fd2():
                            _init_deferring_signals(**init_args)
                        output.take_python_logging()
                    else:
                        _init_deferring_signals(**init_args)
            except (ConnectionError, RuntimeError, ray.exceptions.RayError) as e:
                if not address:
                    raise
                # Past check_cluster_address (a cluster gone since, another Ray version): said the same way.
                raise RayUnavailable(_connect_failure(address, e)) from None
            started = True
            local = _local_session() if watchdog is not None else None
            if local is not None:
                watchdog.tell(*local)  # type: ignore[union-attr]
        except BaseException:
            if started:
                ray.shutdown()
            if watchdog is not None:
                watchdog.release(wait_s=15)
            if output is not None:
                output.release()
            raise
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        yield {
            "address": address or "local",
            "nodes": len(nodes),
            "cpus": int(ray.cluster_resources().get("CPU", 0)),
        }
    finally:
        if started:
            if output is not None:
                with output.fd2():
                    ray.shutdown()
            else:
                ray.shutdown()
        if watchdog is not None:
            # Ray stopped its processes above (ray.shutdown: 1.4 s here); the watchdog then removes the
            # session directory, ~30 ms more (a straggler: SIGTERM, SIGKILL after 5 s). Never block a
            # finished run on it for long.
            watchdog.release(wait_s=15)
        if output is not None:
            output.release()


def node_name(node_id: str) -> str:
    """How reports and messages name a node: host name plus Ray node id (several raylets can share a host,
    and do in the tests)."""
    return f"{os.uname().nodename}/{node_id[:8]}"


def _probe_node(probe: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    return node_name(ray.get_runtime_context().get_node_id()), probe(*args)


def on_every_node(probe: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> dict[str, Any]:
    """``probe(*args)`` once on every alive node with CPUs, pinned there (a hard node affinity), with the
    run's task environment ``env`` (``preprocess.cluster.cluster_access.task_env``): Ray keeps a worker per
    environment, so the probes and then the tasks run on the same started workers. Returns {node name: its
    answer}. Raises Ray's error, or ``GetTimeoutError`` after ``BUILD_CHECK_TIMEOUT_S``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_retries=1)(_probe_node)
    extra = {"runtime_env": {"env_vars": env}} if env else {}
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    refs = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **extra)
            .remote(probe, *args) for node_id in nodes]
    return dict(ray.get(refs, timeout=BUILD_CHECK_TIMEOUT_S))


def check_cluster_build(probe: Callable[[], dict[str, Any]] | None = None,
                        env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Run ``probe`` (the pixel libraries) once on every alive node with CPUs, pinned there, in the tasks'
    environment ``env``, and compare each answer with the driver's own; raises ``NodeBuildMismatch`` naming
    every node that differs and how. Returns {node name: its answer}. (``probe``, default ``pixel_build``, is a
    parameter so a test can make one node differ.)"""
    probe = probe or pixel_build
    expected = probe()
    try:
        answers = on_every_node(probe, env=env)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
        raise NodeBuildMismatch(
            f"could not check the pixel libraries of every Ray node ({str(e).splitlines()[0]}): a node that cannot "
            "run a probe task cannot run the job either; check `ray status`"
        ) from None
    differing = {node: diff for node, build in answers.items() if (diff := build_difference(expected, build))}
    if differing:
        lines = "; ".join(f"node {node}: {diff}" for node, diff in sorted(differing.items()))
        raise NodeBuildMismatch(
            f"{len(differing)} of {len(answers)} Ray node(s) have other pixel libraries than this driver, so they "
            f"would write other pixels for the same input: {lines}. Nothing was processed. Install the same "
            "build on every node (`make install`; `preprocess doctor` shows it), or remove the node(s) from "
            "the cluster"
        )
    return answers

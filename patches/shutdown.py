"""Patch: `vllm serve --kv-compress` stops within a bounded time, answers every in-flight
request, and leaves no engine process behind when the API server is killed.

Measured on vLLM 0.32.0 (CPU, stock and kvcompress alike; see the README's "Shutdown"
paragraph and ``patches/README.md``):

- SIGTERM to the API server, default ``--shutdown-timeout 0``: the process manager kills
  EngineCore and its worker at once (``vllm.v1.utils.shutdown`` with timeout 0), then
  ``AsyncLLM.shutdown`` cancels its output handler. Whether in-flight requests then get an
  ``EngineDeadError`` (HTTP 500 "EngineCore encountered an issue", an error event in a
  stream) or nothing at all is a race between that cancellation and the output socket
  task's ``EngineDeadError``; when nothing arrives, uvicorn waits on "Waiting for
  connections to close" until the clients give up. SIGTERM to the whole process group
  (systemd's default ``KillMode=control-group``; Ctrl-C sends SIGINT to the group) lost
  that race every time, and killed the worker at once, so nothing could drain.
- ``--shutdown-timeout N`` (drain): the same after N s for whatever is still running.
- kill -9 of the API server: EngineCore runs on, reparented to init, with its worker.

What this module changes, for engines with the per-head cache on only:

1. ``AsyncLLM.shutdown`` (front end): in abort mode every request still in flight is
   finished by the front end itself with ``finish_reason="abort"`` (vLLM's own
   ``OutputProcessor.abort_requests``, the output a client abort or the engine's abort
   mode produces) before the engine is stopped; in drain mode the same happens right
   after the drain, for what the engine did not finish: this client's
   ``CoreEngineProcManager.shutdown`` (the first thing ``MPClient.shutdown`` does) is
   wrapped on the instance, so the answer lands before the client tears down its output
   task. Every client gets a well-formed response (non-streaming: HTTP 200 with the text so
   far; streaming: a final chunk and ``[DONE]``).
2. ``NoSignalServer.shutdown`` (vLLM's uvicorn server): uvicorn's
   ``timeout_graceful_shutdown`` is set to ``HTTP_SHUTDOWN_GRACE_S`` when unset, so a
   connection that still does not finish (a stalled client, a handler not waiting on the
   engine) is cancelled (uvicorn answers 500, or closes a started stream) instead of
   holding the exit forever.
3. A parent watch in EngineCore (from ``Executor.__init__``) and in the worker processes
   (``KVCompressCPUWorker`` / ``KVCompressGPUWorker``): a daemon thread polls, once a
   second, whether the process that started this one (``multiprocessing.parent_process``)
   still runs; when it is gone the process SIGTERMs itself (vLLM's own graceful path)
   and, if still alive ``PARENT_GONE_GRACE_S`` later, SIGKILLs its children and itself
   (backed by a SIGALRM deadline, which needs no Python thread to run).
4. Worker processes of a kvcompress engine defer SIGTERM / SIGINT while their EngineCore
   is alive (``defer_group_signals``): a signal to the whole process group then no longer
   kills the worker under the engine's feet (which ends any drain at once); the
   engine stops its workers itself (death pipe, then SIGTERM, then SIGKILL), and a
   deferred signal still ends the worker after ``WORKER_SIGNAL_DEFER_S``.
5. A worker process's shutdown (``Worker.shutdown``) arms a kernel deadline
   (``SIGALRM``, default action): the process is gone ``WORKER_EXIT_BOUND_S`` later even if
   its teardown hangs with nobody left to kill it (measured: an orphaned worker spent ~50 s
   in its teardown on a loaded 2-core machine).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

from kvcompress.patches.util import apply_once

# uvicorn's graceful-shutdown bound once the engine is stopped (s).
HTTP_SHUTDOWN_GRACE_S = 5.0
# How long a process whose parent died may take to stop by itself before it is killed (s).
PARENT_GONE_GRACE_S = 10.0
# Poll period of the parent watch (s).
PARENT_POLL_S = 1.0
# How long a worker defers a SIGTERM / SIGINT while its engine lives (s).
WORKER_SIGNAL_DEFER_S = 30.0
# Poll period of the thread that releases a held signal (s).
SIGNAL_WATCH_POLL_S = 0.2
# Longest a worker process may take from the start of its shutdown to its exit (s).
WORKER_EXIT_BOUND_S = 15.0
# How long a thread stopping the engine waits for the event loop to finish requests (s).
LOOP_CALL_TIMEOUT_S = 5.0


def _logger():
    from vllm.logger import init_logger

    return init_logger(f"vllm.{__name__}")


def kvcompress_enabled(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` runs the per-head cache (False on anything unreadable)."""
    try:
        from kvcompress.config import KVCompressConfig

        settings = KVCompressConfig.from_additional_config(
            getattr(vllm_config, "additional_config", None)
        )
    except Exception:
        return False
    return bool(settings.enabled)


# --------------------------------------------------------------------------- front end


def finish_in_flight(llm: Any) -> int:
    """Finish every request ``llm`` (an ``AsyncLLM``) still tracks with
    ``finish_reason="abort"``, on its event loop; returns how many. Safe from any thread,
    from ``__del__`` and after the loop closed (then it only drops what it cannot reach)."""
    processor = getattr(llm, "output_processor", None)
    if processor is None:
        return 0
    finished: list[int] = [0]

    def finish() -> None:
        request_ids = list(processor.request_states)
        if request_ids:
            processor.abort_requests(request_ids, internal=True)
        finished[0] = len(request_ids)

    handler = getattr(llm, "output_handler", None)
    loop = handler.get_loop() if isinstance(handler, asyncio.Future) else None
    if loop is None or loop.is_closed() or not loop.is_running():
        finish()
        return finished[0]
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        finish()
        return finished[0]
    done = threading.Event()

    def finish_and_signal() -> None:
        try:
            finish()
        finally:
            done.set()

    loop.call_soon_threadsafe(finish_and_signal)
    done.wait(LOOP_CALL_TIMEOUT_S)
    return finished[0]


def _local_engine_manager(llm: Any) -> Any:
    """The ``CoreEngineProcManager`` of ``llm``'s engine processes started by this
    client (None: in-process engine, external / Ray engines, or already gone)."""
    from vllm.v1.engine.utils import CoreEngineProcManager

    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return manager if isinstance(manager, CoreEngineProcManager) else None


def _patch_async_llm() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.shutdown

    def shutdown(self, timeout: float | None = None) -> None:
        config = getattr(self, "vllm_config", None)
        if config is None or not kvcompress_enabled(config):
            return original(self, timeout)
        abort_mode = not getattr(config, "shutdown_timeout", 0)
        answered = 0

        def answer(when: str) -> None:
            nonlocal answered
            try:
                answered += finish_in_flight(self)
            except Exception:
                _logger().exception("kvcompress: finishing in-flight requests %s failed", when)

        if abort_mode:
            # Before the engine (and with it the output handler) goes away.
            answer("before the engine stops")
        manager = _local_engine_manager(self)
        if manager is not None and not getattr(manager, "_kvcompress_answers", False):
            # MPClient.shutdown first stops the engine processes (drain up to `timeout`,
            # then kill), then tears down its sockets and output task, whose
            # EngineDeadError races any later answer and often wins (HTTP 500). So the
            # requests the drain did not finish are answered in between: right after the
            # manager's shutdown, on this manager instance only.
            # Only the first call stops anything (vLLM's is idempotent): the engine
            # monitor thread calls it again as soon as the first one begins, and must
            # not answer requests the drain is still serving.
            stop_engines = manager.shutdown
            first_call = threading.Lock()

            def shutdown_then_answer(timeout: float | None = None) -> None:
                stopping = first_call.acquire(blocking=False)
                try:
                    stop_engines(timeout=timeout)
                finally:
                    if stopping:
                        answer("after the drain")

            manager.shutdown = shutdown_then_answer
            manager._kvcompress_answers = True
        try:
            original(self, timeout)
        finally:
            # Requests that arrived while the engine stopped.
            answer("after shutdown")
            if answered:
                _logger().info(
                    "kvcompress: shutdown answered %d in-flight request(s) with "
                    "finish_reason=abort",
                    answered,
                )

    shutdown.__wrapped__ = original  # type: ignore[attr-defined]
    AsyncLLM.shutdown = shutdown


def _patch_http_server() -> None:
    from vllm.entrypoints.launchers.launcher import NoSignalServer

    original = NoSignalServer.shutdown

    async def shutdown(self, sockets=None) -> None:
        state = getattr(getattr(self.config, "app", None), "state", None)
        engine = getattr(state, "engine_client", None) if state is not None else None
        if (
            self.config.timeout_graceful_shutdown is None
            and engine is not None
            and kvcompress_enabled(getattr(engine, "vllm_config", None))
        ):
            self.config.timeout_graceful_shutdown = HTTP_SHUTDOWN_GRACE_S
        await original(self, sockets)

    shutdown.__wrapped__ = original  # type: ignore[attr-defined]
    NoSignalServer.shutdown = shutdown


# ------------------------------------------------------------------ engine processes

_watch_lock = threading.Lock()
_watching = False


def _engine_child_process(roles: tuple[str, ...] = ("EngineCore", "VllmWorker")) -> bool:
    """True in a process vLLM started for an engine whose name starts with one of
    ``roles`` (EngineCore, EngineCore_DP<i>, VllmWorker-<rank>), never in the user's own
    process (in-process engines)."""
    if multiprocessing.parent_process() is None:
        return False
    return multiprocessing.current_process().name.startswith(roles)


def _alive(process: Any) -> bool:
    import psutil

    if process is None:
        return False
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _parent_handle() -> Any:
    """A psutil handle on this process's multiprocessing parent (None: already gone).

    The multiprocessing parent, not ``os.getppid()``: with the ``forkserver`` start
    method the OS parent is the fork server, while the process that owns this one (and
    stops it) is the one that asked for it."""
    import psutil

    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return None
    try:
        handle = psutil.Process(parent.pid)
        if handle.create_time() > psutil.Process().create_time():
            return None  # the pid was reused: the parent died before we looked
        return handle
    except psutil.Error:
        return None


def _kill_self_and_children() -> None:
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def arm_exit_deadline(seconds: float) -> bool:
    """Let the kernel end this process in ``seconds`` (or sooner if already armed):
    SIGALRM's default action needs no Python, so it also ends a process whose main
    thread holds the GIL in native code or is tearing the interpreter down, when no
    Python thread can run any more. Skipped (False) if someone handles SIGALRM."""
    if signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None):
        return False
    wanted = max(1, math.ceil(seconds))
    earlier = signal.alarm(0)
    signal.alarm(min(wanted, earlier) if earlier else wanted)
    return True


def _watch_parent(parent: Any, role: str, grace_s: float, poll_s: float) -> None:
    while _alive(parent):
        time.sleep(poll_s)
    pid = getattr(parent, "pid", "?")
    _logger().warning(
        "kvcompress: %s (pid %d): parent process %s is gone; shutting down",
        role, os.getpid(), pid,
    )
    arm_exit_deadline(grace_s + 1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    _logger().warning(
        "kvcompress: %s (pid %d) did not stop within %.0f s of its parent's death; killing it",
        role, os.getpid(), grace_s,
    )
    _kill_self_and_children()


def watch_parent(
    role: str, grace_s: float = PARENT_GONE_GRACE_S, poll_s: float = PARENT_POLL_S
) -> bool:
    """End this engine process when the process that started it is gone.

    Only in processes vLLM starts for an engine (see ``_engine_child_process``); at
    most one watch per process. Polls rather than ``prctl(PR_SET_PDEATHSIG)``: the
    death signal fires when the parent *thread* that forked us exits, which would kill
    an engine a user created from a short-lived thread. Returns whether a watch started.
    """
    global _watching
    if not _engine_child_process():
        return False
    with _watch_lock:
        if _watching:
            return False
        _watching = True
    parent = _parent_handle()
    threading.Thread(
        target=_watch_parent,
        args=(parent, role, grace_s, poll_s),
        daemon=True,
        name="KVCompressParentWatch",
    ).start()
    return True


def _patch_executor() -> None:
    from vllm.v1.executor.abstract import Executor

    original = Executor.__init__

    def __init__(self, vllm_config, *args, **kwargs):
        # Runs in EngineCore, before the model loads; a no-op in the user's process.
        if kvcompress_enabled(vllm_config):
            watch_parent("EngineCore")
        original(self, vllm_config, *args, **kwargs)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    Executor.__init__ = __init__


def defer_group_signals(defer_s: float = WORKER_SIGNAL_DEFER_S) -> bool:
    """In a worker process: hold SIGTERM / SIGINT while the engine that owns this worker
    lives, so a signal to the whole process group leaves the engine to stop its workers
    (drain, then death pipe / SIGTERM / SIGKILL from ``MultiprocExecutor.shutdown``).

    A held signal is delivered to vLLM's handler (SystemExit) as soon as the engine is
    gone, at a second signal, or ``defer_s`` after the first one. Only in
    ``VllmWorker-*`` processes' main thread; returns whether the handler was set.

    The handler itself only records the signal: it runs between two bytecodes of
    whatever the main thread was doing, so it takes no lock (starting a thread or
    logging there can deadlock on a lock the interrupted code holds, or raise a
    reentrant-write error into the model step). A watch thread started here does the
    rest (logging, the deadline, re-raising the held signal).
    """
    if not _engine_child_process(("VllmWorker",)):
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    parent = _parent_handle()
    originals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    held: list[tuple[float, int]] = []  # (monotonic time, signal number), appended only
    released: list[bool] = []  # the next signal goes to vLLM (engine gone, deadline, delivered)

    def deliver(signum: int, frame: Any) -> None:
        original = originals.get(signum)
        if callable(original):
            original(signum, frame)
        elif original != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def handler(signum: int, frame: Any) -> None:
        # A second signal (the engine's own terminate() after its grace period, a
        # second Ctrl-C) is delivered at once, as is any signal once released.
        if held or released:
            released.append(True)
            deliver(signum, frame)
            return
        held.append((time.monotonic(), signum))

    def watch() -> None:
        while not held and not released:
            time.sleep(SIGNAL_WATCH_POLL_S)
        if released:
            return  # delivered at once: nothing held
        since, signum = held[0]
        _logger().info(
            "kvcompress: worker (pid %d) holds %s while its engine (pid %s) stops it",
            os.getpid(), signal.Signals(signum).name, getattr(parent, "pid", "?"),
        )
        while time.monotonic() < since + defer_s and _alive(parent) and not released:
            time.sleep(SIGNAL_WATCH_POLL_S)
        if released:
            return  # a second signal already went to vLLM
        released.append(True)
        os.kill(os.getpid(), signal.SIGTERM)

    if not _alive(parent):
        released.append(True)
    for sig in originals:
        signal.signal(sig, handler)
    threading.Thread(target=watch, daemon=True, name="KVCompressSignalDefer").start()
    return True


def guard_worker_process(vllm_config: Any) -> None:
    """Called by kvcompress's worker classes when they are built: in a ``VllmWorker-*``
    process, watch the engine (``watch_parent``) and hold group signals while it lives
    (``defer_group_signals``, for the engine's drain time plus ``WORKER_SIGNAL_DEFER_S``).
    A no-op where the worker runs inside EngineCore (``uni`` executor) or the user's
    process."""
    if not _engine_child_process(("VllmWorker",)):
        return
    watch_parent("worker")
    drain_s = float(getattr(vllm_config, "shutdown_timeout", 0) or 0)
    defer_group_signals(WORKER_SIGNAL_DEFER_S + drain_s)


def bound_worker_exit() -> None:
    """Called by kvcompress's worker classes when vLLM shuts them down: in a
    ``VllmWorker-*`` process, the process is ended ``WORKER_EXIT_BOUND_S`` later at the
    latest (``arm_exit_deadline``). With its engine alive vLLM bounds this itself (SIGTERM,
    SIGKILL); an orphaned worker has nobody else to do it. Never in EngineCore or the
    user's process."""
    if _engine_child_process(("VllmWorker",)):
        arm_exit_deadline(WORKER_EXIT_BOUND_S)


class WorkerProcessGuard:
    """Mixin for kvcompress's worker classes (``KVCompressCPUWorker``,
    ``KVCompressGPUWorker``): in a ``VllmWorker-*`` process, exit when the engine is gone
    and leave group signals to the engine (``guard_worker_process``); once shut down, end
    within ``WORKER_EXIT_BOUND_S`` (``bound_worker_exit``), orphaned or not."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        guard_worker_process(self.vllm_config)

    def shutdown(self) -> None:
        bound_worker_exit()
        super().shutdown()


def apply() -> None:
    if not apply_once("shutdown"):
        return
    _patch_async_llm()
    _patch_executor()
    try:
        _patch_http_server()
    except ImportError:  # the OpenAI server's dependencies are optional
        pass

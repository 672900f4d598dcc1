"""Graceful drain: on SIGTERM `make serve` stops taking calls, lets the calls in flight finish for up to the drain
time, ends the rest with CANCELLED, then stops Serve and Ray.

Ray Serve's own shutdown stops the proxies together with the replicas, so streams in flight would break; the drain
happens before it, in three parts:
- `DrainBoard`, a tiny named actor (`genserve-drain`), holds the state; services/serve.py flips it on SIGTERM;
- each replica process runs one `DrainWatch`: a daemon thread that reports the replica's calls in flight to the
  board every POLL_S and reads the state back. The handler wrappers (services/common/rpc.py) ask it to admit a call
  (UNAVAILABLE while draining) and register the calls they run; past the deadline it cancels those (CANCELLED);
- services/serve.py waits until no replica reports a call in flight, or the deadline passes, then shuts down.
Replicas that scale down drain through Ray Serve itself: their deployments' graceful_shutdown_timeout_s is
DRAIN_SECONDS (services/common/deploy_config.py). Without a board (a KubeRay cluster: no services/serve.py) a
replica never drains this way; Ray's graceful shutdown still lets its calls finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from .errors import Cancelled

logger = logging.getLogger("ray.serve")

ACTOR_NAME = "genserve-drain"
NAMESPACE = "genserve"
# How long in-flight calls may run after SIGTERM (`--drain-seconds`, GENSERVE_DRAIN_SECONDS); also the deployments'
# graceful_shutdown_timeout_s, so a replica that scales down waits as long for its calls.
DRAIN_SECONDS = 30.0
# How often a replica that scales down counts its calls in flight (Ray Serve's graceful_shutdown_wait_loop_s).
SHUTDOWN_WAIT_LOOP_S = 1.0
POLL_S = 0.5  # a replica reports to the board this often: the delay before it refuses calls
NO_BOARD_POLL_S = 5.0  # looking for a board that does not exist (yet)
REPORT_TIMEOUT_S = 5.0
FRESH_S = 6 * POLL_S  # a replica whose last report is older is gone (stopped, or replaced)
CUT_MESSAGE = "the server is shutting down and its drain time ran out; the call was ended"
DRAINING_MESSAGE = "the server is draining (shutting down) and takes no new calls; retry, or call another server"

Phase = Literal["serving", "draining", "stopping"]


@dataclass(frozen=True)
class DrainState:
    """`draining`: no new calls; past `deadline` (time.time()) the calls still running are ended. `stopping`: the
    calls are done and Serve is about to stop (health Watch streams end)."""

    phase: Phase = "serving"
    deadline: float = math.inf

    @property
    def draining(self) -> bool:
        return self.phase != "serving"

    @property
    def stopping(self) -> bool:
        return self.phase == "stopping"

    def cut(self, now: float) -> bool:
        return self.draining and now >= self.deadline


class DrainBoard:
    """The drain state and each replica's last report: what services/serve.py waits on. Run as a Ray actor."""

    def __init__(self) -> None:
        self._state = DrainState()
        self._started = math.inf
        self._reports: dict[str, tuple[int, float]] = {}  # replica -> (calls in flight, time.time() of the report)

    def state(self) -> DrainState:
        return self._state

    def start(self, seconds: float, now: float | None = None) -> DrainState:
        """Begin draining (once; a second call keeps the first deadline)."""
        now = time.time() if now is None else now
        if not self._state.draining:
            self._state, self._started = DrainState("draining", now + seconds), now
        return self._state

    def stop(self) -> DrainState:
        self._state = DrainState("stopping", self._state.deadline)
        return self._state

    def report(self, replica: str, in_flight: int, now: float | None = None) -> DrainState:
        self._reports[replica] = (in_flight, time.time() if now is None else now)
        return self._state

    def pending(self, now: float | None = None) -> int:
        """Calls still in flight across live replicas; a live replica that has not reported since the drain began
        counts as one (it may have admitted a call just before it learned of the drain)."""
        now = time.time() if now is None else now
        total = 0
        for in_flight, at in self._reports.values():
            if now - at <= FRESH_S:
                total += in_flight if at >= self._started else max(in_flight, 1)
        return total


def create_board() -> Any:
    """The board actor for this Ray cluster (services/serve.py, before it deploys; it dies with the driver)."""
    import ray

    actor = ray.remote(num_cpus=0)(DrainBoard)
    return actor.options(name=ACTOR_NAME, namespace=NAMESPACE, get_if_exists=True).remote()


def find_board() -> Any | None:
    """The board, or None outside Ray or where nobody created one."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        return ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


class RayReporter:
    """Sends this replica's count to the board and returns the board's state (None: there is no board)."""

    def __init__(self) -> None:
        self._board: Any | None = None
        self._replica = f"{os.uname().nodename}:{os.getpid()}"

    def __call__(self, in_flight: int) -> DrainState | None:
        import ray

        self._board = self._board or find_board()
        if self._board is None:
            return None
        return ray.get(self._board.report.remote(self._replica, in_flight), timeout=REPORT_TIMEOUT_S)


class DrainWatch:
    """One replica's view of the board, and the calls it is running (asyncio tasks, on whatever loop ran them)."""

    def __init__(self, report: Callable[[int], DrainState | None], clock: Callable[[], float] = time.time):
        self.state = DrainState()
        self._report = report
        self._clock = clock
        self._lock = threading.Lock()
        self._calls: dict[asyncio.Task, asyncio.AbstractEventLoop] = {}
        self._cut: set[asyncio.Task] = set()
        self._polled = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def current(self) -> DrainState:
        """The latest state. The first call starts the polling thread and waits for its first poll (milliseconds),
        so a replica never answers from a state it has not read."""
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._poll_forever, name="genserve-drain-watch",
                                                    daemon=True)
                    self._thread.start()
        self._polled.wait(REPORT_TIMEOUT_S)
        return self.state

    def poll(self) -> bool:
        """Report once and take the board's state; past the deadline, cancel the calls still running. False when
        there is no board."""
        try:
            state = self._report(self.in_flight)
        except Exception:  # the board is unreachable (Ray stopping): keep the last state
            logger.debug("drain: report failed", exc_info=True)
            state = self.state
        self._polled.set()
        if state is None:
            return False
        self.state = state
        if state.cut(self._clock()):
            self._cut_short()
        return True

    def _poll_forever(self) -> None:
        while True:
            time.sleep(POLL_S if self.poll() else NO_BOARD_POLL_S)

    def _cut_short(self) -> None:
        with self._lock:
            calls = [(task, loop) for task, loop in self._calls.items() if task not in self._cut]
            self._cut.update(task for task, _ in calls)
        for task, loop in calls:
            loop.call_soon_threadsafe(task.cancel)

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Count the running task as a call in flight; a cancellation that came from the drain's deadline leaves
        as `Cancelled` (CANCELLED with a message that says why), any other as itself."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        with self._lock:
            self._calls[task] = asyncio.get_running_loop()
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            task.uncancel()
            raise Cancelled(CUT_MESSAGE) from None
        finally:
            with self._lock:
                self._calls.pop(task, None)
                self._cut.discard(task)


@functools.cache
def watch() -> DrainWatch:
    """This process's watch: a replica process hosts one deployment, and all its calls share the one board."""
    return DrainWatch(RayReporter())


def drain_seconds(configured: float | None = None) -> float:
    return configured if configured is not None else float(os.environ.get("GENSERVE_DRAIN_SECONDS", DRAIN_SECONDS))

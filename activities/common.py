"""What every sync activity shares: shielding from the SDK's cancel exception,
a heartbeat ticker, cooperative cancellation, and error mapping for Temporal.

Sync activities run on the worker's thread pool. By default the SDK cancels
one by raising an exception *into its thread* at whatever line it runs; in
the middle of a PyMySQL read that leaves the pooled connection out of sync
(``(2014, 'Command Out of Sync')`` on its next use, then ``InterfaceError``).
So every sync activity runs shielded (:func:`fatal_is_final`, :func:`shielded`)
and cancellation takes effect only at safe points: :func:`heartbeat` and
:func:`raise_if_cancelled`, called between transactions, or when it returns.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.exc import DBAPIError
from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory, CancelledError

from nexuscrm.db.dialect import describe_error, is_lock_conflict, is_permanent, is_transient
from nexuscrm.errors import FatalError, VerifyError

P = ParamSpec("P")
R = TypeVar("R")

MAX_MESSAGE_CHARS = 4000
"""Longest failure message an activity reports (the rest is cut, saying how much)."""

MAX_FINDINGS = 500
"""Most verify findings a failure carries as details (the message counts them all)."""


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` cut to ``limit`` characters, its head kept and the cut counted."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... [{len(message) - limit} more characters]"


def _shield() -> contextlib.AbstractContextManager[None]:
    """``activity.shield_thread_cancel_exception()`` inside an activity; nothing
    outside one (an activity method called directly, as tests and tools do)."""
    if activity.in_activity():
        return activity.shield_thread_cancel_exception()
    return contextlib.nullcontext()


class _Ticker:
    """Heartbeats every ``interval`` seconds from a side thread while a phase runs.

    Every remote phase heartbeats, not only the ones with progress to report,
    so a worker that dies in any phase is noticed within the heartbeat timeout
    instead of the phase's start-to-close limit. The ticker repeats the last
    details the phase reported, so resumable phases keep their progress. It is
    the activity's only heartbeat source: :func:`heartbeat` hands it details,
    :func:`progress` only restarts its stall clock.

    Local activities get no ticker (:func:`_wants_ticker`): they have no
    heartbeat timeout, the server never sees their heartbeats, and their
    start-to-close (a few seconds) is their only bound.

    A beat vouches that the attempt is alive, so the ticker must not vouch for
    an attempt that stopped making progress: a phase that reports progress
    (:func:`expect_progress`, then :func:`heartbeat` / :func:`progress` at each
    step) gets ``stall_after`` seconds between two reports, after which the
    ticker stops beating and the server times the attempt out one heartbeat
    timeout later. The bound is the phase's longest legitimate step, not a
    guess at a typical one: ``process`` sets it to the flow deadline (which
    bounds every external call) plus a lease, so a slow but legitimate call
    is kept alive and only a hung one is timed out.

    Chores (:func:`keep_alive`) run every ``every`` seconds for as long as the
    ticker vouches for the attempt, on a second thread of the ticker (a chore
    that waits on the database, such as a lease extension behind a finishing
    transaction, never delays a heartbeat). ``process`` keeps its batch's
    leases alive this way, so the leases live exactly as long as the
    heartbeats (stopped by a stall, or when the phase returns) and never
    depend on item boundaries. A chore's exception is logged and retried at
    its next turn. Chores keep running after a cancellation: the phase still
    finishes the step in hand (cancellation takes effect at its next safe
    point), and that step still needs what the chore keeps (an attempt the
    server already gave up has its leases handed back by the workflow, so
    extending them then changes nothing).
    """

    def __init__(self, interval: float | None = None) -> None:
        self.interval = beat_interval() if interval is None else interval
        self.details: tuple[Any, ...] = ()
        self.stall_after: float | None = None
        self.last_progress = time.monotonic()
        self.stalled = False
        self.chores: list[_Chore] = []
        self._stop = threading.Event()
        self._ctx = contextvars.copy_context()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._chore_thread: threading.Thread | None = None

    def beat(self, *details: Any) -> None:
        self.details = details
        self.last_progress = time.monotonic()
        activity.heartbeat(*details)

    def _overdue(self) -> float | None:
        """Seconds without progress when past ``stall_after`` (the attempt is hung), else None."""
        stall = self.stall_after
        quiet = time.monotonic() - self.last_progress
        return quiet if self.stalled or (stall is not None and quiet > stall) else None

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                quiet = self._overdue()
                if quiet is not None:
                    # No progress for longer than the bound: stop vouching (the
                    # chores stop too); the server times the attempt out after
                    # its heartbeat timeout.
                    self.stalled = True
                    self._ctx.run(
                        activity.logger.warning,
                        "no progress for %.1f s (bound %.1f s): heartbeats stopped",
                        quiet,
                        self.stall_after,
                    )
                    return
                self._ctx.run(activity.heartbeat, *self.details)
        except BaseException:  # a cancellation raised into this thread ends the ticker only
            return

    def add_chore(self, chore: _Chore) -> None:
        """Run ``chore`` from now on (starts the chore thread with the first one)."""
        self.chores.append(chore)
        if self._chore_thread is None:
            self._chore_thread = threading.Thread(target=self._run_chores, daemon=True)
            self._chore_thread.start()

    def _run_chores(self) -> None:
        try:
            while not self._stop.wait(
                max(0.05, min(c.due for c in self.chores) - time.monotonic())
            ):
                if self._overdue() is not None:
                    return  # hung: what the chores keep alive must lapse now
                for chore in list(self.chores):
                    if time.monotonic() >= chore.due:
                        chore.due = time.monotonic() + chore.every
                        self._ctx.run(chore.run)
        except BaseException:  # a cancellation raised into this thread ends the chores only
            return

    def __enter__(self) -> _Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        if self._chore_thread is not None:
            self._chore_thread.join(timeout=1)


class _Chore:
    """A function the ticker runs every ``every`` seconds (see :func:`keep_alive`)."""

    def __init__(self, fn: Callable[[], object], every: float) -> None:
        self.fn = fn
        self.every = every
        self.due = time.monotonic() + every

    def run(self) -> None:
        try:
            self.fn()
        except Exception as exc:  # retried at its next turn
            activity.logger.warning("ticker chore failed (retried): %s", describe_error(exc))


def _wants_ticker() -> bool:
    """True inside a remote activity (local ones have no heartbeat timeout)."""
    if not activity.in_activity():
        return False
    return not activity.info().is_local


_TICKER: contextvars.ContextVar[_Ticker | None] = contextvars.ContextVar("_TICKER", default=None)


def beat_interval(default: float = 5.0) -> float:
    """Seconds between two ticker heartbeats of the current activity.

    A third of the activity's heartbeat timeout (so two beats may be lost or
    delayed by a loaded machine before the server times the attempt out),
    at most ``default`` and at least 0.1 s; ``default`` when the activity has
    no heartbeat timeout or runs outside an activity.
    """
    try:
        timeout = activity.info().heartbeat_timeout
    except RuntimeError:
        return default
    if not timeout:
        return default
    return max(0.1, min(default, timeout.total_seconds() / 3))


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` at a safe point if the activity was cancelled.

    Sync activities run shielded from the SDK's asynchronous cancel exception
    (see :func:`fatal_is_final`), so cancellation is cooperative: it takes
    effect here, between database statements, never in the middle of a
    driver's read (an exception raised into PyMySQL mid-packet leaves the
    pooled connection out of sync: ``(2014, 'Command Out of Sync')``).
    """
    try:
        cancelled = activity.is_cancelled()
    except RuntimeError:
        return
    if cancelled:
        raise CancelledError("activity cancelled")


def stop_requested() -> bool:
    """True when the activity should stop starting new work: cancelled, or the
    worker shuts down (``activity.is_worker_shutdown()``: SIGTERM, the start
    of the worker's graceful shutdown timeout). False outside an activity."""
    if not activity.in_activity():
        return False
    return activity.is_worker_shutdown() or activity.is_cancelled()


def heartbeat(*details: Any) -> None:
    """Report progress from inside a phase (kept by the ticker between calls).

    Also the phase's cancellation point: raises ``CancelledError`` when the
    activity was cancelled (:func:`raise_if_cancelled`). In a local activity
    only the cancellation point (the server takes no heartbeats from them).
    """
    raise_if_cancelled()
    ticker = _TICKER.get()
    if ticker is not None:
        ticker.beat(*details)
    elif activity.in_activity() and not activity.info().is_local:
        activity.heartbeat(*details)


def progress() -> None:
    """Note progress without a heartbeat (cheap: call it after every item).

    Restarts the current ticker's stall clock (:func:`expect_progress`); the
    ticker's next beat carries the news. Nothing outside a ticked activity.
    """
    ticker = _TICKER.get()
    if ticker is not None:
        ticker.last_progress = time.monotonic()


def expect_progress(within_seconds: float | None) -> None:
    """From now on, keep heartbeating only while progress comes every ``within_seconds``.

    Progress is :func:`heartbeat` or :func:`progress`. When none came for
    longer than ``within_seconds``, the ticker stops beating (and running its
    chores, :func:`keep_alive`), so the server times the attempt out (one
    heartbeat timeout later) instead of a hung step keeping it alive until its
    start-to-close. ``None`` lifts the bound (the start-to-close bounds the
    phase). Pick the longest legitimate step as the bound (see
    :class:`_Ticker`). Nothing outside a ticked activity.
    """
    ticker = _TICKER.get()
    if ticker is not None:
        ticker.last_progress = time.monotonic()
        ticker.stall_after = within_seconds


LOCK_CONFLICT_RETRIED = "database lock conflict, retried"
"""The one warning line of an expected lock conflict (:func:`lock_conflict_failure`)."""


def lock_conflict_failure(exc: BaseException) -> ApplicationError | None:
    """An expected lock conflict as one warning line and a quiet, retryable failure.

    A deadlock or lock wait between concurrent transactions (see
    :func:`nexuscrm.db.dialect.is_lock_conflict`), or a queue lock not
    granted in time (``TimeoutError`` named ``QueueLockTimeout``), is
    retried by the activity's retry policy: it is logged here as one line
    (:data:`LOCK_CONFLICT_RETRIED`, the activity and the driver's message,
    no traceback) and returned as a retryable ``ApplicationError`` of category
    ``BENIGN`` (the SDK then logs its traceback at DEBUG only), type = the
    exception's class name. ``None`` for anything else: real errors stay loud.
    """
    if not (is_lock_conflict(exc) or type(exc).__name__ == "QueueLockTimeout"):
        return None
    # Imported here: workflow modules import this one, and the workflow
    # sandbox refuses structlog's import-time use of random.
    from nexuscrm.log import log

    name = activity.info().activity_type if activity.in_activity() else ""
    message = describe_error(exc, 300, with_type=False)
    log.warning(LOCK_CONFLICT_RETRIED, activity=name, error=message)
    return ApplicationError(
        message, type=type(exc).__name__, category=ApplicationErrorCategory.BENIGN
    )


def keep_alive(fn: Callable[[], object], every_seconds: float) -> None:
    """Run ``fn`` every ``every_seconds`` from the ticker while the attempt lives.

    For things that must live exactly as long as the activity is alive and
    working, such as a batch's leases: ``fn`` runs until the phase returns or
    the ticker stops vouching for it (:func:`expect_progress`), on the
    ticker's chore thread (never the phase's own, nor the heartbeats'). The
    first run is ``every_seconds`` from now. ``fn`` must be thread-safe with the phase; its
    exceptions are logged and it is called again at its next turn. Raises
    ``ValueError`` for a non-positive ``every_seconds``; in a local activity
    or outside an activity (no ticker) ``fn`` never runs.
    """
    if not every_seconds > 0:
        raise ValueError(f"keep_alive: every_seconds must be positive, got {every_seconds!r}")
    ticker = _TICKER.get()
    if ticker is not None:
        ticker.add_chore(_Chore(fn, every_seconds))


FATAL_FAILED = "activity failed"
"""The one warning line of a domain error (:func:`_fatal_failure`)."""


def _fatal_failure(exc: BaseException, details: list[Any]) -> ApplicationError:
    """A domain ``FatalError`` (bad input the operator must fix: a pack's
    problems, a verify finding, a lost lease) as one warning line and a
    non-retryable ``ApplicationError`` of category ``BENIGN``: the SDK then
    logs its traceback at DEBUG only (a missing pack source printed a full
    ``PackProblems`` traceback in the worker's log). The failure keeps its
    message, details and cause for the workflow, the Web UI and the CLI."""
    from nexuscrm.log import log

    name = activity.info().activity_type if activity.in_activity() else ""
    message = bounded(str(exc))
    log.warning(FATAL_FAILED, activity=name, error_type=type(exc).__name__, error=message[:300])
    return ApplicationError(
        message,
        *details,
        type=type(exc).__name__,
        non_retryable=True,
        category=ApplicationErrorCategory.BENIGN,
    )


def fatal_is_final(fn: Callable[P, R]) -> Callable[P, R]:
    """Run a sync activity shielded and heartbeating; map its errors for Temporal.

    The body runs inside ``activity.shield_thread_cancel_exception()``: the
    SDK's cancel exception is never raised into the middle of a database
    call (that corrupts the pooled PyMySQL connection); cancellation takes
    effect at :func:`heartbeat` / :func:`raise_if_cancelled`, or when the body
    returns. In a remote activity a :class:`_Ticker` heartbeats every third
    of the heartbeat timeout meanwhile (none in a local activity; a phase
    can bound it by progress, :func:`expect_progress`).

    Domain ``FatalError``s become non-retryable ``ApplicationError``s whose
    type is the exception's class name (``ManifestError``, ``LeaseLostError``
    ...), so workflows and operators can tell them apart. Transient database
    errors propagate and are retried with backoff; other database and I/O
    errors are retried up to the policy's attempts unless known permanent
    (:func:`~nexuscrm.db.dialect.is_permanent`); any other exception fails
    at once (non-retryable): it would repeat identically. A cancellation propagates
    as a cancellation. Messages are bounded (:data:`MAX_MESSAGE_CHARS`).
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        ticker = _Ticker() if _wants_ticker() else None
        token = _TICKER.set(ticker)
        try:
            with _shield(), ticker or contextlib.nullcontext():
                return fn(*args, **kwargs)
        except CancelledError:
            raise
        except FatalError as exc:
            details: list[Any] = []
            if isinstance(exc, VerifyError):
                details = [[bounded(f, 1000) for f in exc.findings[:MAX_FINDINGS]]]
            raise _fatal_failure(exc, details) from exc
        except Exception as exc:
            quiet = lock_conflict_failure(exc)
            if quiet is not None:
                raise quiet from None
            if is_transient(exc):
                raise
            # Retried (with backoff, up to the policy's attempts) only when a
            # retry might help: a database or I/O error not known to repeat.
            # A permanent database error (constraint, syntax, collation ...)
            # and any other exception (a bug, RecursionError, MemoryError on
            # hostile input) would repeat identically: fail now.
            retry = isinstance(exc, DBAPIError | OSError) and not is_permanent(exc)
            raise ApplicationError(
                bounded(describe_error(exc, with_type=False)),
                type=type(exc).__name__,
                non_retryable=not retry,
            ) from exc
        finally:
            _TICKER.reset(token)

    return wrapper


def shielded(fn: Callable[P, R]) -> Callable[P, R]:
    """Run a sync activity inside ``activity.shield_thread_cancel_exception()``.

    For short activities that need no error mapping (identity probe, wake,
    expire): a cancellation (a wait abandoning its probe, a worker shutting
    down) takes effect when the body returns, never inside a database call.
    An expected lock conflict fails the attempt as one warning line
    (:func:`lock_conflict_failure`).
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with _shield():
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                quiet = lock_conflict_failure(exc)
                if quiet is not None:
                    raise quiet from None
                raise

    return wrapper


def quiet_lock_conflicts(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """For an async activity: an expected lock conflict fails it as one warning
    line (:func:`lock_conflict_failure`); anything else propagates unchanged."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except Exception as exc:
            quiet = lock_conflict_failure(exc)
            if quiet is not None:
                raise quiet from None
            raise

    return wrapper


class BatchLoad:
    """Inbound batches running in this worker process, for background work that
    yields to them (identity waits' completion, issue 16).

    ``batch()`` wraps one ``connectors.process`` attempt (thread-safe);
    ``busy()`` is true while one runs and for ``quiet_seconds`` after the last
    ended (the next claim of a pool that just finished a batch). Process-local:
    other worker processes' batches are not seen.
    """

    def __init__(self, quiet_seconds: float = 0.5) -> None:
        self.quiet_seconds = quiet_seconds
        self._lock = threading.Lock()
        self._running = 0
        self._last_end = float("-inf")

    @contextlib.contextmanager
    def batch(self) -> Any:
        """Count one batch as running for the duration of the ``with`` block."""
        with self._lock:
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._last_end = time.monotonic()

    def busy(self) -> bool:
        """A batch runs, or one ended less than ``quiet_seconds`` ago."""
        with self._lock:
            return self._running > 0 or time.monotonic() - self._last_end < self.quiet_seconds

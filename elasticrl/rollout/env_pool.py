"""The env instances of an episode runner (``EnvPool``), each on a thread of its own (``EnvThread``).

``EnvPool`` builds an env with a deadline, hands it to one episode at a time (reused through
``reset``), runs its sync methods on its thread, discards it when it fails (closed once its last
call returns) and closes every one at the end, each exactly once, including one whose build
returns after its episode is gone.

Every env instance has a thread of its own instead of a shared pool: a call that hangs past its
deadline (a browser that never answers) then holds only its own env's thread, and that env is
discarded. A pool sized to the episodes in flight was used up by a few hung calls, and every later
env call of the runner timed out. The threads are daemons, so a hung call does not hold up the exit
of the process either (a pool's threads are joined at exit). And an env whose library is bound to
the thread that created it (Playwright's sync API) is built and driven on one thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from elasticrl.env.base import EnvError, call_close, env_label
from elasticrl.env.wrappers import TurnLimit

log = logging.getLogger(__name__)

_names = itertools.count()


class EnvThread:
    """A daemon thread that runs the calls ``submit`` gives it, one at a time, in order."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"env-{next(_names)}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` after the calls submitted before it; its result or exception in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, future))
        return future

    def stop(self) -> None:
        """End the thread once the calls submitted so far have run (at once if none is running)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller's to handle, through the future
                future.set_exception(exc)


class EnvPool:
    """The envs of one runner, used on its event loop ``loop`` (``_orphan`` and ``_close_soon``
    excepted: any thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, make_env: Callable[[], Any], *, max_turns: int, timeout_s: float):
        self.loop = loop
        self.make_env = make_env
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self.closing: set[asyncio.Task] = set()  # closes in flight (the runner's close must not cancel them)
        # Set under the lock at the end of ``close``: the loop runs no more closes, so an env whose
        # call or build returns later is closed on its own thread (see ``_close_soon``).
        self._stopped = False
        self._stopping = threading.Lock()
        self._settled = asyncio.Event()  # a deferred call's close was queued (``close`` waits for them)
        self._idle: list[TurnLimit] = []
        self._threads: dict[int, EnvThread] = {}  # id(env) -> the thread it was built on and runs on
        self._busy: dict[int, concurrent.futures.Future] = {}  # id(env) -> its latest sync call
        # Calls past their deadline and builds whose episode is gone, their env to close after
        # (each leaves once that close is queued).
        self._deferred: set[concurrent.futures.Future] = set()

    async def acquire(self) -> TurnLimit:
        """An idle env, or a new one built within the deadline. Raises ``EnvError``."""
        if self._idle:
            return self._idle.pop()
        thread = EnvThread()
        build = thread.submit(self.make_env)
        try:
            async with asyncio.timeout(self.timeout_s):
                built = await asyncio.wrap_future(build, loop=self.loop)
        except BaseException as exc:
            # Failed, past its deadline, or its episode is gone (the group failed): an env the
            # build still returns is closed then (``close`` waits for it), and the thread ends.
            self._deferred.add(build)
            build.add_done_callback(lambda done: self._orphan(done, thread))
            if isinstance(exc, TimeoutError):
                raise EnvError(f"building an env took longer than env.step_timeout_s = {self.timeout_s:g}s") from None
            if isinstance(exc, EnvError) or not isinstance(exc, Exception):
                raise
            # a bare class as make_env: its constructor is the env's code
            raise EnvError(f"building an env raised {type(exc).__name__}: {exc}") from exc
        env = TurnLimit(built, self.max_turns)
        self._threads[id(env)] = thread
        return env

    def run_sync(self, env: TurnLimit) -> Callable[[Callable[[], Any]], Awaitable[Any]]:
        """How ``env``'s sync methods run: on its own thread, remembering the call, so an env whose
        call passed its deadline (still running) is closed only after it returns."""

        def run(fn: Callable[[], Any]) -> asyncio.Future:
            call = self._threads[id(env)].submit(fn)
            self._busy[id(env)] = call
            return asyncio.wrap_future(call, loop=self.loop)

        return run

    async def call(self, env: TurnLimit, what: str, pending: Awaitable[Any]) -> Any:
        """``await pending`` (``env``'s method ``what``) within the deadline. Raises ``EnvError``."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await pending
        except TimeoutError:
            raise EnvError(f"env {env_label(env)}.{what}() did not return within env.step_timeout_s = "
                           f"{self.timeout_s:g}s") from None

    def release(self, env: TurnLimit, *, healthy: bool) -> None:
        """An episode is done with ``env``: kept for the next one if ``healthy``, else closed (once
        a call of it still running past its deadline returns)."""
        if healthy:
            self._idle.append(env)
            return
        busy = self._busy.pop(id(env), None)
        if busy is not None and not busy.done():
            self._deferred.add(busy)  # ``close`` waits for it, then for this close
            thread = self._threads[id(env)]

            def later(_: concurrent.futures.Future) -> None:
                self._close_soon(env, thread, busy)

            busy.add_done_callback(later)
            return
        self._close_later(env)

    async def close(self, timeout_s: float) -> None:
        """Close every env: the idle ones, those whose last call or build returns within
        ``timeout_s``, and the closes in flight. The caller ends the episodes first, and stops the
        loop after; a call or build that returns later closes its env on its own thread."""
        envs, self._idle = self._idle, []
        for env in envs:
            await self._close(env)
        # Calls past their deadline and builds whose episode is gone. Not a wait on their futures:
        # a future is done before its callbacks run, and the callback queues the env's close.
        deadline = self.loop.time() + timeout_s
        while self._deferred:
            self._settled.clear()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._settled.wait()
            except TimeoutError:
                break
        with self._stopping:
            self._stopped = True  # from here on, a late one closes its env on its own thread
        await asyncio.sleep(0)  # the closes queued before that start (the queue is in order)
        if self.closing:
            await asyncio.wait(set(self.closing), timeout=timeout_s)

    def stop_threads(self) -> None:
        """End every env thread (daemons: one still in a hung call ends with the process); the
        loop has stopped (a call that returns later closes its env on its thread)."""
        with self._stopping:
            self._stopped = True
        for thread in self._threads.values():
            thread.stop()
        self._threads.clear()

    def _close_later(self, env: TurnLimit) -> None:
        task = self.loop.create_task(self._close(env))
        self.closing.add(task)
        task.add_done_callback(self.closing.discard)

    async def _close(self, env: TurnLimit) -> None:
        self._busy.pop(id(env), None)
        try:
            async with asyncio.timeout(self.timeout_s):  # in this task, not one of wait_for's
                await call_close(env, run_sync=self.run_sync(env))
        except Exception as exc:  # noqa: BLE001 - a failing close must not fail anything else
            log.warning("closing env %s failed: %s", env_label(env), exc)
        finally:
            thread = self._threads.pop(id(env), None)
            if thread is not None:
                thread.stop()  # after the close, even one still running past its deadline

    def _orphan(self, build: concurrent.futures.Future, thread: EnvThread) -> None:
        """A build whose episode did not take its env (any thread): close the env it returned."""
        if build.cancelled() or build.exception() is not None:
            thread.stop()
            self._close_soon(None, thread, build)
        else:
            self._close_soon(TurnLimit(build.result(), self.max_turns), thread, build)

    def _close_soon(self, env: TurnLimit | None, thread: EnvThread, call: concurrent.futures.Future) -> None:
        """``call`` (deferred) returned: close ``env`` from any thread, on the loop while the pool is
        open (queued before ``close`` can miss it: under the lock that ends the pool), else here and
        now, a sync close only."""
        with self._stopping:
            self._deferred.discard(call)
            if not self._stopped:
                try:
                    self.loop.call_soon_threadsafe(self._adopt, env, thread)
                    return
                except RuntimeError:  # the loop is closed
                    pass
        if env is None:
            return
        thread.stop()
        close = getattr(env.env, "close", None)
        if callable(close) and not inspect.iscoroutinefunction(close):
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - best effort at teardown
                log.warning("closing env %s failed: %s", env_label(env), exc)
        else:
            log.warning("env %s: its call returned after the runner closed; its async close() was not run",
                        env_label(env))

    def _adopt(self, env: TurnLimit | None, thread: EnvThread) -> None:
        """On the loop: start closing ``env`` (if any), then wake ``close``'s wait for it."""
        if env is not None:
            self._threads[id(env)] = thread
            self._close_later(env)
        self._settled.set()

"""Killable grading workers: persistent processes with a hard wall-clock timeout and a memory cap.

Why processes: sympy's big-integer arithmetic cannot be interrupted from Python (signals are only
seen between bytecodes, and SIGALRM only works on the main thread), so the only hard bound is to
run it in a process that can be killed.

How workers start: a *zygote* subprocess (``python -c ...``, so the caller's ``__main__`` is never
re-imported and no process-global multiprocessing setting is touched) imports and warms up sympy
and the LaTeX grammar once, then ``fork()``s a worker whenever the parent asks, handing it one end of
a socket pair. A replacement after a timeout therefore costs milliseconds, not the 1-2 s of a cold
import. Where ``fork``/``send_fds`` do not exist (Windows) workers are spawned cold instead.

Each worker caps its own address space (`RLIMIT_AS`) at its start-up size plus `memory_mb`, so a
runaway allocation raises `MemoryError` inside the worker instead of exhausting the machine, and
answers one task at a time.

The parent never blocks without a deadline: it waits on the sockets with
`multiprocessing.connection.wait(timeout=...)` (no signals, so any thread may grade), and on a
missed deadline SIGKILLs the worker (through a pidfd where available, so a recycled pid is never
hit), records a timeout and forks a replacement.

(Over 400 lines: the zygote, the worker and the pool share one protocol over one socket pair and
one set of limits; apart, the kill and restart paths could drift.)
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

from protocol.grading import mathverify

__all__ = ["WorkerPool", "default_pool", "close_default_pool", "DEFAULT_MEMORY_MB"]

#: Address space a worker may add on top of its start-up size.
DEFAULT_MEMORY_MB = int(os.environ.get("RETENTION_GRADER_MEMORY_MB", "1024"))
#: How long the parent waits for the zygote to import, warm up and fork a worker.
ZYGOTE_START_TIMEOUT_S = 120.0
_CAN_FORK = hasattr(os, "fork") and hasattr(socket, "send_fds") and hasattr(socket, "AF_UNIX")


def _vm_size_bytes() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _limit_memory(memory_mb: int) -> None:
    try:
        # deferred: POSIX-only; the ImportError branch is the Windows path
        import resource
    except ImportError:  # not POSIX: the wall-clock kill still bounds the worker
        return
    base = _vm_size_bytes() or 0
    limit = base + memory_mb * 1024 * 1024
    try:
        _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):
        pass


def _judges() -> dict:
    """Judges a worker can run, by name: this grader, and math-verify for `--compare`."""
    # deferred: sympy and the LaTeX grammar load in the workers only, never in the grading parent (module doc)
    from protocol.grading import equivalence

    return {"grader": equivalence.judge, mathverify.NAME: mathverify.judge}


def _worker_main(conn, memory_mb: int) -> None:
    """Worker loop: receive (task_id, pred, gold, judge name), send (task_id, status, verdict,
    detail); status "no_answer" when a judge that extracts its own answer finds none."""
    _limit_memory(memory_mb)
    # deferred: sympy and the LaTeX grammar load in the workers only, never in the grading parent (module doc)
    from protocol.grading.equivalence import Unparsable

    judges = _judges()

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        if msg == "limits":  # diagnostics: the address-space cap this worker runs under
            try:
                # deferred: POSIX-only; the ImportError branch is the Windows path
                import resource
                conn.send(("limits", resource.getrlimit(resource.RLIMIT_AS), _vm_size_bytes()))
            except ImportError:
                conn.send(("limits", None, None))
            continue
        task_id, pred, gold, name = msg
        try:
            verdict = judges[name](pred, gold)
            out = (task_id, "ok", bool(verdict), None) if verdict is not None else (
                task_id, "no_answer", None, None)
        except Unparsable as exc:
            out = (task_id, "unparsable", None, str(exc)[:300])
        except MemoryError:
            out = (task_id, "unparsable", None, "memory limit reached")
        except RecursionError:
            out = (task_id, "unparsable", None, "recursion limit reached")
        except Exception as exc:  # a sympy bug must not kill the worker or hide the item
            out = (task_id, "unparsable", None, f"{type(exc).__name__}: {exc}"[:300])
        try:
            conn.send(out)
        except (BrokenPipeError, OSError):
            return


# ---------------------------------------------------------------------------------------- zygote

def _zygote_main(ctl_fd: int, memory_mb: int) -> None:
    """Entry point of the zygote subprocess: warm up, then fork one worker per b"spawn" request
    (the request carries the worker's socket) and answer with the worker's pid."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps finished workers
    ctl = socket.socket(fileno=ctl_fd)
    # deferred: the zygote's warm-up (sympy, the grammar, warm parser caches), never in the grading parent
    import protocol.grading._preload  # noqa: F401

    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ctl, 16, 1)
        except OSError:
            return
        if not msg:  # the parent closed the control socket: it is gone
            return
        if msg != b"spawn" or not fds:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:  # worker
            try:
                ctl.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _worker_main(Connection(fds[0]), memory_mb)
            finally:
                os._exit(0)
        os.close(fds[0])
        try:
            ctl.sendall(struct.pack("!q", pid))
        except OSError:
            return


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("grading zygote exited")
        buf += chunk
    return buf


class _Zygote:
    def __init__(self, memory_mb: int):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = str(Path(__file__).resolve().parents[2])  # makes `protocol` importable from a checkout
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        code = ("import sys; from protocol.grading.worker import _zygote_main; "
                f"_zygote_main({child.fileno()}, {int(memory_mb)})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child.fileno()],
                                     stdin=subprocess.DEVNULL, env=env, close_fds=True)
        child.close()
        self.ctl = parent
        self.ctl.settimeout(ZYGOTE_START_TIMEOUT_S)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self) -> tuple[Connection, int]:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            socket.send_fds(self.ctl, [b"spawn"], [theirs.fileno()])
            pid = struct.unpack("!q", _recv_exact(self.ctl, 8))[0]
        finally:
            theirs.close()
        return Connection(mine.detach()), pid

    def close(self) -> None:
        try:
            self.ctl.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=5)


class _Worker:
    """One grading process: a connection plus a way to kill exactly that process."""

    def __init__(self, conn: Connection, pid: int | None = None, proc=None):
        self.conn = conn
        self.pid = pid
        self.proc = proc  # a multiprocessing.Process in the spawn fallback
        self.pidfd = None
        if pid is not None and hasattr(os, "pidfd_open"):
            try:
                self.pidfd = os.pidfd_open(pid)
            except OSError:
                self.pidfd = None

    def kill(self) -> None:
        try:
            if self.proc is not None:
                self.proc.kill()
                self.proc.join(timeout=5)
            elif self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            elif self.pid is not None:
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, OSError, ValueError):
            pass  # already gone
        self._close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        if self.proc is not None:
            self.proc.join(timeout=1)
            if self.proc.is_alive():
                self.kill()
                return
        self._close()

    def _close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class WorkerPool:
    """A small set of persistent grading processes; `run` grades a batch under a per-item timeout."""

    def __init__(self, size: int = 2, memory_mb: int = DEFAULT_MEMORY_MB):
        if size < 1:
            raise ValueError("a worker pool needs at least one worker")
        self.size = size
        self.memory_mb = memory_mb
        self._zygote: _Zygote | None = None
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.restarts = 0  # workers replaced after a timeout or a crash (for tests and reports)

    def _spawn(self) -> _Worker:
        if _CAN_FORK:
            for attempt in (0, 1):
                if self._zygote is None or not self._zygote.alive():
                    self._zygote = _Zygote(self.memory_mb)
                try:
                    conn, pid = self._zygote.spawn()
                    return _Worker(conn, pid=pid)
                except (OSError, ConnectionError):
                    self._zygote.close()
                    self._zygote = None
                    if attempt:
                        raise
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_worker_main, args=(child, self.memory_mb), daemon=True,
                           name="retention-grader")
        proc.start()
        child.close()
        return _Worker(parent, proc=proc)

    def _ensure(self, n: int) -> None:
        if self._pid != os.getpid():
            # we are a forked copy of the process that owns these workers: leave them to it
            self._workers, self._zygote, self._pid = [], None, os.getpid()
        while len(self._workers) < n:
            self._workers.append(self._spawn())

    def run(self, tasks: list[tuple[str, str]], timeout: float,
            workers: int | None = None,
            judge: str = "grader") -> list[tuple[str, bool | None, str | None]]:
        """Judge every (pred, gold) with at most `workers` processes in parallel, by the judge
        named `judge` ("grader", or "math-verify" when it is installed).

        Returns, per task in order, (status, verdict, detail) with status "ok" | "timeout" |
        "unparsable" (| "no_answer" for math-verify). A task that is not answered within
        `timeout` seconds of being handed to a worker is a timeout, and that worker is killed
        and replaced.
        """
        if not tasks:
            return []
        with self._lock:
            n = max(1, min(workers or self.size, len(tasks)))
            self._ensure(n)
            n = min(n, len(self._workers))
            idle = list(self._workers[:n])
            results: list[tuple[str, bool | None, str | None] | None] = [None] * len(tasks)
            busy: dict[int, tuple[_Worker, int, float]] = {}  # fileno -> (worker, task, deadline)
            next_task = 0
            while next_task < len(tasks) or busy:
                while idle and next_task < len(tasks):
                    w = idle.pop()
                    pred, gold = tasks[next_task]
                    try:
                        if w.conn.poll(0):  # an idle worker has nothing to say unless it died
                            raise BrokenPipeError
                        w.conn.send((next_task, pred, gold, judge))
                    except (BrokenPipeError, EOFError, OSError):  # died while idle: replace, retry
                        w.kill()
                        idle.append(self._replace(w))
                        continue
                    busy[w.conn.fileno()] = (w, next_task, time.monotonic() + timeout)
                    next_task += 1
                if not busy:
                    continue
                wait_s = max(0.0, min(d for _, _, d in busy.values()) - time.monotonic())
                ready = wait([w.conn for w, _, _ in busy.values()], timeout=wait_s)
                for conn in ready:
                    w, task, _ = busy.pop(conn.fileno())
                    try:
                        task_id, status, verdict, detail = conn.recv()
                        results[task] = (status, verdict, detail)
                        idle.append(w)
                    except (EOFError, OSError):  # killed by the memory cap or a signal
                        results[task] = ("unparsable", None, "grading worker died")
                        w.kill()
                        idle.append(self._replace(w))
                now = time.monotonic()
                for fd, (w, task, deadline) in list(busy.items()):
                    if now >= deadline:
                        del busy[fd]
                        w.kill()
                        results[task] = ("timeout", None, f"no verdict within {timeout:g} s")
                        idle.append(self._replace(w))
            return [r if r is not None else ("unparsable", None, "lost") for r in results]

    def limits(self) -> list[tuple]:
        """((soft, hard) RLIMIT_AS, current VmSize) of each worker, starting them if needed."""
        with self._lock:
            self._ensure(self.size)
            out = []
            for w in self._workers[:self.size]:
                w.conn.send("limits")
                if not w.conn.poll(30):
                    raise TimeoutError("grading worker did not answer")
                _tag, rl, vm = w.conn.recv()
                out.append((rl, vm))
            return out

    def pids(self) -> list[int | None]:
        """Process ids of the current workers (tests use them to simulate a crash)."""
        return [w.pid if w.proc is None else w.proc.pid for w in self._workers]

    def _replace(self, dead: _Worker) -> _Worker:
        self.restarts += 1
        fresh = self._spawn()
        self._workers = [fresh if w is dead else w for w in self._workers]
        return fresh

    def close(self) -> None:
        with self._lock:
            for w in self._workers:
                w.stop()
            self._workers = []
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None


_default: WorkerPool | None = None
_default_lock = threading.Lock()


def default_pool(size: int = 2) -> WorkerPool:
    """The process-wide pool, created on first use and grown to `size` when asked for more."""
    global _default
    with _default_lock:
        if _default is None:
            _default = WorkerPool(size)
            atexit.register(close_default_pool)
        elif size > _default.size:
            _default.size = size
        return _default


def close_default_pool() -> None:
    global _default
    with _default_lock:
        if _default is not None:
            _default.close()
            _default = None

"""One service as a child process: start it in its own process group, wait until its gRPC health
service says SERVING (or another readiness probe holds), stop it (SIGTERM to the whole group, then
SIGKILL after a timeout), and tell why it ended.

Threads: none of its own; a ServiceProcess is used by one thread at a time (the launcher's main
thread, or the supervisor's while it restarts one). Invariants: a child never outlives a launcher
that dies without stopping it (the parent-death signal: armed by the child itself through
die_with_parent, or by a preexec_fn for programs that are not pagedserve's); a stopped child's
group is gone (SIGKILLed after the wait) and its log file closed. No torch, no gRPC at import.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)


class ServiceError(RuntimeError):
    """A service did not start, or died: the message names it, its exit code and its log's tail."""


PARENT_PID_ENV = "PAGEDSERVE_PARENT_PID"


def _set_parent_death_signal() -> None:
    """Linux: this process gets SIGTERM if its parent dies without stopping it (e.g. SIGKILL)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # best effort: other systems lack prctl
        pass


def die_with_parent() -> None:
    """Called first thing by a service started by ServiceProcess: arm the parent-death signal
    here rather than in a preexec_fn between fork and exec. A preexec_fn forces a real fork(),
    which runs gRPC's at-fork handlers, and those can block forever in a process that has used
    gRPC (seen: a launcher restarting a service after health checks). Without it Popen uses
    vfork, which runs no handlers."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is None:
        return
    _set_parent_death_signal()
    if os.getppid() != int(parent):  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ServiceProcess:
    """One child process in its own process group (so a Ctrl-C on the terminal reaches only the
    launcher, which then stops the children in order).

    health_address: host:port of its gRPC health service; ready: any other readiness probe
    (e.g. a Redis PING). log_path: stdout and stderr go there (appended), else they are inherited.
    """

    def __init__(self, name: str, argv: Sequence[str], health_address: str | None = None,
                 env: dict[str, str] | None = None, log_path: str | os.PathLike | None = None,
                 ready: Callable[[], bool] | None = None, cwd: str | os.PathLike | None = None,
                 arms_own_death_signal: bool = True) -> None:
        self.name = name
        # True: the child calls die_with_parent() itself (pagedserve's services); False: a
        # preexec_fn does it (other programs, e.g. redis-server, started before any gRPC use).
        self.arms_own_death_signal = arms_own_death_signal
        self.health_internal = True  # False: a public port, checked without the internal TLS
        self.argv = list(argv)
        self.health_address = health_address
        self.env = env
        self.log_path = Path(log_path) if log_path is not None else None
        self.ready = ready
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"ServiceProcess({self.name!r}, pid={pid}, {describe_exit(self.returncode)})"

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> ServiceProcess:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} was already started")
        out = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = out = open(self.log_path, "ab")  # closed in stop()
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        preexec = None
        if self.arms_own_death_signal:
            env[PARENT_PID_ENV] = str(os.getpid())
        else:
            preexec = _set_parent_death_signal
        try:
            self.proc = subprocess.Popen(self.argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT if out else None,
                                         start_new_session=True, preexec_fn=preexec)
        except OSError as exc:
            self._close_log()
            raise ServiceError(f"{self.name}: cannot run {self.argv[0]}: {exc}") from exc
        log.info("started %s (pid %d): %s", self.name, self.proc.pid, shlex.join(self.argv))
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None:
            return "(its output went to this terminal, above)"
        if str(self.log_path) == os.devnull:
            return "(its output was discarded)"
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"(cannot read {self.log_path}: {exc})"
        return "\n".join(text.splitlines()[-lines:]) or "(its log is empty)"

    def failure(self, what: str) -> ServiceError:
        where = f" (log: {self.log_path})" if self.log_path else ""
        return ServiceError(f"{self.name} {what}, {describe_exit(self.returncode)}{where}; "
                            f"last lines:\n{self.log_tail()}")

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        """Return once SERVING (or ready() is true); raise ServiceError at once if the process dies,
        or after timeout_s."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        if self.health_address is not None:
            from pagedserve.common.grpc_util import wait_for_health
            try:
                wait_for_health(self.health_address, timeout_s, alive=self.alive, internal=self.health_internal,
                                environ=self.env)
            except RuntimeError:
                raise self.failure("exited before it became healthy") from None
            except TimeoutError:
                raise self.failure(f"was not healthy at {self.health_address} after {timeout_s:.0f} s") from None
        elif self.ready is not None:
            deadline = time.monotonic() + timeout_s
            while not self.ready():
                if not self.alive():
                    raise self.failure("exited before it became ready")
                if time.monotonic() > deadline:
                    raise self.failure(f"was not ready after {timeout_s:.0f} s")
                time.sleep(0.1)
        if not self.alive():
            raise self.failure("exited")

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM its process group, wait up to timeout_s, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        try:
            if self.proc.poll() is None:
                self.signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0f s of SIGTERM: SIGKILL", self.name, timeout_s)
                    self.kill()
            # Anything it left in its group (e.g. helpers it forked) goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        finally:
            self._close_log()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

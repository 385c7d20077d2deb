"""Services as child processes: start one, wait until its gRPC health service says SERVING, stop it
(its whole process group: SIGTERM, then SIGKILL after a timeout). `pagedserve serve` and the tests
use these to run the real services; nothing here imports torch.

    stack = start_stack(StackConfig(model="/path/to/model", log_dir=tmp))
    try:
        ...  # stack.http_url, stack.grpc_address, stack.addresses["scheduler"]
    finally:
        stack.stop()
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


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


# ---- Redis ---------------------------------------------------------------------------------
def redis_ping(url: str, timeout_s: float = 2.0) -> bool:
    import redis
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def private_redis(log_path: str | os.PathLike | None = None) -> tuple[ServiceProcess, str, str]:
    """A throw-away redis-server on a free loopback port, persisting nothing, in a temp dir.
    Returns (process, url, temp dir); started and ready. The caller stops it and removes the dir."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise ServiceError("redis-server is not on the PATH")
    from pagedserve.common.grpc_util import free_port
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="pagedserve-redis-")
    url = f"redis://{LOOPBACK}:{port}/0"
    argv = [exe, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
            "--dir", tmp, "--daemonize", "no", "--loglevel", "warning"]
    proc = ServiceProcess("redis", argv, env=None, log_path=log_path, ready=lambda: redis_ping(url, 0.5),
                          arms_own_death_signal=False)
    try:
        proc.start().wait_healthy(30)
    except BaseException:
        proc.stop(2)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return proc, url, tmp


# ---- the stack -----------------------------------------------------------------------------
@dataclass
class StackConfig:
    """What `pagedserve serve` takes, as plain data (see pagedserve.launcher.serve.add_arguments)."""
    host: str = LOOPBACK
    port: int = 8000
    grpc_port: int = 50051
    api_key: str | None = None
    redis_url: str | None = None  # None: private redis-server if on the PATH, else "memory"
    served_model_name: str | None = None
    max_waiting_requests: int = 1024
    tensor_parallel_size: int = 1
    # engine flags (same names as pagedserve.common.engine_args.add_engine_args)
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: str | None = None
    gpu_memory_utilization: float = 0.9
    swap_space: str = "1GiB"
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    no_prefix_caching: bool = False
    no_chunked_prefill: bool = False
    step_timeout: float | None = None  # scheduler: seconds before a silent worker rank counts as dead
    stall_timeout: float | None = None  # scheduler: health NOT_SERVING after this long without progress
    # launcher only
    max_restarts: int = 0  # > 0: a supervisor restarts dead children, at most this many times per window
    restart_window: float = 300.0
    log_dir: str | None = None
    startup_timeout: float = 600.0
    stop_timeout: float = 10.0
    shutdown_timeout: float = 30.0  # the gateway's drain on SIGTERM (its stop waits this much longer)
    tls_cert: str | None = None  # mutual TLS between the internal services (see grpc_util.TLS_ENV)
    tls_key: str | None = None
    tls_ca: str | None = None
    env: dict[str, str] | None = None  # children's environment (default: this process's)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StackConfig:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in vars(args).items() if k in names})


# Which launcher flag goes to which service (engine flags included). Flags with a None value or a
# false store_true are left out, so the service's own default applies.
WORKER_FLAGS = ("model", "device", "dtype", "max_model_len")
SCHEDULER_FLAGS = ("max_waiting_requests", "block_size", "kv_cache_memory", "gpu_memory_utilization",
                   "swap_space", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                   "max_model_len", "preemption_mode", "scheduling_policy", "no_prefix_caching",
                   "no_chunked_prefill", "step_timeout", "stall_timeout")
TOKENIZER_FLAGS = ("model", "served_model_name")
# The API key goes by environment (service_env), never on a command line `ps` shows.
GATEWAY_FLAGS = ("shutdown_timeout",)


def _flags(cfg: StackConfig, names: Sequence[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        value = getattr(cfg, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                out.append(flag)
        elif value is not None:
            out += [flag, str(value)]
    return out


@dataclass
class Ports:
    workers: list[int]
    scheduler: int
    tokenizer: int

    @classmethod
    def free(cls, tensor_parallel_size: int) -> Ports:
        from pagedserve.common.grpc_util import free_port
        taken: set[int] = set()

        def pick() -> int:
            while (port := free_port()) in taken:
                pass
            taken.add(port)
            return port
        return cls([pick() for _ in range(tensor_parallel_size)], pick(), pick())


def client_host(host: str) -> str:
    """Where to reach a server bound to host from this machine (0.0.0.0 and :: mean loopback)."""
    if host in ("", "0.0.0.0"):
        return LOOPBACK
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def service_argvs(cfg: StackConfig, ports: Ports, redis_url: str) -> dict[str, list[str]]:
    """The command-line arguments (after `pagedserve`) of every service of the stack: a pure function.
    Keys: worker0..workerN-1, scheduler, tokenizer, gateway (start order)."""
    tp = cfg.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if len(ports.workers) != tp:
        raise ValueError(f"{len(ports.workers)} worker ports for tensor parallel size {tp}")
    worker_addrs = [f"{LOOPBACK}:{p}" for p in ports.workers]
    scheduler_addr = f"{LOOPBACK}:{ports.scheduler}"
    tokenizer_addr = f"{LOOPBACK}:{ports.tokenizer}"
    argvs: dict[str, list[str]] = {}
    for rank, port in enumerate(ports.workers):
        argvs[f"worker{rank}"] = ["worker", "--host", LOOPBACK, "--port", str(port), "--rank", str(rank),
                                  "--tensor-parallel-size", str(tp), *_flags(cfg, WORKER_FLAGS)]
    argvs["scheduler"] = ["scheduler", "--host", LOOPBACK, "--port", str(ports.scheduler),
                          "--worker-addrs", ",".join(worker_addrs), "--redis-url", redis_url,
                          *_flags(cfg, SCHEDULER_FLAGS)]
    argvs["tokenizer"] = ["tokenizer", "--host", LOOPBACK, "--port", str(ports.tokenizer),
                          "--scheduler-addr", scheduler_addr, *_flags(cfg, TOKENIZER_FLAGS)]
    argvs["gateway"] = ["gateway", "--host", cfg.host, "--port", str(cfg.port), "--grpc-port", str(cfg.grpc_port),
                        "--tokenizer-addr", tokenizer_addr, "--scheduler-addr", scheduler_addr,
                        "--redis-url", redis_url, *_flags(cfg, GATEWAY_FLAGS)]
    return argvs


def service_env(cfg: StackConfig, name: str, env: dict[str, str]) -> dict[str, str]:
    """A service's environment: secrets travel here rather than in its argv."""
    if name == "gateway" and cfg.api_key:
        return {**env, "PAGEDSERVE_API_KEY": cfg.api_key}
    return env


def tls_env(cfg: StackConfig) -> dict[str, str]:
    """The internal TLS files as the variables every service (and the launcher's own health
    checks) read."""
    from pagedserve.common.grpc_util import TLS_ENV
    return {TLS_ENV[name]: str(Path(path).resolve()) for name, path in
            (("cert", cfg.tls_cert), ("key", cfg.tls_key), ("ca", cfg.tls_ca)) if path}


def check_port_free(host: str, port: int, what: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]") or "0.0.0.0", port))
        except OSError as exc:
            raise ServiceError(f"{what} {host}:{port} is not available: {exc.strerror or exc}") from None


def _http_ok(url: str, api_key: str | None, timeout_s: float = 1.0) -> bool:
    import urllib.error
    import urllib.request
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return 200 <= reply.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Stack:
    """The running services, in start order (redis first when private)."""
    processes: list[ServiceProcess] = field(default_factory=list)
    addresses: dict[str, str] = field(default_factory=dict)  # name -> host:port (http: a URL)
    redis_url: str = "memory"
    stop_timeout: float = 10.0
    drain_timeout: float = 0.0  # the gateway's extra stop time: it drains in-flight streams first
    _redis_dir: str | None = None
    startup_timeout: float = 600.0
    # The supervisor (see supervise()): restarts so far, and why it gave up ("" while it has not).
    restarts: list[tuple[float, str]] = field(default_factory=list)
    gave_up: str = ""
    _stopping: threading.Event = field(default_factory=threading.Event)
    _supervisor: threading.Thread | None = None

    @property
    def http_url(self) -> str:
        return self.addresses["http"]

    @property
    def grpc_address(self) -> str:
        return self.addresses["grpc"]

    def dead(self) -> ServiceProcess | None:
        """The first child that is no longer running, if any."""
        return next((p for p in self.processes if not p.alive()), None)

    def supervise(self, max_restarts: int = 5, window_s: float = 300.0, poll_s: float = 0.5) -> None:
        """Start a thread that restarts a child that exited unexpectedly (not during stop()) with the
        same argv and environment, after a backoff (1 s, doubling up to 30 s), logging each restart;
        more than max_restarts within window_s and it gives up (gave_up says why; the launcher then
        stops). Tensor-parallel worker ranks share a torch.distributed group that dies with any of
        them: if one rank dies, every rank is restarted (together, as at start-up). The scheduler
        notices the new ranks itself, re-initialises them and resumes its requests."""
        def run() -> None:
            backoff = 1.0
            while not self._stopping.wait(poll_s):
                dead = self.dead()
                if dead is None:
                    backoff = max(1.0, backoff / 2)
                    continue
                now = time.monotonic()
                self.restarts = [r for r in self.restarts if now - r[0] < window_s]
                if len(self.restarts) >= max_restarts:
                    self.gave_up = (f"{dead.name} stopped ({describe_exit(dead.returncode)}) after "
                                    f"{len(self.restarts)} restarts within {window_s:.0f} s; giving up")
                    log.error("%s", self.gave_up)
                    return
                log.warning("%s stopped unexpectedly (%s); restarting it in %.0f s", dead.name,
                            describe_exit(dead.returncode), backoff)
                if self._stopping.wait(backoff):
                    return
                backoff = min(30.0, backoff * 2)
                self.restarts.append((time.monotonic(), dead.name))
                try:
                    self._restart(dead)
                except ServiceError as exc:
                    log.error("restarting %s failed: %s", dead.name, exc)
        self._supervisor = threading.Thread(target=run, name="supervisor", daemon=True)
        self._supervisor.start()

    def _restart(self, dead: ServiceProcess) -> None:
        group = [p for p in self.processes if p.name.startswith("worker")] if dead.name.startswith("worker") \
            else [dead]
        for old in group:
            old.stop(self.stop_timeout)
        fresh = []
        for old in group:
            if self._stopping.is_set():
                return
            new = ServiceProcess(old.name, old.argv, old.health_address, env=old.env, log_path=old.log_path,
                                 ready=old.ready, cwd=old.cwd, arms_own_death_signal=old.arms_own_death_signal)
            new.health_internal = old.health_internal
            self.processes[self.processes.index(old)] = new.start()
            fresh.append(new)
        for new in fresh:
            new.wait_healthy(self.startup_timeout)
            log.info("restarted %s (pid %d)", new.name, new.pid)

    def stop(self) -> None:
        """SIGTERM each child in reverse start order (SIGKILL after stop_timeout); remove the private
        Redis' temp dir. Safe to call twice."""
        self._stopping.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=self.stop_timeout + 5)
        for proc in reversed(self.processes):
            was_alive, started = proc.alive(), time.monotonic()
            try:
                # The gateway drains in-flight streams for up to its --shutdown-timeout first.
                code = proc.stop(self.stop_timeout + (self.drain_timeout if proc.name == "gateway" else 0.0))
                if was_alive:
                    log.info("stopped %s (%s) in %.1f s", proc.name, describe_exit(code), time.monotonic() - started)
            except KeyboardInterrupt:  # impatient second Ctrl-C: kill the rest outright
                for rest in self.processes:
                    rest.kill()
                raise
        if self._redis_dir:
            shutil.rmtree(self._redis_dir, ignore_errors=True)
            self._redis_dir = None

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def resolve_redis(cfg: StackConfig, stack: Stack, log_dir: Path | None) -> str:
    """The URL the services get: cfg.redis_url (must answer PING), else a private redis-server
    (added to stack), else "memory" with a warning."""
    if cfg.redis_url:
        if cfg.redis_url in ("memory", "memory://"):
            log.warning("--redis-url %s: request records stay in the scheduler's memory (durability off)",
                        cfg.redis_url)
            return "memory"
        if not redis_ping(cfg.redis_url):
            raise ServiceError(f"no Redis answers PING at --redis-url {cfg.redis_url}")
        return cfg.redis_url
    if shutil.which("redis-server"):
        # Without a log dir its start-up banner and warnings would only clutter the terminal.
        proc, url, tmp = private_redis(log_dir / "redis.log" if log_dir else os.devnull)
        stack.processes.append(proc)
        stack._redis_dir = tmp
        log.info("private Redis at %s", url)
        return url
    log.warning("redis-server is not on the PATH and no --redis-url was given: request records stay in "
                "the scheduler's memory (durability off: a restarted scheduler loses its requests)")
    return "memory"


def start_stack(cfg: StackConfig, python: str = sys.executable) -> Stack:
    """Start Redis (see resolve_redis), the worker ranks, scheduler, tokenizer and gateway, each after
    the previous one is healthy. On any failure everything started is stopped and ServiceError raised."""
    log_dir = Path(cfg.log_dir) if cfg.log_dir else None
    check_port_free(cfg.host, cfg.port, "the HTTP address")
    check_port_free(cfg.host, cfg.grpc_port, "the gRPC address")
    stack = Stack(stop_timeout=cfg.stop_timeout, startup_timeout=cfg.startup_timeout,
                  drain_timeout=cfg.shutdown_timeout)
    try:
        redis_url = stack.redis_url = resolve_redis(cfg, stack, log_dir)
        ports = Ports.free(cfg.tensor_parallel_size)
        argvs = service_argvs(cfg, ports, redis_url)
        env = dict(os.environ if cfg.env is None else cfg.env) | tls_env(cfg)
        if cfg.tensor_parallel_size > 1:  # rendezvous of the ranks' torch.distributed group
            from pagedserve.common.grpc_util import free_port
            env.setdefault("MASTER_ADDR", LOOPBACK)
            env.setdefault("MASTER_PORT", str(free_port()))
        public = client_host(cfg.host)
        health = {f"worker{r}": f"{LOOPBACK}:{p}" for r, p in enumerate(ports.workers)}
        health |= {"scheduler": f"{LOOPBACK}:{ports.scheduler}", "tokenizer": f"{LOOPBACK}:{ports.tokenizer}",
                   "gateway": f"{public}:{cfg.grpc_port}"}
        procs = {name: ServiceProcess(name, [python, "-m", "pagedserve.cli", *argv], health[name],
                                      env=service_env(cfg, name, env),
                                      log_path=log_dir / f"{name}.log" if log_dir else None)
                 for name, argv in argvs.items()}
        procs["gateway"].health_internal = False  # its health is on the public gRPC port
        workers = [p for name, p in procs.items() if name.startswith("worker")]
        # Ranks start together (they meet in torch.distributed), then each must be SERVING.
        for proc in workers:
            stack.processes.append(proc.start())
        for proc in workers:
            proc.wait_healthy(cfg.startup_timeout)
        for name in ("scheduler", "tokenizer", "gateway"):
            stack.processes.append(procs[name].start())
            procs[name].wait_healthy(cfg.startup_timeout)
        stack.addresses = {**health, "http": f"http://{public}:{cfg.port}", "grpc": f"{public}:{cfg.grpc_port}"}
        # The gateway's HTTP server may come up a moment after its gRPC health turns SERVING.
        deadline = time.monotonic() + 30
        gateway = procs["gateway"]
        while not _http_ok(stack.http_url + "/health", cfg.api_key):
            if not gateway.alive():
                raise gateway.failure("exited")
            if time.monotonic() > deadline:
                raise gateway.failure(f"answered no HTTP GET {stack.http_url}/health within 30 s")
            time.sleep(0.1)
        if cfg.max_restarts > 0:
            stack.supervise(cfg.max_restarts, cfg.restart_window)
        return stack
    except BaseException:
        stack.stop()
        raise

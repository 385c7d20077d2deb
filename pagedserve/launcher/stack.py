"""The running stack: start_stack starts Redis (unless given one), the worker ranks, the scheduler,
the tokenizer and the gateway, each once the previous one is healthy; Stack holds them, stops them
(in reverse start order) and, when asked, supervises them.

    stack = start_stack(StackConfig(model="/path/to/model", log_dir=tmp))
    try:
        ...  # stack.http_url, stack.grpc_address, stack.addresses["scheduler"]
    finally:
        stack.stop()

Threads: the caller's, and the supervisor thread (Stack.supervise) that restarts a dead child;
stop() tells it to end and joins it before it stops the children. Invariants: start_stack returns
a stack whose every child is healthy and whose gateway answers HTTP, or has stopped everything it
started; stop() is safe twice and leaves no child and no private Redis directory; tensor-parallel
worker ranks are restarted together, never one alone. No torch.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.common import https
from pagedserve.common.settings import LOOPBACK
from pagedserve.launcher.redis_server import private_redis, redacted, redis_ping
from pagedserve.launcher.service_process import ServiceError, ServiceProcess, describe_exit
from pagedserve.launcher.wiring import (Ports, StackConfig, children_env, client_host, first_api_key,
                                        replica_of, replica_suffix, service_argvs, service_env, service_kind)

log = logging.getLogger(__name__)


def check_port_free(host: str, port: int, what: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]") or "0.0.0.0", port))
        except OSError as exc:
            raise ServiceError(f"{what} {host}:{port} is not available: {exc.strerror or exc}") from None


def _http_ok(url: str, api_key: str | None, timeout_s: float = 1.0, cfg=None) -> bool:
    """GET url answers 2xx. Over HTTPS (cfg's --ssl-certfile) unverified; where the gateway requires
    client certificates (--ssl-cert-reqs 2) the launcher has none to present: its port accepting a
    connection is the answer."""
    import urllib.error
    import urllib.parse
    import urllib.request
    context = https.probe_context(cfg.ssl_certfile) if cfg is not None else None
    if context is not None and cfg.ssl_cert_reqs == 2:
        parts = urllib.parse.urlsplit(url)
        try:
            with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
                return True
        except OSError:
            return False
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as reply:
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
        # A replica's worker ranks restart together; another replica's are left alone.
        group = [p for p in self.processes if service_kind(p.name) == "worker" and replica_of(p.name) ==
                 replica_of(dead.name)] if service_kind(dead.name) == "worker" else [dead]
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
            raise ServiceError(f"no Redis answers PING at --redis-url {redacted(cfg.redis_url)}")
        return cfg.redis_url
    if shutil.which("redis-server"):
        # Without a log dir its start-up banner and warnings would only clutter the terminal.
        proc, url, tmp = private_redis(log_dir / "redis.log" if log_dir else os.devnull, cfg.redis_maxmemory)
        stack.processes.append(proc)
        stack._redis_dir = tmp
        log.info("private Redis at %s (maxmemory %s, volatile-lru, password)", redacted(url), cfg.redis_maxmemory)
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
    dp = cfg.data_parallel_size
    try:
        redis_url = stack.redis_url = resolve_redis(cfg, stack, log_dir)
        if dp > 1 and redis_url == "memory":
            raise ServiceError(f"--data-parallel-size {dp} needs Redis (the replicas' registry and request "
                               "records): give --redis-url, or put redis-server on the PATH")
        ports = Ports.free(cfg.tensor_parallel_size, dp)
        argvs = service_argvs(cfg, ports)
        env = children_env(cfg)
        public = client_host(cfg.host)
        health = {"tokenizer": f"{LOOPBACK}:{ports.tokenizer}", "gateway": f"{public}:{cfg.grpc_port}"}
        replica_env: dict[str, dict[str, str]] = {}
        for index, replica in enumerate(ports.replicas):
            suffix = replica_suffix(dp, index)
            health |= {f"worker{r}{suffix}": f"{LOOPBACK}:{p}" for r, p in enumerate(replica.workers)}
            health[f"scheduler{suffix}"] = f"{LOOPBACK}:{replica.scheduler}"
            own = replica_env[suffix.removeprefix("@")] = dict(env)
            if cfg.tensor_parallel_size > 1:  # rendezvous of each replica's torch.distributed group
                from pagedserve.common.grpc_util import free_port
                own.setdefault("MASTER_ADDR", LOOPBACK)
                if dp > 1 or "MASTER_PORT" not in own:
                    own["MASTER_PORT"] = str(free_port())
        procs = {name: ServiceProcess(name, [python, "-m", "pagedserve.cli", *argv], health[name],
                                      env=service_env(cfg, name, replica_env.get(replica_of(name), env), redis_url),
                                      log_path=log_dir / f"{name}.log" if log_dir else None)
                 for name, argv in argvs.items()}
        procs["gateway"].health_internal = False  # its health is on the public gRPC port
        workers = [p for name, p in procs.items() if service_kind(name) == "worker"]
        # Ranks start together (they meet in torch.distributed), then each must be SERVING.
        for proc in workers:
            stack.processes.append(proc.start())
        for proc in workers:
            proc.wait_healthy(cfg.startup_timeout)
        schedulers = [name for name in procs if service_kind(name) == "scheduler"]
        for name in schedulers:
            stack.processes.append(procs[name].start())
        for name in [*schedulers, "tokenizer", "gateway"]:
            if name not in schedulers:
                stack.processes.append(procs[name].start())
            procs[name].wait_healthy(cfg.startup_timeout)
        stack.addresses = {**health, "http": f"{https.scheme(cfg.ssl_certfile)}://{public}:{cfg.port}",
                           "grpc": f"{public}:{cfg.grpc_port}"}
        # The gateway's HTTP server may come up a moment after its gRPC health turns SERVING.
        deadline = time.monotonic() + 30
        gateway = procs["gateway"]
        key = first_api_key(cfg.api_key, cfg.api_key_file)
        while not _http_ok(stack.http_url + "/health", key, cfg=cfg):
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

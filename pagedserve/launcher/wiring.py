"""What `pagedserve serve` hands each child: StackConfig (the "serve" slice of the settings table as
plain data), the ports, every service's command line and environment. Pure functions of their
arguments: nothing is started here.

Each child gets, for every setting it shares with `serve` (pagedserve.common.settings.shared), the
launcher's value: on its command line when it differs from the default (argv_for), by environment
when it is a secret (an API key on a command line is visible to `ps`), else the default; the
setting's PAGEDSERVE_* variable is taken out of the child's environment, so it cannot stand in for
that default. The launcher sets the addresses itself (WIRED): each child's host and port, the
addresses of the services it calls, each worker's rank and the group's size; and the Redis URL,
which may carry a password, by environment only (PAGEDSERVE_REDIS_URL, to the scheduler and the
gateway, and taken out of every other child's environment): never on a command line.

Threads: none. No torch.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

from pagedserve.common.setting_spec import env_name
from pagedserve.common.settings import LOOPBACK, settings_of, shared
from pagedserve.common.settings_cli import argv_for, handed_on_env, secret_env

# Settings `serve` shares with a child that the launcher sets itself (service_argvs).
WIRED = frozenset({"host", "port", "grpc_port", "tensor_parallel_size"})
# Where a stack built in code (the tests, the benches) differs from `pagedserve serve`: it is not
# supervised unless asked.
IN_CODE_DEFAULTS = {"max_restarts": 0}


def _from_args(cls, args: argparse.Namespace):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def _values(self) -> dict[str, Any]:
    """dest -> value of every setting (what argv_for and secret_env read)."""
    return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "env"}


def _annotation(s) -> Any:
    kind = list[s.type] if s.many else s.type
    return kind if s.default is not None else kind | None


StackConfig = make_dataclass(
    "StackConfig",
    [(s.dest, _annotation(s), field(default=IN_CODE_DEFAULTS.get(s.dest, s.default))) for s in settings_of("serve")]
    + [("env", dict[str, str] | None, field(default=None))],  # the children's environment (default: this one's)
    namespace={"from_args": classmethod(_from_args), "values": _values,
               "__doc__": "What `pagedserve serve` takes, as plain data: one field per setting of the \"serve\" "
                          "slice of pagedserve.common.settings (same names and defaults, but max_restarts 0), "
                          "and env."})
StackConfig.__module__ = __name__


def _handed(service: str) -> tuple[str, ...]:
    return tuple(s.dest for s in shared("serve", service) if s.dest not in WIRED)


# Which of the launcher's settings reach which service (derived from the table; for reading).
WORKER_FLAGS = _handed("worker")
SCHEDULER_FLAGS = _handed("scheduler")
TOKENIZER_FLAGS = _handed("tokenizer")
GATEWAY_FLAGS = _handed("gateway")


@dataclass
class ReplicaPorts:
    workers: list[int]
    scheduler: int


@dataclass
class Ports:
    workers: list[int]  # replica 0's worker ranks
    scheduler: int  # replica 0's scheduler
    tokenizer: int
    more: list[ReplicaPorts] = field(default_factory=list)  # replicas 1..N-1 (--data-parallel-size N)

    @property
    def replicas(self) -> list[ReplicaPorts]:
        return [ReplicaPorts(self.workers, self.scheduler), *self.more]

    @classmethod
    def free(cls, tensor_parallel_size: int, data_parallel_size: int = 1) -> Ports:
        from pagedserve.common.grpc_util import free_port
        taken: set[int] = set()

        def pick() -> int:
            while (port := free_port()) in taken:
                pass
            taken.add(port)
            return port
        ports = cls([pick() for _ in range(tensor_parallel_size)], pick(), pick())
        ports.more = [ReplicaPorts([pick() for _ in range(tensor_parallel_size)], pick())
                      for _ in range(data_parallel_size - 1)]
        return ports


def replica_suffix(dp: int, index: int) -> str:
    """What the names of replica index's services end with: "" for a single engine, "@r<i>"."""
    return f"@r{index}" if dp > 1 else ""


def replica_of(name: str) -> str:
    """scheduler@r1 -> "r1"; a service of a single engine (or none) -> ""."""
    return name.partition("@")[2]


def client_host(host: str) -> str:
    """Where to reach a server bound to host from this machine (0.0.0.0 and :: mean loopback)."""
    if host in ("", "0.0.0.0"):
        return LOOPBACK
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def service_kind(name: str) -> str:
    """worker0, worker1, worker0@r1, ... -> worker; scheduler@r1 -> scheduler; the others are
    their own kind."""
    return name.partition("@")[0].rstrip("0123456789")


def service_argvs(cfg, ports: Ports) -> dict[str, list[str]]:
    """The command-line arguments (after `pagedserve`) of every service of the stack: a pure function.
    Keys: worker0..workerN-1, scheduler, tokenizer, gateway (start order); with --data-parallel-size
    D > 1, each replica i's worker<r>@r<i> and scheduler@r<i> (its --replica-id r<i>) instead of the
    first two. The Redis URL is not among them: see service_env."""
    tp = cfg.tensor_parallel_size
    dp = getattr(cfg, "data_parallel_size", 1)
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if dp < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {dp}")
    if len(ports.replicas) != dp:
        raise ValueError(f"ports for {len(ports.replicas)} replicas for data parallel size {dp}")
    if any(len(r.workers) != tp for r in ports.replicas):
        raise ValueError(f"{len(ports.workers)} worker ports for tensor parallel size {tp}")
    values = cfg.values()

    def handed(service: str) -> list[str]:
        return argv_for(service, values, skip=WIRED)

    scheduler_addr = f"{LOOPBACK}:{ports.scheduler}"
    tokenizer_addr = f"{LOOPBACK}:{ports.tokenizer}"
    argvs: dict[str, list[str]] = {}
    for index, replica in enumerate(ports.replicas):
        suffix = replica_suffix(dp, index)
        for rank, port in enumerate(replica.workers):
            argvs[f"worker{rank}{suffix}"] = ["worker", "--host", LOOPBACK, "--port", str(port), "--rank", str(rank),
                                              "--tensor-parallel-size", str(tp), *handed("worker")]
    for index, replica in enumerate(ports.replicas):
        suffix = replica_suffix(dp, index)
        identity = ["--replica-id", f"r{index}"] if dp > 1 else []
        argvs[f"scheduler{suffix}"] = ["scheduler", "--host", LOOPBACK, "--port", str(replica.scheduler),
                                       "--worker-addrs", ",".join(f"{LOOPBACK}:{p}" for p in replica.workers),
                                       *identity, *handed("scheduler")]
    argvs["tokenizer"] = ["tokenizer", "--host", LOOPBACK, "--port", str(ports.tokenizer),
                          "--scheduler-addr", scheduler_addr, *handed("tokenizer")]
    argvs["gateway"] = ["gateway", "--host", cfg.host, "--port", str(cfg.port), "--grpc-port", str(cfg.grpc_port),
                        "--tokenizer-addr", tokenizer_addr, "--scheduler-addr", scheduler_addr, *handed("gateway")]
    return argvs


REDIS_URL_ENV = env_name("redis_url")
TAKES_REDIS = ("scheduler", "gateway")


def service_env(cfg, name: str, env: Mapping[str, str], redis_url: str | None = None) -> dict[str, str]:
    """A service's environment: env without the variables of the settings the launcher hands it,
    plus its secrets (which travel here rather than in its argv): the scheduler and the gateway get
    the Redis URL (redis_url; None: "memory"), and with several engine replicas the tokenizer too
    (the registry it routes over); the others none."""
    kind = service_kind(name)
    dropped = handed_on_env(kind, skip=WIRED) | {REDIS_URL_ENV}
    out = {k: v for k, v in env.items() if k not in dropped} | secret_env(kind, cfg.values())
    if kind in TAKES_REDIS or (kind == "tokenizer" and getattr(cfg, "data_parallel_size", 1) > 1):
        out[REDIS_URL_ENV] = redis_url or "memory"
    return out


def tls_env(cfg) -> dict[str, str]:
    """The internal TLS files as the variables every service (and the launcher's own health
    checks) read."""
    from pagedserve.common.grpc_util import TLS_ENV
    return {TLS_ENV[name]: str(Path(path).resolve()) for name, path in
            (("cert", cfg.tls_cert), ("key", cfg.tls_key), ("ca", cfg.tls_ca)) if path}


def first_api_key(api_key: str | list[str] | None, api_key_file: str | None = None) -> str | None:
    """One key the gateway accepts (for the launcher's own requests): from --api-key's value (a
    string or a list of them, each possibly comma-separated), else the first in --api-key-file."""
    items = [api_key] if isinstance(api_key, str) else api_key or []
    keys = [k.strip() for item in items for k in item.split(",") if k.strip()]
    if not keys and api_key_file:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                keys = [line.split()[0] for line in f if line.strip() and not line.lstrip().startswith("#")]
        except OSError:
            pass  # the gateway says so when it starts
    return keys[0] if keys else None


def children_env(cfg) -> dict[str, str]:
    """The environment every child starts from: cfg.env (default: this process's) and the TLS files."""
    return dict(os.environ if cfg.env is None else cfg.env) | tls_env(cfg)

"""Redis for the launcher: a PING probe, and a private, throw-away redis-server on a free loopback
port (no persistence, its files in a temp dir) for a stack given no --redis-url.

The private server is bounded and locked: `maxmemory` (--redis-maxmemory) with the volatile-lru
policy (every record key has a TTL; the set of unfinished ids has none and is never evicted), and
a random `requirepass`. The password is in its config file (mode 0600, in the temp dir) and in the
URL returned, which the launcher hands the services by environment: it is on no command line that
`ps` shows. Log and error messages show URLs through redacted().

Threads: none. Invariants: private_redis returns a server that answered PING, or has stopped it
and removed its temp dir before raising; whoever gets it stops it and removes the dir (Stack.stop
does). No torch; the redis client is imported when first used.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from urllib.parse import urlsplit, urlunsplit

from pagedserve.common.settings import LOOPBACK
from pagedserve.launcher.service_process import ServiceError, ServiceProcess


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


MEMORY_SIZE = re.compile(r"[1-9][0-9]*(b|k|kb|m|mb|g|gb)?", re.IGNORECASE)


def redacted(url: str) -> str:
    """url with its password (if any) replaced by ***, for logs and messages."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<a Redis URL>"


def private_redis(log_path: str | os.PathLike | None = None,
                  maxmemory: str = "256mb") -> tuple[ServiceProcess, str, str]:
    """A throw-away redis-server on a free loopback port, persisting nothing, in a temp dir, with
    maxmemory (volatile-lru) and a random password. Returns (process, url with the password, temp
    dir); started and ready. The caller stops it and removes the dir."""
    if not MEMORY_SIZE.fullmatch(maxmemory):
        raise ServiceError(f"--redis-maxmemory {maxmemory!r} is not a size such as 256mb or 1gb")
    exe = shutil.which("redis-server")
    if exe is None:
        raise ServiceError("redis-server is not on the PATH")
    from pagedserve.common.grpc_util import free_port
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="pagedserve-redis-")
    password = secrets.token_hex(24)
    url = f"redis://:{password}@{LOOPBACK}:{port}/0"
    conf = os.path.join(tmp, "redis.conf")
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:  # in a file, not argv: `ps` shows every process's argv
        f.write(f"requirepass {password}\nmaxmemory {maxmemory}\nmaxmemory-policy volatile-lru\n")
    argv = [exe, conf, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
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

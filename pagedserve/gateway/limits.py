"""The gateway's admission limits: request body size, n, tokens in flight, per-key request rate,
the drain on shutdown, and the stream-resume grace. Pure logic, no I/O, but for SharedRateLimiter:
the per-key rate of every gateway of a deployment together, kept in Redis."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_N = 16
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_RESUME_GRACE_S = 60.0
MAX_RATE_LIMITED_KEYS = 10_000  # buckets kept (least recently used dropped first)
log = logging.getLogger("pagedserve.gateway")


@dataclass
class Limits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # 0: no limit
    max_n: int = DEFAULT_MAX_N
    max_tokens_in_flight: int = 0  # 0: no bound
    rate_limit: tuple[float, float] | None = None  # (requests per second, burst) per API key
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    resume_grace_s: float = DEFAULT_RESUME_GRACE_S  # 0: a stream dies with its gateway
    cors_origins: list[str] = field(default_factory=list)
    api_docs: bool = True  # /docs, /redoc, /openapi.json (for the operator key); False: --disable-fastapi-docs


def parse_origins(text: str | None) -> list[str]:
    """--cors-origins: comma-separated origins, or vLLM's --allowed-origins JSON list ('["https://a"]')."""
    text = (text or "").strip()
    if text.startswith("["):
        try:
            origins = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--cors-origins {text!r} is not a JSON list: {exc}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError(f"--cors-origins {text!r}: want a JSON list of strings")
        return [o.strip() for o in origins if o.strip()]
    return [o.strip() for o in text.split(",") if o.strip()]


def parse_rate_limit(text: str | None) -> tuple[float, float] | None:
    """'RPS' or 'RPS:BURST' (burst defaults to max(1, RPS)); None, '' or '0': no limit."""
    if not text:
        return None
    rps_text, _, burst_text = str(text).partition(":")
    rps = float(rps_text)
    burst = float(burst_text) if burst_text else max(1.0, rps)
    if not (math.isfinite(rps) and math.isfinite(burst)) or rps < 0 or burst < 1:
        raise ValueError(f"--rate-limit {text!r}: want RPS[:BURST] with RPS >= 0 and BURST >= 1")
    return None if rps == 0 else (rps, burst)


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float | None = None) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.stamp = time.monotonic() if now is None else now

    def take(self, now: float | None = None, count: float = 1.0) -> float:
        """0.0 when `count` requests may pass (as many tokens taken, all or none), else the seconds
        until they may (more than the burst: never, as long as the burst allows)."""
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= count:
            self.tokens -= count
            return 0.0
        return (count - self.tokens) / self.rate

    def wait(self, now: float | None = None) -> float:
        """take() without taking: 0.0 when a token is there."""
        now = time.monotonic() if now is None else now
        tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate


class RateLimiter:
    """One token bucket per client identity (the API key's digest, never the key itself)."""

    def __init__(self, rate: float, burst: float, max_keys: int = MAX_RATE_LIMITED_KEYS) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self.buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    @staticmethod
    def identity(key: str | None, client: str | None) -> str:
        if key:
            return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
        return "addr:" + (client or "?")

    def check(self, identity: str, now: float | None = None, count: float = 1.0) -> float:
        bucket = self.buckets.get(identity)
        if bucket is None:
            bucket = self.buckets[identity] = TokenBucket(self.rate, self.burst, now)
            while len(self.buckets) > self.max_keys:
                self.buckets.popitem(last=False)
        else:
            self.buckets.move_to_end(identity)
        return bucket.take(now, count)

    def wait(self, identity: str, now: float | None = None) -> float:
        """How long identity must wait before check() would pass, without taking a token."""
        bucket = self.buckets.get(identity)
        return 0.0 if bucket is None else bucket.wait(now)


# One key's bucket in Redis, taken atomically: refilled at ARGV[1] a second up to ARGV[2] since its stamp
# (Redis's own clock: the gateways' clocks need not agree), ARGV[3] taken all or none; returns the wait
# in seconds as a string (0: taken). The bucket expires once it would be full again.
_TAKE = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
local rate, burst, count = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'stamp')
local tokens = tonumber(state[1]) or burst
local stamp = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - stamp) * rate)
local wait = 0
if tokens >= count then tokens = tokens - count else wait = (count - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'stamp', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil((burst - tokens) / rate) + 1)
return tostring(wait)
"""


class SharedRateLimiter:
    """RateLimiter's buckets for every gateway of a deployment at once: one hash a key in Redis
    (`<prefix>rate:<identity>`, the key's digest as RateLimiter names it), taken by one script call a
    check (redis.asyncio), so N gateways behind a load balancer allow a key its rate, not N times it.
    Redis away: this gateway's own buckets (`local`) decide until it answers again (logged)."""

    def __init__(self, client, prefix: str, rate: float, burst: float) -> None:
        self.client, self.prefix, self.rate, self.burst = client, prefix + "rate:", rate, burst
        self.local = RateLimiter(rate, burst)
        self._script = client.register_script(_TAKE)
        self._warned = False

    async def check(self, identity: str, count: float = 1.0) -> float:
        """As RateLimiter.check: 0.0 when taken, else the seconds to wait."""
        try:
            wait = float(await self._script(keys=[self.prefix + identity], args=[self.rate, self.burst, count]))
        except Exception as exc:  # noqa: BLE001 - a limiter must not stop the API
            if not self._warned:
                log.warning("the shared rate limit's Redis did not answer (%s): this gateway's own buckets decide", exc)
                self._warned = True
            return self.local.check(identity, count=count)
        self._warned = False
        return wait


def retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))

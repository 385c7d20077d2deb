"""Admission: whether this gateway takes a request, decided in one place for both front ends, the
REST API (http_gate.py, completion_call.py) and the public gRPC API (grpc_api.py).

A refusal is a `Refusal`: the OpenAI-style error REST answers (HTTP status, type, code, headers
such as Retry-After) together with the gRPC status the gRPC API aborts with, and one message for
both, so the two front ends refuse alike. The checks, in the order a request meets them:

  await admit(authorization, client) -> Caller   before the request is read or any service is asked:
      the gateway is draining                  503 server_shutting_down    UNAVAILABLE
      too many failed keys from this address   429 auth_throttled          RESOURCE_EXHAUSTED
      the API key is missing or wrong          401 invalid_api_key         UNAUTHENTICATED
      over the rate (per API key; per client
      address when no keys are configured;
      with Redis, for all gateways together)   429 rate_limit_exceeded     RESOURCE_EXHAUSTED
  check_body_size(size)          REST only, on /v1 POSTs (gRPC has its own message size limit):
      over --max-body-bytes (+ room for its   413 request_too_large       RESOURCE_EXHAUSTED
      images on a model that takes them)
  check_n(n)                     once the request is parsed:
      n over --max-n                           400 (param n)               INVALID_ARGUMENT
  reserve(prompt, n, max_tokens, max_model_len)  once the tokenizer counted the prompt:
      prompt + n * max_tokens over
      --max-tokens-in-flight                   429 too_many_tokens_in_flight RESOURCE_EXHAUSTED
    the caller release()s what reserve() returned when the request leaves the gateway.

Threads: every method runs on the gateway's one asyncio loop (the REST and gRPC servers share
it); only the rate checks await (the shared buckets' Redis), and they touch no other state, so the
state needs no lock.
Invariants: tokens_in_flight is the sum of the reservations not yet released, never below 0; a
request alone is always admitted whatever its size; API keys are compared in constant time (every
key, so the time does not tell which matched) and never logged; the rate limiter keeps a digest
of each key, never the key.
"""

from __future__ import annotations

import hmac

import grpc

from pagedserve.common.inflight import tokens_in_flight
from pagedserve.gateway.limits import Limits, RateLimiter, SharedRateLimiter, retry_after
from pagedserve.gateway.owners import SINGLE_TENANT, Caller, owner_of_key
from pagedserve.gateway.protocol import RequestError

SHUTTING_DOWN_MESSAGE = ("the server is shutting down; retry on another gateway (a stream resumes with "
                         "GET /v1/requests/{id}/stream)")
BAD_API_KEY_MESSAGE = "Incorrect or missing API key (Authorization: Bearer <key>)."
# Failed authentications per client address: a burst, then this many a second; beyond, 429 before
# the key is even compared (a key guesser gets no answer either way).
FAILED_AUTH_RATE, FAILED_AUTH_BURST = 1.0, 20


class Refusal(RequestError):
    """A request the gateway does not take: a RequestError (REST renders it as it renders any,
    status, {"error": ...} body and headers) that also names the gRPC status it maps to."""

    def __init__(self, status: int, grpc_code: grpc.StatusCode, message: str, type: str, code: str | None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, param, type, code, headers)
        self.grpc_code = grpc_code


def shutting_down() -> Refusal:
    return Refusal(503, grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN_MESSAGE, "service_unavailable",
                   "server_shutting_down", headers={"Retry-After": "5"})


def bad_api_key() -> Refusal:
    return Refusal(401, grpc.StatusCode.UNAUTHENTICATED, BAD_API_KEY_MESSAGE, "invalid_request_error",
                   "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def rate_limited(rate: tuple[float, float], wait_s: float, requests: int = 1) -> Refusal:
    rps, burst = rate
    counted = f" (this request counts as {requests}: one per prompt)" if requests > 1 else ""
    return Refusal(429, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"rate limit exceeded: at most {rps:g} requests/s (burst {burst:g}) per API key{counted}",
                   "rate_limit_error", "rate_limit_exceeded", headers={"Retry-After": retry_after(wait_s)})


def auth_throttled(wait_s: float) -> Refusal:
    return Refusal(429, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"too many failed authentications from this address (at most {FAILED_AUTH_BURST} in a burst, "
                   f"then {FAILED_AUTH_RATE:g}/s)", "rate_limit_error", "auth_throttled",
                   headers={"Retry-After": retry_after(wait_s)})


def body_too_large(limit: int) -> Refusal:
    return Refusal(413, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"the request body exceeds --max-body-bytes ({limit} bytes)", "invalid_request_error",
                   "request_too_large", headers={})


def too_many_samples(n: int, max_n: int) -> Refusal:
    return Refusal(400, grpc.StatusCode.INVALID_ARGUMENT,
                   f"n={n} exceeds the limit of {max_n} samples per request (--max-n)", "invalid_request_error",
                   None, param="n")


def priority_too_high(priority: int, floor: int) -> Refusal:
    return Refusal(400, grpc.StatusCode.INVALID_ARGUMENT,
                   f"priority={priority} is more precedence than this API key may take: at least {floor} (lower "
                   "runs earlier; an operator sets a key's min_priority in --api-key-file)", "invalid_request_error",
                   None, param="priority")


def too_many_tokens(needed: int, taken: int, bound: int) -> Refusal:
    return Refusal(429, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"too many tokens in flight at this gateway: this request needs {needed} (prompt + n * "
                   f"max_tokens), {taken} of {bound} are taken (--max-tokens-in-flight)",
                   "rate_limit_error", "too_many_tokens_in_flight", headers={"Retry-After": "1"})


class Admission:
    """The gateway's admission state (draining, rate buckets, tokens in flight) and its checks;
    each check raises a Refusal or lets the request on."""

    def __init__(self, api_keys: str | list[str] | None = None, limits: Limits | None = None,
                 admin_keys: list[str] | None = None, min_priorities: dict[str, int] | None = None) -> None:
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys or [])
        admins = [k.strip() for k in admin_keys or [] if k and k.strip()]
        # Several keys may be valid; each is compared in constant time (and never logged). An
        # operator key is a key too; (key, caller) per key. An ordinary key's requests may not set a
        # priority below its min_priority (default 0: no precedence over others); an operator's any.
        floors = min_priorities or {}
        self.keys: list[tuple[bytes, Caller]] = [
            (k.encode(), Caller(owner_of_key(k), admin=k in admins,
                                min_priority=None if k in admins else floors.get(k, 0)))
            for k in dict.fromkeys([k.strip() for k in keys if k and k.strip()] + admins)]
        self.api_keys: list[bytes] = [k for k, _ in self.keys]
        self.has_admin = bool(admins)
        self.failed_auth = RateLimiter(FAILED_AUTH_RATE, FAILED_AUTH_BURST)
        self.limits = limits or Limits()
        self.rate_limiter = RateLimiter(*self.limits.rate_limit) if self.limits.rate_limit else None
        self.shared_rate: SharedRateLimiter | None = None  # share_rate(): the buckets of every gateway
        self.draining = False     # set once by the drain on SIGTERM; never cleared
        self.tokens_in_flight = 0  # the sum of the admitted requests' prompt + n * max_tokens

    def caller(self, authorization: str | None) -> Caller | None:
        """Who presents this Authorization value: None when the key is missing or wrong."""
        if not self.keys:
            return SINGLE_TENANT
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        found = None
        for key, caller in self.keys:  # every key compared: the time does not tell which one matched
            if hmac.compare_digest(given, key):
                found = caller
        return found if scheme.lower() == "bearer" else None

    def key_ok(self, authorization: str | None) -> bool:
        return self.caller(authorization) is not None

    def share_rate(self, client, prefix: str) -> None:
        """Take the rate limit from buckets in Redis (client: redis.asyncio), shared by every gateway
        that shares its prefix."""
        if self.limits.rate_limit:
            self.shared_rate = SharedRateLimiter(client, prefix, *self.limits.rate_limit)

    async def admit(self, authorization: str | None, client: str | None) -> Caller:
        """The caller's checks: draining, the API key, then one request off its rate bucket; returns
        the Caller. authorization: the Authorization header (metadata on gRPC); client: its address."""
        if self.draining:
            raise shutting_down()
        address = "addr:" + (client or "?")
        if self.keys and (wait := self.failed_auth.wait(address)) > 0:
            raise auth_throttled(wait)
        caller = self.caller(authorization)
        if caller is None:
            self.failed_auth.check(address)
            raise bad_api_key()
        if (wait := await self._rate_wait(authorization, client, 1)) > 0:
            raise rate_limited(self.limits.rate_limit, wait)
        return caller

    async def admit_more(self, authorization: str | None, client: str | None, count: int) -> None:
        """A request that is `count` more requests (a batch's other prompts, each its own request
        downstream): as many off the caller's rate bucket, all or none, or 429."""
        if count > 0 and (wait := await self._rate_wait(authorization, client, count)) > 0:
            raise rate_limited(self.limits.rate_limit, wait, count + 1)

    async def _rate_wait(self, authorization: str | None, client: str | None, count: int) -> float:
        """count requests off the caller's bucket (the key's, or the address's without keys): 0.0, or the wait."""
        if self.rate_limiter is None:
            return 0.0
        key = (authorization or "").partition(" ")[2].strip() if self.api_keys else None
        identity = RateLimiter.identity(key, client)
        if self.shared_rate is not None:
            return await self.shared_rate.check(identity, count)
        return self.rate_limiter.check(identity, count=count)

    def check_tokens_fit(self, tokens: int) -> None:
        """429 when `tokens` more in flight would pass --max-tokens-in-flight now (nothing reserved:
        a batch's output budget, checked before any of its prompts is sent)."""
        if not self._fits(tokens):
            raise too_many_tokens(tokens, self.tokens_in_flight, self.limits.max_tokens_in_flight)

    def check_body_size(self, size: int, limit: int | None = None) -> None:
        """413 past `limit` (default --max-body-bytes; the gateway's backend.body_limit for a request)."""
        limit = self.limits.max_body_bytes if limit is None else limit
        if limit > 0 and size > limit:
            raise body_too_large(limit)

    def check_n(self, n: int) -> None:
        if n > self.limits.max_n:
            raise too_many_samples(n, self.limits.max_n)

    @staticmethod
    def check_priority(caller: Caller, priority: int) -> None:
        if caller.min_priority is not None and priority < caller.min_priority:
            raise priority_too_high(priority, caller.min_priority)

    def reserve(self, prompt_tokens: int, n: int, max_tokens: int | None, max_model_len: int) -> int:
        """Count the request's prompt + n * max_tokens in flight (max_tokens None: up to the
        context); returns the count to release() later."""
        needed = tokens_in_flight(prompt_tokens, n, max_tokens, unset_output=max(0, max_model_len - prompt_tokens),
                                  max_output=max_model_len)
        if not self.reserve_tokens(needed):
            raise too_many_tokens(needed, self.tokens_in_flight, self.limits.max_tokens_in_flight)
        return needed

    def _fits(self, tokens: int) -> bool:
        """tokens more fit --max-tokens-in-flight (always when nothing is in flight: one request
        larger than the bound still runs alone)."""
        bound = self.limits.max_tokens_in_flight
        return bound <= 0 or self.tokens_in_flight <= 0 or self.tokens_in_flight + tokens <= bound

    def reserve_tokens(self, tokens: int) -> bool:
        if not self._fits(tokens):
            return False
        self.tokens_in_flight += tokens
        return True

    def release(self, tokens: int) -> None:
        self.tokens_in_flight = max(0, self.tokens_in_flight - tokens)

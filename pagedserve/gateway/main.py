"""`pagedserve gateway`: the OpenAI-compatible REST API and the public gRPC Generate stream."""

from __future__ import annotations

import argparse

from pagedserve.common.store import DEFAULT_PREFIX, DEFAULT_TTL_S
from pagedserve.gateway.limits import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_N, DEFAULT_RESUME_GRACE_S,
                                     DEFAULT_SHUTDOWN_TIMEOUT_S)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API")
    parser.add_argument("--grpc-port", type=int, default=50051, help="port of the public gRPC Generate API")
    parser.add_argument("--tokenizer-addr", default="127.0.0.1:50052")
    parser.add_argument("--scheduler-addr", default="127.0.0.1:50060")
    parser.add_argument("--api-key", action="append", default=None,
                        help="require a bearer key; repeat for several (also PAGEDSERVE_API_KEY, comma-separated)")
    parser.add_argument("--api-key-file", default=None, help="a file of accepted API keys, one a line (# comments)")
    parser.add_argument("--cors-origins", default="",
                        help="comma-separated origins allowed by CORS ('*' for any); empty (default): CORS off")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get 413 (0: no limit)")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="the largest n (samples per request)")
    parser.add_argument("--max-tokens-in-flight", type=int, default=0,
                        help="bound on the sum of prompt + n * max_tokens of admitted requests; beyond it 429 "
                             "(0: no bound)")
    parser.add_argument("--rate-limit", default=None,
                        help="RPS[:BURST] requests per second per API key (per client address without keys); "
                             "beyond it 429 with Retry-After")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="on SIGTERM, seconds in-flight requests may take to finish before they are aborted")
    parser.add_argument("--resume-grace", type=float, default=DEFAULT_RESUME_GRACE_S,
                        help="seconds a stream's request keeps running after its gateway died, for a resume "
                             "(GET /v1/requests/{id}/stream); 0: it is aborted at once")
    parser.add_argument("--redis-url", default=None, help="redis://host:port/db; unset or 'memory': ask the scheduler")
    parser.add_argument("--redis-prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--redis-ttl", type=int, default=DEFAULT_TTL_S)


def main(args: argparse.Namespace) -> int:
    from pagedserve.gateway.server import serve
    return serve(args)

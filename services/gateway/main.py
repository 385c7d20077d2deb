"""`pagedserve gateway`: the OpenAI-compatible REST API and the public gRPC Generate stream."""

from __future__ import annotations

import argparse

from pagedserve.store import DEFAULT_PREFIX, DEFAULT_TTL_S


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API")
    parser.add_argument("--grpc-port", type=int, default=50051, help="port of the public gRPC Generate API")
    parser.add_argument("--tokenizer-addr", default="127.0.0.1:50052")
    parser.add_argument("--scheduler-addr", default="127.0.0.1:50060")
    parser.add_argument("--api-key", default=None, help="require this bearer key (also PAGEDSERVE_API_KEY)")
    parser.add_argument("--redis-url", default=None, help="redis://host:port/db; unset or 'memory': ask the scheduler")
    parser.add_argument("--redis-prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--redis-ttl", type=int, default=DEFAULT_TTL_S)


def main(args: argparse.Namespace) -> int:
    from services.gateway.server import serve
    return serve(args)

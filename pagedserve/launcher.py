"""`pagedserve serve`: every service as a process on loopback (flags here; heavy imports in main)."""

from __future__ import annotations

import argparse

from pagedserve.cli import add_engine_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address of the public APIs (HTTP and gRPC)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API")
    parser.add_argument("--grpc-port", type=int, default=50051, help="port of the public gRPC Generate API")
    parser.add_argument("--api-key", default=None, help="require this bearer key (also PAGEDSERVE_API_KEY)")
    parser.add_argument("--redis-url", default=None,
                        help="use this Redis; unset: a private redis-server if one is on the PATH, "
                             "else an in-process store (durability off)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-waiting-requests", type=int, default=1024)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    add_engine_args(parser)


def main(args: argparse.Namespace) -> int:
    raise NotImplementedError("pagedserve serve: the launcher is being built")

"""`pagedserve worker`: one worker rank as a gRPC server (flags here; heavy imports in main)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (internal service: keep it private)")
    parser.add_argument("--port", type=int, default=50061)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dist-init-addr", default=None,
                        help="host:port where the ranks meet (torch.distributed); default MASTER_ADDR:MASTER_PORT")


def main(args: argparse.Namespace) -> int:
    from pagedserve.worker.server import serve
    return serve(args)

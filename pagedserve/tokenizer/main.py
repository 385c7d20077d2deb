"""`pagedserve tokenizer`: tokenization, chat templates and detokenization as a gRPC server."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as model (default: the model folder's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (internal service: keep it private)")
    parser.add_argument("--port", type=int, default=50052)
    parser.add_argument("--scheduler-addr", default="127.0.0.1:50060")
    parser.add_argument("--scheduler-retry-timeout", type=float, default=120.0,
                        help="seconds a stream waits for a restarted scheduler before it fails")


def main(args: argparse.Namespace) -> int:
    from pagedserve.tokenizer.server import serve
    return serve(args)

"""`pagedserve tokenizer`: tokenization, chat templates and detokenization as a gRPC server (flags:
pagedserve.common.settings; heavy imports in main)."""

from __future__ import annotations

import argparse

from pagedserve.common.settings_cli import add_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, "tokenizer")


def main(args: argparse.Namespace) -> int:
    from pagedserve.tokenizer.server import serve
    return serve(args)

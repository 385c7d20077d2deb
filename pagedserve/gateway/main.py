"""`pagedserve gateway`: the OpenAI-compatible REST API and the public gRPC Generate stream (flags:
pagedserve.common.settings; heavy imports in main)."""

from __future__ import annotations

import argparse

from pagedserve.common.settings_cli import add_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, "gateway")


def main(args: argparse.Namespace) -> int:
    from pagedserve.gateway.server import serve
    return serve(args)

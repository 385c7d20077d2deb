"""`pagedserve worker`: one worker rank as a gRPC server (flags: pagedserve.common.settings;
heavy imports in main)."""

from __future__ import annotations

import argparse

from pagedserve.common.settings import add_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, "worker")


def main(args: argparse.Namespace) -> int:
    from pagedserve.worker.server import serve
    return serve(args)

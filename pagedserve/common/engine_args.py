"""The engine's flags (model, device, dtype, KV pool, step budgets, parallelism) for the commands
that build an engine in process (generate, chat, the benches): the "engine" slice of
pagedserve.common.settings, where each is declared."""

from __future__ import annotations

import argparse

from pagedserve.common.settings_cli import add_settings


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, "engine", with_env=False)

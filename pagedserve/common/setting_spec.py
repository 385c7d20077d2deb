"""What one setting is (settings.py holds the table of them): a Setting declares one command-line
flag: its type, default, help, the services that take it (one of SERVICES each) and the
environment variable that also sets it (env_name: PAGEDSERVE_ and the flag's name in capitals,
dashes as underscores; --max-num-seqs is PAGEDSERVE_MAX_NUM_SEQS).

Threads: none of its own; a Setting is frozen, shared freely.

Invariants (checked as each Setting is made): it names at least one service and only services in
SERVICES; a default is among its choices; only a switch that is off by default has opposites.
Standard library only: no torch here (the import-linter contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SERVICES = ("engine", "serve", "worker", "scheduler", "tokenizer", "gateway")
ENV_PREFIX = "PAGEDSERVE_"


@dataclass(frozen=True)
class Setting:
    flag: str  # "--max-num-seqs"
    services: frozenset[str]  # which of SERVICES take it (written as one space-separated string)
    type: type = str  # int, float, str; bool: a switch (store_true)
    default: Any = None
    help: str = ""
    choices: tuple | None = None
    default_text: str | None = None  # how --help states a default the table leaves None (computed later)
    group: str = ""  # its section of --help ("" or the service's own name: the main one)
    many: bool = False  # repeatable; the value is a list
    several: bool = False  # with many: one flag may take several values (vLLM's nargs="+": --served-model-name a b)
    secret: bool = False  # the launcher hands it on by environment, never on a command line `ps` shows
    # vLLM's spellings of the same setting, so that a vLLM command line starts: other names of the flag
    # ("-tp"), and for a switch the names that turn it off ("--enable-prefix-caching" of --no-prefix-caching)
    aliases: tuple[str, ...] = ()
    opposites: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.services, str):
            object.__setattr__(self, "services", frozenset(self.services.split()))
        unknown = self.services - set(SERVICES)
        if unknown or not self.services:
            raise ValueError(f"{self.flag}: unknown services {sorted(unknown)}")
        if self.choices is not None and self.default is not None and self.default not in self.choices:
            raise ValueError(f"{self.flag}: default {self.default!r} is not among {self.choices}")
        if self.opposites and (self.type is not bool or self.default):
            raise ValueError(f"{self.flag}: only a switch that is off by default has opposites")

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return env_name(self.dest)

    def help_text(self, with_env: bool) -> str:
        text = self.help.replace("%", "%%")
        if self.secret:
            default = "none"
        elif self.type is bool:
            default = "off"
        elif self.default is None or self.default == "":
            default = self.default_text or ("unset" if self.default is None else "empty")
        else:
            default = "%(default)s"  # argparse's: the variable's value when one is set
        env = ""
        if with_env:
            env = f"; env {self.env}" + ("=1" if self.type is bool else ", comma-separated" if self.many else "")
        return f"{text} (default: {default}{env})" if text else f"(default: {default}{env})"


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()

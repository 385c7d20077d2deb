"""The settings table (settings.py) on command lines and in environments: each service's parser
takes its slice of the table with add_settings, and apply_env_defaults makes each flag's variable
its default (the command line wins); the launcher hands its children the settings they share with
argv_for (flags) and secret_env (secrets, by environment only: never on a command line `ps` shows),
and handed_on_env names the variables argv_for stands in for.

Threads: none of its own; each function reads the table (immutable) and the arguments it is given.

Invariants: a value equal to the setting's default is never handed on (the child's own default
is the same declaration's); a secret never appears in argv_for's flags nor in --help. Standard
library only: no torch here (the import-linter contract).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from typing import Any

from pagedserve.common.setting_spec import ENV_PREFIX, env_name
from pagedserve.common.settings import settings_of, shared


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (1/0, true/false, yes/no, on/off)")


# ---- parsers -----------------------------------------------------------------------------------
ENV_EPILOG = (f"Every flag --some-flag is also read from the environment variable {ENV_PREFIX}SOME_FLAG "
              "(the command line wins).")


def add_settings(parser: argparse.ArgumentParser, service: str, with_env: bool = True) -> None:
    """Add the service's flags to parser, grouped as the table says; with_env: --help names each
    flag's variable (the caller then calls apply_env_defaults, as pagedserve.cli does)."""
    groups: dict[str, Any] = {}
    for s in settings_of(service):
        title = "" if s.group in ("", service) else s.group
        if title and title not in groups:
            groups[title] = parser.add_argument_group(title)
        target = groups[title] if title else parser
        kwargs: dict[str, Any] = {"default": s.default, "help": s.help_text(with_env)}
        if s.type is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=s.type, choices=s.choices, action="append" if s.many else "store")
            if s.several:
                kwargs.update(action="extend", nargs="+")
        target.add_argument(s.flag, *s.aliases, **kwargs)
        if s.opposites:
            target.add_argument(*s.opposites, dest=s.dest, action="store_false", default=s.default,
                                help=f"vLLM's: the default (not {s.flag})")
    if with_env and not parser.epilog:
        parser.epilog = ENV_EPILOG


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ) -> None:
    """Every flag --some-flag also reads PAGEDSERVE_SOME_FLAG (the command line wins): the variable
    becomes the flag's default. A value the flag would refuse raises ValueError naming both."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help" or isinstance(action, argparse._StoreFalseAction):
            continue  # (a switch's opposite, e.g. --enable-prefix-caching, reads no variable of its own)
        name = env_name(action.dest)
        value = environ.get(name)
        if value is None:
            continue
        try:
            action.default = _env_value(action, value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"{name}={value!r} is not a valid {action.option_strings[0]} ({exc})") from None


def _env_value(action: argparse.Action, text: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        return parse_bool(text)
    value = action.type(text) if action.type is not None else text
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"not one of {', '.join(map(str, action.choices))}")
    return [value] if isinstance(action, argparse._AppendAction) else value


# ---- handing settings on (the launcher) -----------------------------------------------------------
def argv_for(service: str, values: Mapping[str, Any], source: str = "serve", skip: Iterable[str] = ()) -> list[str]:
    """The flags that give `service` the values `source` holds for the settings both take, in table
    order: each value that differs from the default (None: the service's default). Secrets never
    (see secret_env), nor the dests in skip (those the caller sets itself)."""
    skip = set(skip)
    out: list[str] = []
    for s in shared(source, service):
        value = values.get(s.dest, s.default)
        if s.secret or s.dest in skip or value is None or value == s.default:
            continue
        if s.type is bool:
            if value:
                out.append(s.flag)
        elif s.many:
            for item in value:
                out += [s.flag, str(item)]
        else:
            out += [s.flag, str(value)]
    return out


def handed_on_env(service: str, source: str = "serve", skip: Iterable[str] = ()) -> set[str]:
    """The variables of the settings argv_for hands on: the child's values are the source's, so a
    variable left in the child's environment would only stand in for a default argv_for omitted."""
    skip = set(skip)
    return {s.env for s in shared(source, service) if not s.secret and s.dest not in skip}


def secret_env(service: str, values: Mapping[str, Any], source: str = "serve") -> dict[str, str]:
    """The secrets `source` hands `service`, as its environment variables (lists comma-joined)."""
    out = {}
    for s in shared(source, service):
        value = values.get(s.dest)
        if s.secret and value:
            out[s.env] = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
    return out

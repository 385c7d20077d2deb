"""`--config FILE.yaml` on every command: a YAML mapping of the command's own flags (the same
names: `max-num-seqs`, `max_num_seqs` or `--max-num-seqs`), as vLLM's `--config` takes.

The file is expanded into flags where `--config FILE` stands on the command line, so the order
says who wins: flags after it override the file, flags before it are overridden by it; the
environment (PAGEDSERVE_*) is only a default below both. A value may be a scalar, a list (a
repeatable flag once per item) or a boolean (a switch: true sets it, false leaves it off).
Nothing here knows the flags: argparse refuses an unknown one, naming it, as it would on the
command line.

Threads: called once, on the main thread, before parsing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def _flag(key: str) -> str:
    return "--" + str(key).strip().lstrip("-").replace("_", "-")


def config_flags(path: str | Path) -> list[str]:
    """The flags the YAML file at path stands for; ValueError naming the file when it is not a
    mapping of flags."""
    import yaml  # only when a file is given: the services start without it otherwise

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML ({exc})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: want a mapping of flags (max-num-seqs: 64), got {type(data).__name__}")
    out: list[str] = []
    for key, value in data.items():
        flag = _flag(key)
        if flag == "--config":
            raise ValueError(f"--config {path}: a config file cannot name another one")
        if isinstance(value, bool):
            if value:
                out.append(flag)
        elif isinstance(value, list):
            for item in value:
                out += [flag, str(item)]
        elif isinstance(value, dict):
            raise ValueError(f"--config {path}: {key} has a mapping; want a value or a list")
        elif value is not None:
            out += [flag, str(value)]
    return out


def expand_config(argv: Sequence[str]) -> list[str]:
    """argv with each `--config FILE` (or `--config=FILE`) replaced by the file's flags."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out += argv[i:]
            break
        if arg == "--config" or arg.startswith("--config="):
            if arg == "--config":
                if i + 1 >= len(argv):
                    raise ValueError("--config wants a file")
                path, i = argv[i + 1], i + 2
            else:
                path, i = arg.split("=", 1)[1], i + 1
            out += config_flags(path)
            continue
        out.append(arg)
        i += 1
    return out

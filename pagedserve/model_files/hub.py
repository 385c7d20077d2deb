"""Models named by a Hugging Face hub id (`Qwen/Qwen3-0.6B`), through huggingface_hub's own cache.

The local cache is asked first (`local_files_only`): a model pulled once is served without
touching the network, and every worker rank of a `serve` finds what the launcher's pre-flight
check downloaded. Only when the cache lacks it, and offline mode (HF_HUB_OFFLINE=1) is off, is the
hub asked, for the files a model folder needs (config, safetensors, tokenizer, chat template),
never .bin / .pth / .gguf duplicates. Failures say which id, where the cache is, and what to do.

The cache location, offline flag and endpoint are read from the environment at each call
(HF_HUB_CACHE, HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT), not at huggingface_hub's import, so a test
or a command can point them elsewhere. Torch-free.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a model folder needs; anything else in a repo (other weight formats, images) is skipped.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


class HubModelNotFound(FileNotFoundError):
    """The id is neither in the local cache nor obtainable from the hub."""


def looks_like_hub_id(model: str) -> bool:
    """`org/name`, as the hub spells repository ids (a path that exists is a path, not an id)."""
    return (bool(_HUB_ID.match(model)) and ".." not in model and not model.endswith(".gguf")
            and not Path(model).expanduser().exists())


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    return any(os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _how_to_get(repo_id: str, revision: str | None = None) -> str:
    pull = f"{repo_id} --revision {revision}" if revision else repo_id
    return (f"(Nor is there a local folder {Path(repo_id).resolve()}.) To get it: run `pagedserve pull {pull}` "
            "where the hub (or a mirror named by HF_ENDPOINT) is "
            f"reachable and copy {hub_cache_dir()} (or set HF_HOME / HF_HUB_CACHE to a copy), "
            "or pass --model a local folder holding config.json, *.safetensors and the tokenizer files")


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot folder of repo_id (with a config.json), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(),
                                        local_files_only=True, allow_patterns=ALLOW_PATTERNS))
    except (LocalEntryNotFoundError, HFValidationError):
        return None
    return folder if (folder / "config.json").is_file() else None


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """A local folder holding repo_id's model files: from the cache, else downloaded into it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

    folder = cached_snapshot(repo_id, revision)
    if folder is not None:
        return folder
    named = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    if hub_offline():
        raise HubModelNotFound(f"model {named} is not in the local Hugging Face cache ({hub_cache_dir()}) and "
                               f"HF_HUB_OFFLINE is set, so the hub is not asked. {_how_to_get(repo_id, revision)}")
    endpoint = os.environ.get("HF_ENDPOINT") or None
    where = endpoint or "huggingface.co"
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(), endpoint=endpoint,
                                        allow_patterns=ALLOW_PATTERNS, etag_timeout=30))
    except GatedRepoError:
        raise HubModelNotFound(f"model {repo_id!r} on {where} is gated: accept its license on the hub and log in "
                               "(`hf auth login` or HF_TOKEN), then pull it again") from None
    except RepositoryNotFoundError:
        raise HubModelNotFound(f"no model {repo_id!r} on {where} (or it is private: log in with `hf auth login` "
                               "or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubModelNotFound(f"model {repo_id!r} on {where} has no revision {revision!r}") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError) as exc:
        # LocalEntryNotFoundError here: the hub could not be reached and the cache has no copy.
        raise HubModelNotFound(f"model {named} is not in the local Hugging Face cache ({hub_cache_dir()}) and "
                               f"{where} could not be reached ({type(exc).__name__}). "
                               f"{_how_to_get(repo_id, revision)}") from None
    if not (folder / "config.json").is_file():
        raise HubModelNotFound(f"hub repository {repo_id!r} has no config.json: not a transformers model folder "
                               "(a GGUF repository? download its .gguf file and pass --model FILE.gguf)")
    return folder


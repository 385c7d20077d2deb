"""A model folder's weight files, checked before any service starts (`serve`'s pre-flight, after its
config.json): a safetensors file whose header does not parse or whose tensors run past its end (a
download cut short), a shard that model.safetensors.index.json names but the folder lacks, or a .gguf
that is no GGUF, fails here in a second, naming the file, not minutes later in a worker that has first
compiled its CPU kernels. Reads the headers only (a safetensors header is JSON before the data). No torch.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_HEADER = 100 * 2 ** 20  # safetensors' own bound on a header's size


def check_weight_files(folder: Path) -> None:
    """Raise ValueError (FileNotFoundError when there are none) naming the first weight file that cannot
    be read, or the shards the index names that are missing."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            raise ValueError(f"cannot read {index}: {exc}") from None
        missing = sorted(name for name in shards if not (folder / name).is_file())
        if missing:
            raise ValueError(f"{index.name} in {folder} names {', '.join(missing)}, which the folder does not "
                             "have (a download cut short? fetch the model again)")
    for path in files:
        _check_safetensors(path)
    if files:
        return
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no weights in {folder}: expected *.safetensors files or a .gguf file")
    _check_gguf(ggufs[0])


def _check_safetensors(path: Path) -> None:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= length <= min(size - 8, MAX_HEADER):
            raise ValueError(f"cannot read weight file {path}: not a safetensors file ({size} bytes, "
                             f"a header of {length} bytes)")
        try:
            header = json.loads(f.read(length))
            ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"cannot read weight file {path}: its header does not parse ({exc})") from None
    end = 8 + length + max(ends, default=0)
    if end > size:
        raise ValueError(f"cannot read weight file {path}: its tensors end at byte {end}, past the file's "
                         f"{size} bytes (a download cut short? fetch the model again)")


def _check_gguf(path: Path) -> None:
    """The magic and version only: the gguf package's reader parses every metadata field (~2 s for the
    default model's tokenizer), too slow for every start; a GGUF cut short is found by the worker."""
    with path.open("rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF" or int.from_bytes(head[4:8], "little") not in (1, 2, 3):
        raise ValueError(f"cannot read weight file {path}: not a GGUF file (it starts {head[:8]!r})")

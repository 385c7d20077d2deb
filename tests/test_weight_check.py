"""`serve` checks a model's weight files before any service starts (model_files/weight_check.py): a
safetensors file cut short or not safetensors at all, a shard the index names that is missing, a .gguf
that is no GGUF: each is named, and `serve` exits 2 without starting a service (and so without the
minutes a fresh data dir's worker spends compiling its CPU kernels before it reads a weight)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from pagedserve.model_files.weight_check import check_weight_files
from tiny_models import build_tiny_model


@pytest.fixture
def tiny(tmp_path):
    return build_tiny_model(tmp_path / "tiny", seed=1)


def sharded(folder):
    """The tiny model's weights in two shards with the index transformers writes."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_whole_files_pass(tiny, tmp_path):
    check_weight_files(tiny)
    check_weight_files(sharded(tiny))


def test_a_safetensors_file_cut_short_is_named(tiny):
    path = tiny / "model.safetensors"
    size = path.stat().st_size
    os.truncate(path, size - 100)
    with pytest.raises(ValueError, match=rf"cannot read weight file {path}: its tensors end at byte {size}, past "
                                         rf"the file's {size - 100} bytes \(a download cut short\?"):
        check_weight_files(tiny)


@pytest.mark.parametrize("content", [b"<html>404</html>", b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!}....."])
def test_what_is_not_safetensors_is_named(tiny, content):
    (tiny / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=rf"cannot read weight file {tiny / 'model.safetensors'}: "):
        check_weight_files(tiny)


def test_a_shard_the_index_names_is_missing(tiny):
    sharded(tiny)
    (tiny / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model.safetensors.index.json in .* names model-00002-of-00002.safetensors, "
                                         "which the folder does not have"):
        check_weight_files(tiny)


def test_a_gguf_that_is_no_gguf(tiny):
    (tiny / "model.safetensors").unlink()
    (tiny / "model.gguf").write_bytes(b"Not Found")
    with pytest.raises(ValueError, match=r"model.gguf: not a GGUF file \(it starts b'Not Foun'\)"):
        check_weight_files(tiny)
    (tiny / "model.gguf").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in"):
        check_weight_files(tiny)


@pytest.mark.slow
def test_the_default_gguf_passes():
    from pagedserve.model_files.default_model import resolve_model
    check_weight_files(resolve_model(None))


def test_serve_exits_2_naming_the_file_before_any_service(tiny, tmp_path):
    path = tiny / "model.safetensors"
    os.truncate(path, path.stat().st_size - 10)
    data = tmp_path / "data"
    env = {**os.environ, "PAGEDSERVE_DATA_DIR": str(data)}
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--model", str(tiny), "--port", "0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cannot read weight file {path}" in proc.stderr and "started" not in proc.stderr
    assert not (data / "kernels").exists()  # no worker began compiling

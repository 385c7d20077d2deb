"""Model sources: --model takes a Hugging Face hub id, downloaded from a hub mirror on loopback
(tests/hub_mirror.py, as these machines reach no hub) or served from a pre-filled HF cache (built
here in huggingface_hub's layout: refs/, blobs/, snapshots/ of symlinks) with HF_HUB_OFFLINE set;
clear errors for an id the cache lacks (offline, or the hub unreachable); `pagedserve pull` and
`pagedserve list`; a prepared model's name as --model."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.model_files.default_model import resolve_model
from pagedserve.model_files.hub import HubModelNotFound
from tiny_models import build_tiny_model, make_engine

REPO = "tiny-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def fill_hub_cache(cache, repo_id: str, folder, revision: str = REVISION):
    """Put folder's files into an HF hub cache as huggingface_hub lays it out; return the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for file in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture
def hub(tmp_path, tiny, monkeypatch):
    """An offline machine whose HF cache holds REPO; pagedserve's data dir empty."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PAGEDSERVE_DATA_DIR", str(tmp_path / "data"))
    return fill_hub_cache(tmp_path / "hf" / "hub", REPO, tiny)


def test_a_hub_id_is_served_from_the_cache_offline(hub, tiny):
    assert resolve_model(REPO) == hub
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(3, 40))]
    with make_engine(REPO) as by_id, make_engine(tiny) as by_folder:
        assert by_id.model_path == hub
        assert [s[0].token_ids for s in by_id.generate(prompts, params)] == \
               [s[0].token_ids for s in by_folder.generate(prompts, params)]


def test_an_id_missing_offline_says_so_and_how_to_get_it(hub):
    with pytest.raises(HubModelNotFound) as err:
        resolve_model("tiny-org/absent")
    message = str(err.value)
    assert "model 'tiny-org/absent' is not in the local Hugging Face cache" in message
    assert str(hub.parents[2]) in message and "HF_HUB_OFFLINE is set" in message
    assert "`pagedserve pull tiny-org/absent`" in message and "HF_HOME" in message


def test_an_unreachable_hub_says_so(hub, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(HubModelNotFound, match=rf"http://127.0.0.1:{port} could not be reached .*pagedserve pull"):
        resolve_model("tiny-org/absent")
    assert resolve_model(REPO) == hub  # the cache still answers first, the hub is not asked


def test_pull_and_list(hub, tiny, tmp_path, capsys):
    from pagedserve.cli import main
    assert main(["pull", REPO]) == 0
    assert capsys.readouterr().out.strip() == str(hub)
    # A prepared named model in the data dir, and a cached repo we could not serve.
    shutil.copytree(tiny, tmp_path / "data" / "models" / "tiny-named")
    gemv = tmp_path / "awq-gemv"
    gemv.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    quantized = {**config, "quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}}
    (gemv / "config.json").write_text(json.dumps(quantized))
    fill_hub_cache(hub.parents[2], "tiny-org/tiny-awq-gemv", gemv)
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "ARCHITECTURE", "SIZE", "PATH"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"tiny-named", REPO, "tiny-org/tiny-awq-gemv"}
    size_mib = sum(f.stat().st_size for f in tiny.iterdir()) / 2**20
    assert re.fullmatch(rf"{REPO}\s+LlamaForCausalLM\s+{size_mib:.1f} MiB\s+{re.escape(str(hub))}", rows[REPO])
    assert "(cannot load: the model is quantized with AWQ (4-bit))" in rows["tiny-org/tiny-awq-gemv"]
    assert resolve_model("tiny-named") == tmp_path / "data" / "models" / "tiny-named"


def test_list_with_nothing_prepared(hub, capsys):
    from pagedserve.cli import main
    shutil.rmtree(hub.parents[2])
    assert main(["list"]) == 0
    assert "no models prepared yet" in capsys.readouterr().out


def test_pull_of_a_missing_id_fails_naming_it(hub, capsys):
    from pagedserve.cli import main
    assert main(["pull", "tiny-org/absent"]) == 2
    assert "model 'tiny-org/absent' is not in the local Hugging Face cache" in capsys.readouterr().err


def test_an_unknown_name_lists_what_is_accepted(hub):
    with pytest.raises(FileNotFoundError, match="'no-such-model' is not a model folder, a .gguf file, a name from "
                                                "`pagedserve list`"):
        resolve_model("no-such-model")


def test_the_served_name_of_a_hub_model_is_its_id(hub):
    from pagedserve.tokenizer.service import default_served_name
    assert default_served_name(REPO, hub) == REPO
    assert default_served_name(str(hub), hub) == REVISION  # a folder keeps its own name


def test_serve_with_an_id_it_cannot_get_exits_non_zero(hub):
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--model", "tiny-org/absent"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 2
    assert "pagedserve serve: model 'tiny-org/absent' is not in the local Hugging Face cache" in proc.stderr


def test_a_hub_id_is_downloaded_from_a_mirror_once(hub, tiny, tmp_path, monkeypatch):
    from hub_mirror import HubMirror

    from pagedserve.cli import main
    repo = tmp_path / "mirror" / "tiny-org" / "mirrored"
    shutil.copytree(tiny, repo)
    (repo / "pytorch_model.bin").write_bytes(b"a second copy of the weights, never fetched")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with HubMirror(tmp_path / "mirror") as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        assert main(["pull", "tiny-org/mirrored"]) == 0
        with pytest.raises(HubModelNotFound, match=rf"no model 'tiny-org/absent' on {url}"):
            resolve_model("tiny-org/absent")
    folder = resolve_model("tiny-org/mirrored")  # the mirror is gone: the cache answers
    assert folder.parents[1] == hub.parents[2] / "models--tiny-org--mirrored"
    assert sorted(f.name for f in folder.iterdir()) == sorted(f.name for f in tiny.iterdir())
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with make_engine("tiny-org/mirrored") as by_id, make_engine(tiny) as by_folder:
        ours, reference = (engine.generate([[5, 6, 7]], params)[0][0].token_ids for engine in (by_id, by_folder))
        assert ours == reference


def test_pull_of_the_default_models_name_prepares_it_as_download_does(default_model_path, capsys):
    from pagedserve.cli import main
    assert main(["pull", "smollm2-135m-instruct"]) == 0  # names are matched without case
    assert capsys.readouterr().out.strip() == str(default_model_path)
    assert resolve_model("SmolLM2-135M-Instruct") == resolve_model(None) == default_model_path


BRANCH = "gptq-4bit-32g-actorder_True"  # as TheBloke names a variant's branch
BRANCH_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def add_branch(cache, repo_id: str, folder, branch: str, commit: str):
    """Another revision of an already cached repo, named by a branch ref (huggingface_hub's layout)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs" / branch).write_text(commit)
    for file in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_revision_picks_a_branch_as_vllms_flag_does(hub, tmp_path, capsys):
    """--revision (engine, serve's every service, `pull`): the branch's snapshot, not main's; the served
    name stays the id."""
    from pagedserve.cli import main
    from pagedserve.launcher.wiring import Ports, StackConfig, service_argvs
    other = build_tiny_model(tmp_path / "other", "llama", seed=7)
    branch = add_branch(hub.parents[2], REPO, other, BRANCH, BRANCH_COMMIT)
    assert resolve_model(REPO) == hub and resolve_model(REPO, BRANCH) == branch
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with make_engine(REPO, revision=BRANCH) as by_branch, make_engine(other) as by_folder:
        assert by_branch.model_path == branch
        assert by_branch.generate([[5, 6, 7]], params)[0][0].token_ids == \
            by_folder.generate([[5, 6, 7]], params)[0][0].token_ids
    assert main(["pull", REPO, "--revision", BRANCH]) == 0 and capsys.readouterr().out.strip() == str(branch)
    argvs = service_argvs(StackConfig(model=REPO, revision=BRANCH), Ports([7001], 7010, 7020))
    for service in ("worker0", "tokenizer"):
        assert argvs[service][argvs[service].index("--revision") + 1] == BRANCH
    from pagedserve.tokenizer.service import default_served_name, load_tokenizer
    with pytest.raises(FileNotFoundError, match=f"no tokenizer in {branch}"):  # the tokenizer service's: the branch's
        load_tokenizer(REPO, None, BRANCH)
    assert default_served_name(REPO, branch) == REPO
    with pytest.raises(HubModelNotFound, match=f"model '{REPO}' at revision 'no-such-branch' is not in the local "
                                               f".* `pagedserve pull {REPO} --revision no-such-branch`"):
        resolve_model(REPO, "no-such-branch")


def test_the_benches_measure_the_revision_asked_for(hub, tmp_path):
    """`pagedserve bench ... --revision` (every bench that loads a model takes the engine's flags) measures
    that branch's snapshot, not main's."""
    import argparse
    import json

    from pagedserve.bench import add_bench_parser
    other = build_tiny_model(tmp_path / "other", "llama", seed=7)
    branch = add_branch(hub.parents[2], REPO, other, BRANCH, BRANCH_COMMIT)
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    for bench in ("throughput", "latency", "behind", "services", "embeddings", "tp", "structured", "quality"):
        assert parser.parse_args(["bench", bench, "--model", REPO, "--revision", BRANCH]).revision == BRANCH
    out = tmp_path / "latency.json"
    args = parser.parse_args(["bench", "latency", "--model", REPO, "--revision", BRANCH, "--dtype", "float32",
                              "--device", "cpu", "--input-len", "8", "--output-len", "2", "--warmup", "0",
                              "--kv-cache-memory", "8MiB", "--json", str(out)])
    assert args.func(args) == 0
    assert json.loads(out.read_text())["model"] == str(branch)

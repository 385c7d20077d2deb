"""The package's layers hold: the import contracts of pyproject.toml (import-linter), `pagedserve`'s
command line parses without torch, and the scheduler, tokenizer and gateway processes, started as
the launcher starts them and after serving requests, have no torch loaded."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRONT_END = ("scheduler", "tokenizer", "gateway")


def test_import_contracts_are_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is not installed (make installs the test extras)"
    proc = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_the_command_line_parses_without_torch():
    # Every service process starts as `python -m pagedserve.cli <service>`: building the parser
    # (all commands, benches included) must not load torch or transformers.
    code = ("import sys; from pagedserve.cli import build_parser; build_parser().parse_args(['scheduler']); "
            "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def loaded_torch_libraries(pid: int) -> list[str]:
    """The torch shared objects mapped into a process (what `import torch` leaves behind)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    paths = {line.split()[-1] for line in maps.splitlines() if line.count(" ") >= 5}
    return sorted(p for p in paths if "libtorch" in p or ("/torch/" in p and ".so" in p))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@pytest.mark.slow
def test_front_end_services_never_load_torch(default_model_path, tmp_path):
    from openai import OpenAI
    from service_stack import start_test_stack, tiny_model_with_tokenizer

    model = tiny_model_with_tokenizer(tmp_path / "model", default_model_path)
    stack = start_test_stack(model, tmp_path / "logs")
    try:
        client = OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        # Serve through every path that imports lazily: chat template, completions, streaming.
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        list(client.completions.create(model=name, prompt="Once upon", max_tokens=4, stream=True))
        procs = {p.name: p.proc.pid for p in stack.processes}
        report = {name: (loaded_torch_libraries(procs[name]), rss_mib(procs[name])) for name in FRONT_END}
        worker = next(pid for name, pid in procs.items() if name.startswith("worker"))
        assert loaded_torch_libraries(worker), "the check must see torch where it is loaded"
    finally:
        stack.stop()
    print({name: f"{rss:.0f} MiB" for name, (_, rss) in report.items()})
    assert {name: libs for name, (libs, _) in report.items()} == {name: [] for name in FRONT_END}

"""How many of pagedserve's source files one streamed chat completion runs through, from the
gateway's HTTP handler to the worker and back (docs/architecture.md, "One request's files").

    PYTHONPATH=$PWD:$PWD/tests python tests/count_request_files.py [--model PATH] [--json OUT]

Method: the real stack as processes (tests/service_stack.py: a tiny random Llama with the default
model's tokenizer, float32, Redis), each process with a profile hook (a sitecustomize.py put
first on its PYTHONPATH) that records, while a marker file exists, every pagedserve function
called on any of its threads. After a warm-up request, three windows: one streamed chat
completion (16 tokens), then two quiet ones (nothing sent) of QUIET_S seconds or the request's
length if longer. A file counts when a function of it ran in the request's window and in neither
quiet window (so the health checks, heartbeats and pollers that run anyway, every 0.25-1 s, are
left out, and a file they share with the request still counts through the request's own
functions). Import-time code does not count: everything is imported by then. Not a test (pytest
does not collect it); a poller that happens to run in the request's window only can add a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

QUIET_S = 2.0  # longer than every background period (the health watch 0.25 s, the store ping 1 s)
SITECUSTOMIZE = r'''
import json, os, sys, threading, time
_dir = os.environ["PS_TRACE_DIR"]
_root = os.environ["PS_TRACE_ROOT"]
_seen = set()
_on = False

def _profile(frame, event, arg):
    if _on and event == "call":
        code = frame.f_code
        if code.co_filename.startswith(_root):
            _seen.add((code.co_filename, code.co_qualname))

def _snapshot():
    while True:  # other threads may still add for a moment after _on turned off
        try:
            return sorted(set(_seen))
        except RuntimeError:
            time.sleep(0.01)

def _poll():
    global _on
    window = ""
    while True:
        try:
            marker = os.path.join(_dir, "on")
            now = os.path.exists(marker)
            if now and not _on:
                _seen.clear()
                window = open(marker).read().strip()
                _on = True
            elif _on and not now:
                _on = False
                time.sleep(0.05)
                out = os.path.join(_dir, f"{os.getpid()}-{window}.json")
                with open(out + ".tmp", "w") as f:
                    json.dump({"argv": sys.argv, "functions": _snapshot()}, f)
                os.replace(out + ".tmp", out)
        except Exception:
            import traceback
            with open(os.path.join(_dir, f"error-{os.getpid()}.txt"), "a") as f:
                traceback.print_exc(file=f)
        time.sleep(0.02)

sys.setprofile(_profile)
threading.setprofile(_profile)
threading.Thread(target=_poll, name="trace-poll", daemon=True).start()
'''


def _window(trace_dir: Path, name: str, action, min_s: float) -> float:
    (trace_dir / "on").write_text(name)
    time.sleep(0.2)  # every process's poller has seen the marker
    started = time.monotonic()
    action()
    elapsed = max(time.monotonic() - started, min_s)
    time.sleep(max(0.0, min_s - (time.monotonic() - started)))
    time.sleep(0.2)
    (trace_dir / "on").unlink()
    time.sleep(0.3)  # every poller has seen it gone (and dumps) before the next window begins
    return elapsed


def _collect(trace_dir: Path, name: str, num_processes: int) -> dict[str, set[tuple[str, str]]]:
    deadline = time.monotonic() + 30
    while len(list(trace_dir.glob(f"*-{name}.json"))) < num_processes and time.monotonic() < deadline:
        time.sleep(0.1)
    out = {}
    for path in trace_dir.glob(f"*-{name}.json"):
        data = json.loads(path.read_text())
        service = next((a for a in data["argv"][1:] if not a.startswith("-")), "?")
        out[f"{service}:{path.name.split('-')[0]}"] = {tuple(f) for f in data["functions"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (default: a tiny Llama with the default model's tokenizer)")
    parser.add_argument("--json", help="write the files per service here")
    args = parser.parse_args()

    import openai
    from service_stack import start_test_stack, tiny_model_with_tokenizer

    import pagedserve
    root = str(Path(pagedserve.__file__).parent) + os.sep
    work = Path(tempfile.mkdtemp(prefix="request-files-"))
    trace_dir, site_dir = work / "trace", work / "site"
    trace_dir.mkdir()
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    if args.model:
        model = Path(args.model)
    else:
        from pagedserve.model_files.default_model import ensure_default_model
        model = tiny_model_with_tokenizer(work / "model", ensure_default_model(progress=False))
    env = {**os.environ, "PS_TRACE_DIR": str(trace_dir), "PS_TRACE_ROOT": root,
           "PYTHONPATH": os.pathsep.join([str(site_dir), os.environ.get("PYTHONPATH", "")])}
    os.environ.update({k: env[k] for k in ("PS_TRACE_DIR", "PS_TRACE_ROOT")})
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # the children inherit it (children_env)
    stack = start_test_stack(model, work / "logs")
    try:
        client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        name = client.models.list().data[0].id

        def chat() -> None:
            stream = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16,
                temperature=0, stream=True)
            assert sum(1 for _ in stream) > 1

        chat()  # warm-up: first-call paths (compiles, caches) stay out of the count
        num = len(stack.processes)
        length = _window(trace_dir, "request", chat, 0.0)
        request = _collect(trace_dir, "request", num)
        quiet = []
        for name in ("quiet1", "quiet2"):
            _window(trace_dir, name, lambda: None, max(length, QUIET_S))
            quiet.append(_collect(trace_dir, name, num))
        if any(len(q) < num for q in [request, *quiet]):
            raise RuntimeError(f"a process wrote no trace: {[sorted(q) for q in [request, *quiet]]}")
    finally:
        stack.stop()
    per_service: dict[str, dict[str, list[str]]] = {}  # service -> file -> its functions that ran
    for proc, functions in sorted(request.items()):
        background = set().union(*(q.get(proc, set()) for q in quiet))
        files: dict[str, list[str]] = {}
        for path, name in sorted(functions - background):
            files.setdefault(path.removeprefix(root), []).append(name)
        per_service[proc.split(":")[0]] = files
    every = sorted(set().union(*per_service.values()))
    for service, files in per_service.items():
        print(f"{service}: {len(files)} files: {' '.join(files)}")
    print(f"in all: {len(every)} distinct files (window {length:.2f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"per_service": per_service, "files": every}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""compose/docker-compose.yml: valid for docker-compose (no Docker engine needed), and every service's
command and PAGEDSERVE_* variables are accepted by the pagedserve CLI."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extras: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
SERVICES = {"redis", "worker", "scheduler", "tokenizer", "gateway"}
PAGEDSERVE_SERVICES = SERVICES - {"redis"}
# PAGEDSERVE_* variables read by the code rather than by a flag.
NON_FLAG_VARIABLES = {"PAGEDSERVE_DATA_DIR", "PAGEDSERVE_NO_CPU_KERNELS"}


def service_parser(name: str) -> argparse.ArgumentParser:
    from pagedserve.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def flag_variables(parser: argparse.ArgumentParser) -> dict[str, str]:
    """PAGEDSERVE_* variable -> the flag it stands for (what pagedserve.cli.apply_env_defaults reads)."""
    return {f"PAGEDSERVE_{a.dest.upper()}": a.option_strings[-1] for a in parser._actions
            if a.option_strings and a.dest != "help"}


def unknown_variables(parser: argparse.ArgumentParser, environment: dict[str, str]) -> list[str]:
    """The PAGEDSERVE_* names in environment that no flag of parser reads (a typo would be ignored)."""
    known = flag_variables(parser)
    return sorted(k for k in environment if k.startswith("PAGEDSERVE_") and k not in known
                  and k not in NON_FLAG_VARIABLES)


def compose_services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


def test_docker_compose_config_accepts_the_file():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not on the PATH (`make test` installs Debian's docker-compose when root; "
                    "else: apt-get install docker-compose)")
    cmd = [exe, "-f", str(COMPOSE_FILE)]
    proc = subprocess.run([*cmd, "config", "-q"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([*cmd, "config", "--services"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) == SERVICES


def test_only_the_gateway_is_published():
    services = compose_services()
    assert set(services) == SERVICES
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published == {"gateway"}
    # on this machine only, unless PAGEDSERVE_BIND says otherwise
    assert sorted(str(p) for p in services["gateway"]["ports"]) == ["${PAGEDSERVE_BIND:-127.0.0.1}:50051:50051",
                                                                    "${PAGEDSERVE_BIND:-127.0.0.1}:8000:8000"]
    for svc in services.values():
        assert svc.get("restart") == "unless-stopped"


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # KEY=VALUE form
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


@pytest.mark.parametrize("name", sorted(PAGEDSERVE_SERVICES))
def test_service_command_parses_with_its_environment(name, monkeypatch):
    svc = compose_services()[name]
    command = svc["command"]
    assert isinstance(command, list) and command[:2] == ["pagedserve", name], command
    env = _env(svc)
    assert unknown_variables(service_parser(name), env) == [], f"{name}: variables that name no flag"
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from pagedserve.cli import build_parser
    args = build_parser().parse_args(command[1:])  # apply_env_defaults ran inside build_parser
    assert args.command == name
    flags = flag_variables(service_parser(name))
    for key, value in env.items():
        if key in flags:
            dest = key.removeprefix("PAGEDSERVE_").lower()
            assert str(getattr(args, dest)) == value, (name, key)
    assert args.host == "0.0.0.0"  # reachable from the other containers


def test_unknown_variables_helper_catches_typos():
    parser = service_parser("scheduler")
    assert unknown_variables(parser, {"PAGEDSERVE_WORKER_ADDRS": "w:1", "PAGEDSERVE_MAX_NUM_SEQ": "4",
                                      "PAGEDSERVE_DATA_DIR": "/models", "OTHER": "x"}) == ["PAGEDSERVE_MAX_NUM_SEQ"]


def test_wiring_between_services_matches_their_ports():
    services = compose_services()
    env = {name: _env(services[name]) for name in PAGEDSERVE_SERVICES}
    port = {name: env[name]["PAGEDSERVE_PORT"] for name in PAGEDSERVE_SERVICES}
    assert env["scheduler"]["PAGEDSERVE_WORKER_ADDRS"] == f"worker:{port['worker']}"
    assert env["tokenizer"]["PAGEDSERVE_SCHEDULER_ADDR"] == f"scheduler:{port['scheduler']}"
    assert env["gateway"]["PAGEDSERVE_SCHEDULER_ADDR"] == f"scheduler:{port['scheduler']}"
    assert env["gateway"]["PAGEDSERVE_TOKENIZER_ADDR"] == f"tokenizer:{port['tokenizer']}"
    assert env["scheduler"]["PAGEDSERVE_REDIS_URL"].startswith("redis://redis:")
    # Each health check asks the service's own gRPC port.
    grpc_port = {**port, "gateway": env["gateway"]["PAGEDSERVE_GRPC_PORT"]}
    for name in PAGEDSERVE_SERVICES:
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "pagedserve.healthcheck"], test
        assert test[-1] == f"127.0.0.1:{grpc_port[name]}"
    # Start order: worker -> scheduler -> tokenizer -> gateway, each on the previous one's health.
    order = {"scheduler": {"worker", "redis"}, "tokenizer": {"scheduler"}, "gateway": {"tokenizer"}}
    for name, needs in order.items():
        depends = services[name]["depends_on"]
        assert set(depends) == needs
        assert all(d["condition"] == "service_healthy" for d in depends.values())


def test_dockerfile_fetches_the_default_model_at_build_time():
    text = (ROOT / "compose" / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert "download.pytorch.org/whl/cpu" in text
    assert "RUN pagedserve download" in text
    assert "PAGEDSERVE_DATA_DIR=/models" in text


def _torch_install_step(variant: str, tmp_path: Path) -> list[str]:
    """Run the Dockerfile's torch step as sh would, with TORCH_VARIANT=variant and a stand-in pip
    that records its arguments; returns them (or raises CalledProcessError with the step's stderr)."""
    tmp_path = tmp_path / variant
    tmp_path.mkdir()
    text = (ROOT / "compose" / "Dockerfile").read_text()
    step = next(block for block in text.split("\nRUN ")[1:] if "TORCH_VARIANT" in block.split("\n")[0])
    lines = []
    for line in step.split("\n"):
        lines.append(line.rstrip("\\").rstrip())
        if not line.endswith("\\"):
            break
    (tmp_path / "pip").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/pip.log\n")
    (tmp_path / "pip").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "TORCH_VARIANT": variant}
    subprocess.run(["sh", "-c", " ".join(lines)], env=env, check=True, capture_output=True, text=True, timeout=30)
    return (tmp_path / "pip.log").read_text().split()


def test_dockerfile_builds_cpu_by_default_and_cuda_on_request(tmp_path):
    text = (ROOT / "compose" / "Dockerfile").read_text()
    assert "ARG TORCH_VARIANT=cpu" in text
    assert "NVIDIA_VISIBLE_DEVICES" not in text.replace("# No NVIDIA_VISIBLE_DEVICES", "")
    cpu = _torch_install_step("cpu", tmp_path)
    assert cpu == ["install", "--index-url", "https://download.pytorch.org/whl/cpu", "torch>=2.13,<2.15"]
    cuda = _torch_install_step("cuda", tmp_path)
    assert cuda == ["install", "torch>=2.13,<2.15"]  # PyPI's torch: the CUDA build, NCCL and Triton with it
    with pytest.raises(subprocess.CalledProcessError) as failed:
        _torch_install_step("rocm", tmp_path)
    assert "TORCH_VARIANT must be cpu or cuda, not 'rocm'" in failed.value.stderr


def test_the_replicas_overlay_names_only_flags_and_wires_a_second_replica():
    """compose/docker-compose.replicas.yml (docs/scale-out.md): every variable names a flag of its
    service; replica r1 has its own worker; the tokenizer routes over the Redis registry."""
    overlay = yaml.safe_load((ROOT / "compose" / "docker-compose.replicas.yml").read_text())["services"]
    kinds = {"scheduler": "scheduler", "scheduler-r1": "scheduler", "tokenizer": "tokenizer"}
    for name, kind in kinds.items():
        assert unknown_variables(service_parser(kind), _env(overlay[name])) == [], name
    assert _env(overlay["scheduler-r1"])["PAGEDSERVE_WORKER_ADDRS"] == "worker-r1:50061"
    assert {_env(overlay[n])["PAGEDSERVE_REPLICA_ID"] for n in ("scheduler", "scheduler-r1")} == {"r0", "r1"}
    assert _env(overlay["tokenizer"])["PAGEDSERVE_REDIS_URL"].startswith("redis://redis:")
    exe = shutil.which("docker-compose")
    if exe is not None:
        overlay_file = ROOT / "compose" / "docker-compose.replicas.yml"
        proc = subprocess.run([exe, "-f", str(COMPOSE_FILE), "-f", str(overlay_file), "config", "-q"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr

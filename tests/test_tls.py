"""Mutual TLS between the internal services: certificates from files (PAGEDSERVE_TLS_CERT/KEY/CA,
or `serve --tls-cert --tls-key --tls-ca`); a peer without a certificate the CA signed is refused."""

from __future__ import annotations

import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.common.grpc_util import TLS_ENV, add_internal_port, check_health, free_port, internal_channel


def make_certificates(folder: Path, name: str) -> dict[str, str]:
    """A CA and one certificate it signed for 127.0.0.1 / localhost, usable by servers and clients."""
    def run(*argv: str) -> None:
        subprocess.run(["openssl", *argv], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.pem",
        "-days", "2", "-subj", f"/CN={name} test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
        "-subj", "/CN=127.0.0.1")
    (folder / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                        "extendedKeyUsage=serverAuth,clientAuth\n")
    run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.pem", "-CAkey", f"{name}-ca.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return {TLS_ENV["cert"]: str(folder / f"{name}.pem"), TLS_ENV["key"]: str(folder / f"{name}.key"),
            TLS_ENV["ca"]: str(folder / f"{name}-ca.pem")}


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> dict[str, dict[str, str]]:
    folder = tmp_path_factory.mktemp("tls")
    return {"ours": make_certificates(folder, "ours"), "rogue": make_certificates(folder, "rogue")}


@pytest.fixture
def tls_server(certificates, monkeypatch):
    """A gRPC server with only the health service, bound by add_internal_port under our TLS."""
    for var, path in certificates["ours"].items():
        monkeypatch.setenv(var, path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = add_internal_port(server, f"127.0.0.1:{free_port()}")
    assert port
    server.start()
    for var in TLS_ENV.values():
        monkeypatch.delenv(var)
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_a_peer_with_our_certificate_is_served(tls_server, certificates):
    assert check_health(tls_server, environ=certificates["ours"], timeout_s=5)


def test_plain_tcp_and_foreign_certificates_are_refused(tls_server, certificates):
    assert not check_health(tls_server, environ={}, timeout_s=2)  # no TLS at all
    assert not check_health(tls_server, environ=certificates["rogue"], timeout_s=2)  # another CA's certificate
    # TLS that trusts our server but presents no client certificate.
    server_ca = Path(certificates["ours"][TLS_ENV["ca"]]).read_bytes()
    with grpc.secure_channel(tls_server, grpc.ssl_channel_credentials(root_certificates=server_ca)) as channel:
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)


def test_half_a_configuration_is_an_error(certificates):
    from pagedserve.common.grpc_util import internal_tls
    ours = certificates["ours"]
    with pytest.raises(ValueError, match="go together"):
        internal_tls({TLS_ENV["cert"]: ours[TLS_ENV["cert"]]})
    with pytest.raises(ValueError, match="cannot read the TLS key file"):
        internal_tls({TLS_ENV["cert"]: ours[TLS_ENV["cert"]], TLS_ENV["key"]: "/nonexistent/key.pem"})


@pytest.mark.slow
def test_the_services_talk_tls_among_themselves(certificates, default_model_path, tmp_path_factory):
    """`serve --tls-cert --tls-key --tls-ca`: every internal hop is mutual TLS; the public API is
    unchanged; a plain-TCP client of the scheduler gets nothing."""
    from service_stack import start_test_stack, tiny_model_with_tokenizer

    from pagedserve.v1 import scheduler_pb2, scheduler_pb2_grpc

    ours = certificates["ours"]
    model = tiny_model_with_tokenizer(tmp_path_factory.mktemp("tls-tok"), default_model_path)
    stack = start_test_stack(model, tmp_path_factory.mktemp("tls-logs"), tls_cert=ours[TLS_ENV["cert"]],
                             tls_key=ours[TLS_ENV["key"]], tls_ca=ours[TLS_ENV["ca"]])
    try:
        reply = httpx.post(stack.addresses["http"] + "/v1/completions", timeout=60,
                           json={"model": httpx.get(stack.addresses["http"] + "/v1/models").json()["data"][0]["id"],
                                 "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        scheduler = stack.addresses["scheduler"]
        assert not check_health(scheduler, environ={}, timeout_s=2)
        with internal_channel(scheduler, environ=ours) as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.StatsRequest(), timeout=10)
        assert stats.ready
    finally:
        stack.stop()

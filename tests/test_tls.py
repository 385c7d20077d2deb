"""Mutual TLS between the internal services: certificates from files (PAGEDSERVE_TLS_CERT/KEY/CA,
or `serve --tls-cert --tls-key --tls-ca`); a peer without a certificate the CA signed is refused. The
certificates come from conftest.py's `certificates`; the services themselves talking TLS:
tests/stack/test_tls_stack.py."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.common.grpc_util import TLS_ENV, add_internal_port, check_health, free_port


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
    assert check_health(tls_server, environ=certificates["ours"], timeout_s=20)


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

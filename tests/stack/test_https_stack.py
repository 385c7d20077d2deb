"""The OpenAI API over HTTPS by vLLM's flags (`serve --ssl-keyfile --ssl-certfile [--ssl-ca-certs
--ssl-cert-reqs]`), every service a real process; the certificates come from conftest.py's
`certificates` (a CA and a certificate it signed for 127.0.0.1, for servers and clients alike)."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest

from pagedserve.common import https
from pagedserve.common.grpc_util import TLS_ENV


def context(ca: str, cert: str, key: str) -> ssl.SSLContext:
    """A client's TLS: the server verified by `ca`, `cert` presented."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.load_cert_chain(cert, key)
    return ctx


@pytest.mark.slow
def test_the_api_over_https_with_client_certificates(certificates, tiny_model, launch_stack):
    """HTTPS with client certificates required: the `openai` SDK presenting the CA's certificate gets its
    completion; a client without one, and plain HTTP, get nothing."""
    ours, rogue = certificates["ours"], certificates["rogue"]
    cert, key, ca = ours[TLS_ENV["cert"]], ours[TLS_ENV["key"]], ours[TLS_ENV["ca"]]
    stack = launch_stack(tiny_model, "https-logs", ssl_keyfile=key, ssl_certfile=cert, ssl_ca_certs=ca,
                         ssl_cert_reqs=2)
    assert stack.http_url.startswith("https://127.0.0.1:")
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60,
                           http_client=httpx.Client(verify=context(ca, cert, key)))
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4
    with pytest.raises(httpx.HTTPError):  # no client certificate
        httpx.get(stack.http_url + "/v1/models", verify=ca, timeout=10)
    with pytest.raises(httpx.HTTPError):  # a certificate of another CA
        httpx.get(stack.http_url + "/v1/models", verify=context(ca, rogue[TLS_ENV["cert"]], rogue[TLS_ENV["key"]]),
                  timeout=10)
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the HTTPS port
        httpx.get(stack.http_url.replace("https://", "http://") + "/v1/models", timeout=10)


def test_what_makes_a_whole_https_setting(certificates):
    ours = certificates["ours"]
    cert, key, ca = ours[TLS_ENV["cert"]], ours[TLS_ENV["key"]], ours[TLS_ENV["ca"]]
    assert https.problem(None, None, None, 0) is None and https.problem(key, cert, None, 0) is None
    assert https.problem(key, cert, ca, 2) is None
    assert "go together" in https.problem(key, None, None, 0)
    assert "need --ssl-keyfile and --ssl-certfile" in https.problem(None, None, ca, 0)
    assert "--ssl-ca-certs must name the CA" in https.problem(key, cert, None, 2)
    assert "must be 0 (none), 1 (optional) or 2 (required), got 3" in https.problem(key, cert, ca, 3)
    assert "--ssl-certfile /no/such.pem: no such file" in https.problem(key, "/no/such.pem", None, 0)
    assert https.uvicorn_kwargs(None, None, None, 0) == {}
    assert https.uvicorn_kwargs(key, cert, ca, 1) == {"ssl_keyfile": key, "ssl_certfile": cert, "ssl_ca_certs": ca,
                                                       "ssl_cert_reqs": 1}


def test_serve_refuses_half_an_https_setting_before_any_service(tmp_path, certificates):
    import os
    import subprocess
    import sys
    key = certificates["ours"][TLS_ENV["key"]]
    env = {**os.environ, "PAGEDSERVE_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--port", "0", "--ssl-keyfile", key],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "--ssl-keyfile and --ssl-certfile go together" in proc.stderr, proc.stderr

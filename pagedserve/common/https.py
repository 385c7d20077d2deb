"""The public HTTP API over TLS, by vLLM's flags (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs,
--ssl-cert-reqs): what makes a whole setting, the scheme it gives the API's URL, and the arguments
uvicorn takes. The gateway serves with them; `serve` checks them before any service starts and
probes its gateway by them. (TLS between the internal services is another matter: --tls-cert & co.,
grpc_util.) No torch; pure functions of the settings.
"""

from __future__ import annotations

import ssl
from pathlib import Path

CERT_REQS = {0: "none", 1: "optional", 2: "required"}  # ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED


def problem(keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int) -> str | None:
    """Why these settings cannot serve HTTPS, or None (also when they ask for no HTTPS at all)."""
    if bool(keyfile) != bool(certfile):
        return "--ssl-keyfile and --ssl-certfile go together: HTTPS needs the key and its certificate"
    if not certfile and (ca_certs or cert_reqs):
        return "--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile (HTTPS)"
    if cert_reqs not in CERT_REQS:
        return f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {cert_reqs}"
    if cert_reqs and not ca_certs:
        return "--ssl-cert-reqs asks for client certificates: --ssl-ca-certs must name the CA to verify them by"
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile), ("--ssl-ca-certs", ca_certs)):
        if path and not Path(path).is_file():
            return f"{flag} {path}: no such file"
    return None


def scheme(certfile: str | None) -> str:
    return "https" if certfile else "http"


def uvicorn_kwargs(keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int) -> dict:
    """uvicorn.Config's TLS arguments (none without HTTPS)."""
    if not certfile:
        return {}
    return {"ssl_keyfile": keyfile, "ssl_certfile": certfile, "ssl_ca_certs": ca_certs,
            "ssl_cert_reqs": int(cert_reqs)}


def probe_context(certfile: str | None) -> ssl.SSLContext | None:
    """The context `serve` checks its own gateway's HTTPS with: encrypted, the certificate not verified
    (the launcher reaches its child by an address the certificate need not name)."""
    if not certfile:
        return None
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context

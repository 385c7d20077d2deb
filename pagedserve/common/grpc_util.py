"""What every pagedserve gRPC server and client shares: health, reflection, options, addresses."""

from __future__ import annotations

import inspect
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Prompts of a full context and top-logprobs of long outputs exceed gRPC's default 4 MiB.
MAX_MESSAGE_BYTES = 64 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


class StatusError(Exception):
    """A gRPC status (code and details) for a servicer to answer its caller with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def add_health_and_reflection(server, service_names: list[str]) -> health.HealthServicer:
    """Register grpc.health.v1 and reflection on server (sync or aio). Every service starts
    NOT_SERVING; the caller flips it with set_serving() once it can do its work."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    return servicer


def set_serving(servicer: health.HealthServicer, service_names: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        servicer.set(name, status)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


PORT_RANGE_ENV = "PAGEDSERVE_PORT_RANGE"  # "LOW-HIGH": free_port picks in [LOW, HIGH) (a firewall's, a test worker's)


def port_range() -> tuple[int, int] | None:
    """The ports free_port picks from: $PAGEDSERVE_PORT_RANGE when set, else 10000 up to the kernel's
    ephemeral range (None where that range starts too low to leave any)."""
    text = os.environ.get(PORT_RANGE_ENV)
    if text:
        try:
            low, high = (int(x) for x in text.split("-"))
        except ValueError:
            raise ValueError(f"{PORT_RANGE_ENV} must be LOW-HIGH, got {text!r}") from None
        if not 0 < low < high <= 65536:
            raise ValueError(f"{PORT_RANGE_ENV} {text!r} is not a range of ports (1 <= LOW < HIGH <= 65536)")
        return low, high
    low, _ = _ephemeral_range()
    return (10000, low) if low > 10001 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, picked at random in port_range(): below the kernel's ephemeral range
    by default, since a port the kernel hands out for bind(0) can be handed out again to another
    process's outgoing or bind(0) socket (torch.distributed's gloo opens many) before the service we
    pick it for binds it (seen: a gateway failing with "Address already in use" beside two gloo ranks).
    Processes that pick ports at once (the test suite's workers) each keep to a range of their own."""
    import random
    chosen = port_range()
    if chosen is not None:
        for _ in range(50):
            port = random.randrange(*chosen)
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
        if os.environ.get(PORT_RANGE_ENV):
            raise OSError(f"no free port found in {PORT_RANGE_ENV}={os.environ[PORT_RANGE_ENV]}")
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# Mutual TLS between the internal services (worker, scheduler, tokenizer, and the gateway as their
# client): PEM files named by these variables, which `pagedserve serve --tls-cert/--tls-key/--tls-ca`
# sets for every child. Unset: plain TCP, for loopback or a private network only.
TLS_ENV = {"cert": "PAGEDSERVE_TLS_CERT", "key": "PAGEDSERVE_TLS_KEY", "ca": "PAGEDSERVE_TLS_CA"}


@dataclass(frozen=True, slots=True)
class TLSFiles:
    cert: bytes
    key: bytes
    ca: bytes | None  # given: peers must present a certificate it signed (both directions)


def internal_tls(environ=None) -> TLSFiles | None:
    """The internal TLS files named in environ (default: this process's environment), or None."""
    environ = os.environ if environ is None else environ
    paths = {name: environ.get(var) or None for name, var in TLS_ENV.items()}
    if not paths["cert"] and not paths["key"]:
        if paths["ca"]:
            raise ValueError(f"{TLS_ENV['ca']} is set without {TLS_ENV['cert']} and {TLS_ENV['key']}")
        return None
    if not (paths["cert"] and paths["key"]):
        raise ValueError(f"{TLS_ENV['cert']} and {TLS_ENV['key']} go together (a certificate and its private key)")
    contents = {}
    for name, path in paths.items():
        if path is None:
            contents[name] = None
            continue
        try:
            contents[name] = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the TLS {name} file {path}: {exc.strerror or exc}") from None
    return TLSFiles(contents["cert"], contents["key"], contents["ca"])


def internal_channel(address: str, aio: bool = False, options=None, environ=None):
    """A channel to an internal service: TLS with our certificate when configured, else plain."""
    api = grpc.aio if aio else grpc
    options = CHANNEL_OPTIONS if options is None else options
    tls = internal_tls(environ)
    if tls is None:
        return api.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key,
                                               certificate_chain=tls.cert)
    return api.secure_channel(address, credentials, options=options)


def add_internal_port(server, address: str) -> int:
    """Bind an internal service: TLS (client certificates required when a CA is given) when
    configured, else plain. Returns the port, 0 when the bind failed."""
    tls = internal_tls()
    if tls is None:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                              require_client_auth=tls.ca is not None)
    return server.add_secure_port(address, credentials)


def check_health(address: str, service: str = "", timeout_s: float = 1.0, internal: bool = True,
                 environ=None) -> bool:
    """internal=False: a public port (the gateway's gRPC API), which never uses the internal TLS;
    environ: whose TLS settings to use (a child's environment; default this process's)."""
    try:
        channel = internal_channel(address, options=[], environ=environ) if internal else \
            grpc.insecure_channel(address)
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def wait_for_health(address: str, timeout_s: float, service: str = "", alive=lambda: True,
                    internal: bool = True, environ=None) -> None:
    """Poll address's health service until SERVING; raise TimeoutError (or RuntimeError when
    alive() turns false, e.g. the process died) naming the address."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the service at {address} exited before it became healthy")
        if check_health(address, service, internal=internal, environ=environ):
            return
        time.sleep(0.1)
    raise TimeoutError(f"the service at {address} was not healthy after {timeout_s:.0f} s")


class MalformedRequest:
    """What a tolerant deserializer hands the servicer instead of raising: gRPC would answer a
    request whose bytes do not parse with UNKNOWN, before any handler could name the problem."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, UnicodeDecodeError, ...
            return MalformedRequest(f"{type(exc).__name__}: {exc}")
    return deserialize


def _malformed_details(request: MalformedRequest) -> str:
    return f"the request message does not parse ({request.error}); send a valid protobuf message"


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Unary-request methods of an aio server answer unparseable request bytes with
    INVALID_ARGUMENT naming the parse error, instead of gRPC's UNKNOWN."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        behavior = handler.unary_unary or handler.unary_stream
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # sync handlers (health, reflection) run in a thread pool: left as they are
        deserialize = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                if isinstance(request, MalformedRequest):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_details(request))
                return await inner(request, context)
            return handler._replace(request_deserializer=deserialize, unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, MalformedRequest):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_details(request))
                result = inner_stream(request, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                else:  # a coroutine that writes with context.write
                    await result
            return handler._replace(request_deserializer=deserialize, unary_stream=unary_stream)
        return handler

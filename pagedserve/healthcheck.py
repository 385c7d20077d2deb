"""`python -m pagedserve.healthcheck ADDRESS`: exit 0 when the service at ADDRESS is healthy, else 1.

ADDRESS host:port asks the standard gRPC health service (grpc.health.v1, service "" unless
--service) for SERVING; an http:// or https:// URL (e.g. the gateway's http://127.0.0.1:8000/health)
expects a 2xx reply. Meant for container health checks: no curl needed, torch not imported.
"""

from __future__ import annotations

import argparse
import sys


def check_http(url: str, timeout_s: float) -> tuple[bool, str]:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return 200 <= reply.status < 300, f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, str(getattr(exc, "reason", exc))


def check_grpc(address: str, service: str, timeout_s: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedserve.common.grpc_util import internal_channel
    try:
        with internal_channel(address, options=[]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
    except grpc.RpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", help="host:port of a gRPC health service, or an http(s):// URL")
    parser.add_argument("--service", default="", help="gRPC service name to ask about (default: the server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.address.startswith(("http://", "https://")):
        ok, what = check_http(args.address, args.timeout)
    else:
        ok, what = check_grpc(args.address, args.service, args.timeout)
    if not args.quiet:
        print(f"{args.address}: {what}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

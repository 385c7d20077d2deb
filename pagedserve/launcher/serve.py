"""`pagedserve serve`: every service as a process on loopback (flags here; heavy imports in main)."""

from __future__ import annotations

import argparse

from pagedserve.common.engine_args import add_engine_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address of the public APIs (HTTP and gRPC)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API")
    parser.add_argument("--grpc-port", type=int, default=50051, help="port of the public gRPC Generate API")
    parser.add_argument("--api-key", default=None, help="require this bearer key (also PAGEDSERVE_API_KEY)")
    parser.add_argument("--redis-url", default=None,
                        help="use this Redis; unset: a private redis-server if one is on the PATH, "
                             "else an in-process store (durability off)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-waiting-requests", type=int, default=1024)
    parser.add_argument("--log-dir", default=None,
                        help="write each service's output to LOG_DIR/<service>.log (default: this terminal)")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds each service may take to turn healthy (the worker loads the model)")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate for TLS between the internal services")
    parser.add_argument("--tls-key", default=None, help="its PEM private key")
    parser.add_argument("--tls-ca", default=None,
                        help="PEM CA that signed every service's certificate (then clients must present one too)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM the gateway lets in-flight requests finish for this long (503 to new ones)")
    parser.add_argument("--stop-timeout", type=float, default=10.0,
                        help="seconds each service gets after SIGTERM before SIGKILL")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restart a service that dies (with backoff; if one tensor-parallel worker rank dies, "
                             "all ranks restart); more than this many restarts within --restart-window and "
                             "everything stops. 0: stop everything when any service dies")
    parser.add_argument("--restart-window", type=float, default=300.0, help="seconds (see --max-restarts)")
    parser.add_argument("--step-timeout", type=float, default=None,
                        help="seconds a worker step may take before the rank counts as dead (scheduler default 60)")
    parser.add_argument("--stall-timeout", type=float, default=None,
                        help="health turns unhealthy when work is pending and no step completed for this long "
                             "(scheduler default 30)")
    add_engine_args(parser)


class _Stop(KeyboardInterrupt):
    """Raised in the main thread by SIGINT or SIGTERM."""


def _served_model_name(http_url: str, api_key: str | None) -> str | None:
    import json
    import urllib.request
    request = urllib.request.Request(http_url + "/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return json.load(reply)["data"][0]["id"]
    except Exception:  # only for the banner
        return None


def main(args: argparse.Namespace) -> int:
    import logging
    import signal
    import sys
    import time

    from pagedserve.launcher.processes import ServiceError, StackConfig, describe_exit, start_stack

    log = logging.getLogger("pagedserve.serve")
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if stopping and signum == signal.SIGTERM:
            return  # already stopping in order; a second SIGINT (Ctrl-C) still hurries it up
        stopping = True
        raise _Stop(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack = None
    try:
        try:
            stack = start_stack(StackConfig.from_args(args))
        except ServiceError as exc:
            print(f"pagedserve serve: {exc}", file=sys.stderr)
            return 1
        name = _served_model_name(stack.http_url, args.api_key) or args.served_model_name or "default"
        print(f"pagedserve: OpenAI API at {stack.http_url}/v1 (model {name}), gRPC at {stack.grpc_address}",
              flush=True)
        print("pagedserve: Ctrl-C stops every service", flush=True)
        while True:
            if stack.gave_up:
                print(f"pagedserve serve: {stack.gave_up}; stopping the others.", file=sys.stderr, flush=True)
                stopping = True
                stack.stop()
                return 1
            dead = stack.dead() if args.max_restarts <= 0 else None
            if dead is not None:
                print(f"pagedserve serve: {dead.name} stopped unexpectedly ({describe_exit(dead.returncode)}); "
                      f"stopping the others.", file=sys.stderr, flush=True)
                if dead.log_path is not None:
                    print(dead.log_tail(), file=sys.stderr, flush=True)
                stopping = True
                stack.stop()
                return 1
            time.sleep(0.5)
    except _Stop as stop:
        log.info("%s: stopping every service", stop)
        return 0
    finally:
        if stack is not None:
            try:
                stack.stop()
            except KeyboardInterrupt:  # a second Ctrl-C: Stack.stop has killed the rest outright
                pass
        for sig, handler in old.items():
            signal.signal(sig, handler)

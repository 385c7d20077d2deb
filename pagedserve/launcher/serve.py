"""`pagedserve serve`: every service as a process on loopback (flags: pagedserve.common.settings;
heavy imports in main)."""

from __future__ import annotations

import argparse

from pagedserve.common import https
from pagedserve.common.settings_cli import add_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting of the "serve" slice of pagedserve.common.settings: the launcher's own, and
    those it hands the services (pagedserve.launcher.wiring)."""
    add_settings(parser, "serve")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (the same as --model)")


def positional_model(args: argparse.Namespace) -> None:
    """`pagedserve serve MODEL` as `vllm serve MODEL`: the positional model is --model (both, and not the
    same: ValueError)."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ValueError(f"the model is named twice: {tag!r} and --model {args.model!r}")
    args.model = tag


class _Stop(KeyboardInterrupt):
    """Raised in the main thread by SIGINT or SIGTERM."""


def _served_model_name(http_url: str, api_key: str | None, context=None) -> str | None:
    import json
    import urllib.request
    request = urllib.request.Request(http_url + "/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as reply:
            return json.load(reply)["data"][0]["id"]
    except Exception:  # only for the banner
        return None


def check_model(model: str | None, speculative_config: str | None = None, max_model_len: int | None = None,
                quantization: str = "auto", revision: str | None = None,
                mm_processor_kwargs: str | None = None) -> None:
    """Before any service starts: the model is found (a hub id is downloaded here, once, for every
    rank) and its config.json is one we can serve (an architecture we have, no quantization_config
    we cannot load), so that a bad --model fails in a second with its reason, not as a worker's
    log tail; so do a bad --speculative-config and its draft model (model_files/draft_check.py), and a
    weight file that cannot be read (model_files/weight_check.py), and a --quantization naming a method the
    checkpoint is not quantized with (common/checkpoint_quantization.quantization_flag), and a bad
    --mm-processor-kwargs as the worker reads it (the tokenizer's own checks run in the tokenizer)."""
    from pagedserve.common.checkpoint_quantization import quantization_flag
    from pagedserve.common.model_config import ModelConfig
    from pagedserve.common.speculative import parse_speculative_config
    from pagedserve.model_files.default_model import resolve_model
    from pagedserve.model_files.draft_check import check_draft_model
    from pagedserve.model_files.weight_check import check_weight_files
    folder = resolve_model(model, revision)
    target = ModelConfig.from_folder(folder, mm_processor_kwargs)
    quantization_flag(quantization, target.hf, f"the model in {folder}")
    check_weight_files(folder)
    check_draft_model(parse_speculative_config(speculative_config), target, max_model_len)


def main(args: argparse.Namespace) -> int:
    import logging
    import signal
    import sys
    import time

    from pagedserve.launcher.service_process import ServiceError, describe_exit
    from pagedserve.launcher.stack import start_stack
    from pagedserve.launcher.wiring import StackConfig, first_api_key

    log = logging.getLogger("pagedserve.serve")
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        if stopping and signum == signal.SIGTERM:
            return  # already stopping in order; a second SIGINT (Ctrl-C) still hurries it up
        stopping = True
        raise _Stop(signal.Signals(signum).name)

    try:
        positional_model(args)
        tls_problem = https.problem(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)
        if tls_problem:
            raise ValueError(tls_problem)
        check_model(args.model, args.speculative_config, args.max_model_len, args.quantization, args.revision,
                    args.mm_processor_kwargs)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedserve serve: {exc}", file=sys.stderr)
        return 2
    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack = None
    try:
        try:
            stack = start_stack(StackConfig.from_args(args))
        except ServiceError as exc:
            print(f"pagedserve serve: {exc}", file=sys.stderr)
            return 1
        key = first_api_key(args.api_key, args.api_key_file)
        name = _served_model_name(stack.http_url, key, https.probe_context(args.ssl_certfile)) or (
            args.served_model_name or ["default"])[0]
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

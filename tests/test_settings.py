"""pagedserve.common.settings: every setting declared once. Each parser is its service's slice of the
table, --help states every default and variable, PAGEDSERVE_* variables set defaults, the derived
defaults are computed in one place, and the services' own config classes agree with the table."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from pagedserve.common import settings
from pagedserve.common.setting_spec import SERVICES, Setting
from pagedserve.common.settings import SETTINGS, settings_of, shared, step_budgets
from pagedserve.common.settings_cli import add_settings, apply_env_defaults, argv_for, handed_on_env, secret_env

COMMANDS = ("serve", "worker", "scheduler", "tokenizer", "gateway")


@pytest.fixture(autouse=True)
def no_pagedserve_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(key)


def subparser(name: str) -> argparse.ArgumentParser:
    from pagedserve.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def option_dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}


def parse(argv: list[str]) -> argparse.Namespace:
    from pagedserve.cli import build_parser
    return build_parser().parse_args(argv)


# ---- the table -------------------------------------------------------------------------------
def test_every_service_parser_is_its_slice_of_the_table():
    for name in COMMANDS:  # and --config, which every command takes (common/config_file.py)
        assert option_dests(subparser(name)) == {s.dest for s in settings_of(name)} | {"config"}, name
    engine = {s.dest for s in settings_of("engine")}
    for name in ("generate", "chat"):
        assert engine <= option_dests(subparser(name))


def test_the_table_holds_together():
    for s in SETTINGS:
        assert s.flag.startswith("--") and s.env == "PAGEDSERVE_" + s.flag[2:].upper().replace("-", "_")
        assert s.services <= set(SERVICES)
        if s.type is bool:
            assert s.default is False
    with pytest.raises(ValueError, match="unknown services"):
        Setting("--x", "engine sevre")
    with pytest.raises(ValueError, match="not among"):
        Setting("--x", "engine", default="a", choices=("b",))
    # One meaning per name and service: --port is declared once per service that has its own.
    ports = {service: settings.setting(service, "port").default for service in COMMANDS}
    assert ports == {"serve": 8000, "gateway": 8000, "scheduler": 50060, "tokenizer": 50052, "worker": 50061}
    # The addresses' defaults follow the ports' defaults.
    assert settings.setting("gateway", "scheduler_addr").default == f"127.0.0.1:{ports['scheduler']}"
    assert settings.setting("gateway", "tokenizer_addr").default == f"127.0.0.1:{ports['tokenizer']}"
    assert settings.setting("scheduler", "worker_addrs").default == f"127.0.0.1:{ports['worker']}"


def test_every_engine_setting_reaches_a_service_through_serve():
    for s in settings_of("engine"):
        assert "serve" in s.services, s.flag
        # (--runner and --pooler shape the API: the gateway is the service that reads them)
        assert s.services & {"worker", "scheduler", "tokenizer", "gateway"}, s.flag
    # Everything serve takes is its own (the launcher's) or some service's.
    for s in settings_of("serve"):
        assert s.services == {"serve"} or s.services - {"serve", "engine"}, s.flag


@pytest.mark.parametrize("name", COMMANDS)
def test_help_states_every_default_and_variable(name):
    text = " ".join(subparser(name).format_help().split())
    for s in settings_of(name):
        assert s.flag in text
        assert s.env in text, (name, s.flag)
    assert text.count("(default: ") >= len(settings_of(name))
    assert "PAGEDSERVE_SOME_FLAG" in text


def test_engine_commands_state_defaults_without_variables():
    text = " ".join(subparser("generate").format_help().split())
    assert "(default: 512 on CPU, 2048 on CUDA)" in text and "PAGEDSERVE_" not in text


@pytest.mark.parametrize("command", ["serve", "scheduler"])
def test_help_on_the_command_line(command):
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", command, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--max-num-seqs MAX_NUM_SEQS most sequences in one step (default: 128; env PAGEDSERVE_MAX_NUM_SEQS)" \
        in text
    assert "(default: off; env PAGEDSERVE_NO_PREFIX_CACHING=1)" in text


def test_a_variable_shows_as_the_default_in_help(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_SEQS", "7")
    assert "(default: 7; env PAGEDSERVE_MAX_NUM_SEQS)" in " ".join(subparser("scheduler").format_help().split())


def test_secrets_never_show_in_help(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "sk-secret")
    assert "sk-secret" not in subparser("serve").format_help()
    assert "sk-secret" not in subparser("gateway").format_help()


# ---- the environment ---------------------------------------------------------------------------
def env_parser(service: str, environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_settings(parser, service)
    apply_env_defaults(parser, environ)
    return parser


def test_variables_set_defaults_and_the_command_line_wins():
    p = env_parser("scheduler", {"PAGEDSERVE_MAX_NUM_SEQS": "8", "PAGEDSERVE_NO_PREFIX_CACHING": "yes",
                                 "PAGEDSERVE_STEP_TIMEOUT": "2.5", "PAGEDSERVE_PREEMPTION_MODE": "swap",
                                 "PAGEDSERVE_KV_CACHE_MEMORY": "1GiB"})
    args = p.parse_args([])
    assert (args.max_num_seqs, args.no_prefix_caching, args.step_timeout) == (8, True, 2.5)
    assert (args.preemption_mode, args.kv_cache_memory) == ("swap", "1GiB")
    assert p.parse_args(["--max-num-seqs", "3"]).max_num_seqs == 3
    assert env_parser("scheduler", {"PAGEDSERVE_NO_PREFIX_CACHING": "0"}).parse_args([]).no_prefix_caching is False


def test_repeatable_settings_read_one_item_from_the_environment():
    p = env_parser("gateway", {"PAGEDSERVE_API_KEY": "k1,k2"})
    assert p.parse_args([]).api_key == ["k1,k2"]  # the gateway splits on commas
    assert p.parse_args(["--api-key", "k3"]).api_key == ["k1,k2", "k3"]
    assert env_parser("gateway", {}).parse_args(["--api-key", "a", "--api-key", "b"]).api_key == ["a", "b"]


@pytest.mark.parametrize("variable, value", [("PAGEDSERVE_MAX_NUM_SEQS", "many"), ("PAGEDSERVE_DEVICE", "gpu"),
                                             ("PAGEDSERVE_NO_CHUNKED_PREFILL", "maybe")])
def test_a_bad_variable_is_an_error_naming_it(variable, value):
    with pytest.raises(ValueError, match=variable):
        env_parser("serve", {variable: value})


def test_a_bad_variable_ends_the_command_with_exit_code_2(monkeypatch, capsys):
    from pagedserve.cli import main
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_SEQS", "many")
    assert main(["scheduler"]) == 2
    assert "PAGEDSERVE_MAX_NUM_SEQS='many'" in capsys.readouterr().err


# ---- handing settings on ----------------------------------------------------------------------
def test_argv_for_hands_on_what_differs_from_the_default():
    values = {"model": "/m", "device": "auto", "block_size": 8, "no_prefix_caching": True,
              "no_chunked_prefill": False, "max_num_batched_tokens": None, "api_key": ["sk"], "max_n": 4}
    # the worker sizes its KV pool at startup by the scheduler's settings (fails there when it holds no block)
    assert argv_for("worker", values) == ["--model", "/m", "--block-size", "8"]
    assert argv_for("scheduler", values) == ["--block-size", "8", "--no-prefix-caching"]
    assert argv_for("gateway", values) == ["--max-n", "4"]  # the key goes by environment
    assert argv_for("gateway", {"port": 9}, skip={"port"}) == []
    assert secret_env("gateway", values) == {"PAGEDSERVE_API_KEY": "sk"}
    assert secret_env("gateway", {"api_key": ["a", "b"]}) == {"PAGEDSERVE_API_KEY": "a,b"}
    assert secret_env("scheduler", values) == {}
    # A service only gets what it shares with the launcher (the same declaration).
    assert "PAGEDSERVE_WORKER_TIMEOUT" not in handed_on_env("scheduler")
    assert "PAGEDSERVE_MAX_NUM_SEQS" in handed_on_env("scheduler")
    assert "PAGEDSERVE_API_KEY" not in handed_on_env("gateway")
    assert {s.dest for s in shared("serve", "tokenizer")} == {
        "model", "revision", "served_model_name", "tokenizer", "chat_template", "routing_policy", "service_transport",
        "generation_config", "override_generation_config", "mm_processor_kwargs"}


def test_a_vllm_command_line_starts_serve():
    """`vllm serve MODEL ...` with the flags its users pass: the positional model, vLLM's names of our
    settings (-tp, --enable-prefix-caching / --no-enable-..., --async-scheduling) and its switches whose
    meaning is ours already; what is not implemented (an fp8 KV cache) is refused naming the flag."""
    from pagedserve.launcher.serve import positional_model
    args = parse(["serve", "/models/llama", "--dtype", "auto", "--max-model-len", "2048", "-tp", "2",
                  "--enable-prefix-caching", "--no-enable-chunked-prefill", "--enable-auto-tool-choice",
                  "--tool-call-parser", "hermes", "--trust-remote-code", "--disable-log-requests",
                  "--kv-cache-dtype", "auto", "--async-scheduling", "--gpu-memory-utilization", "0.85",
                  "--quantization", "gptq_marlin", "--revision", "gptq-4bit-32g", "--ssl-cert-reqs", "0"])
    positional_model(args)
    assert (args.quantization, args.revision, args.ssl_cert_reqs) == ("gptq_marlin", "gptq-4bit-32g", 0)
    assert (args.model, args.tensor_parallel_size, args.max_model_len) == ("/models/llama", 2, 2048)
    assert (args.no_prefix_caching, args.no_chunked_prefill, args.no_async_scheduling) == (False, True, False)
    assert args.tool_call_parser == "hermes" and args.enable_auto_tool_choice
    assert {"--no-chunked-prefill", "--max-model-len"} <= set(argv_for("scheduler", vars(args)))
    assert "--no-prefix-caching" not in argv_for("scheduler", vars(args))
    assert parse(["serve", "--no-enable-prefix-caching"]).no_prefix_caching
    assert not parse(["serve", "--no-prefix-caching", "--enable-prefix-caching"]).no_prefix_caching  # the last wins
    assert env_parser("serve", {"PAGEDSERVE_NO_PREFIX_CACHING": "1"}).parse_args(
        ["--enable-prefix-caching"]).no_prefix_caching is False  # the command line wins over the variable
    same = parse(["serve", "m", "--model", "m"])
    positional_model(same)
    assert same.model == "m"
    twice = parse(["serve", "a", "--model", "b"])
    with pytest.raises(ValueError, match="named twice"):
        positional_model(twice)
    with pytest.raises(SystemExit):
        parse(["serve", "--kv-cache-dtype", "fp8"])
    with pytest.raises(ValueError, match="only a switch"):
        Setting("--x", "engine", int, 1, opposites=("--y",))


def test_enable_auto_tool_choice_needs_a_parser_as_in_vllm(caplog):
    from pagedserve.cli import main
    with caplog.at_level("ERROR"):
        assert main(["gateway", "--enable-auto-tool-choice", "--port", "1", "--grpc-port", "2"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in caplog.text


# ---- derived defaults ---------------------------------------------------------------------------
def test_step_budgets_are_computed_in_one_place():
    assert step_budgets(None, None, "cpu") == (512, 64)
    assert step_budgets(None, None, "cuda") == (2048, 512)
    assert step_budgets(None, None, "cuda:1") == (2048, 512)
    assert step_budgets(300, None, "cpu") == (300, 37)
    assert step_budgets(300, None, "cuda") == (300, 75)
    assert step_budgets(300, 0, "cuda") == (300, 0)  # 0: no cap
    assert step_budgets(64, 40, "cpu") == (64, 40)


# ---- the services' own config classes agree with the table -------------------------------------
def test_scheduler_config_defaults_agree_with_the_table():
    from pagedserve.scheduler.server import config_from_args
    from pagedserve.scheduler.service import ServiceConfig
    assert config_from_args(parse(["scheduler"])) == ServiceConfig()
    cfg = config_from_args(parse(["scheduler", "--no-chunked-prefill", "--scheduling-policy", "priority",
                                  "--stall-timeout", "3", "--max-num-batched-tokens", "64"]))
    assert (cfg.enable_chunked_prefill, cfg.policy, cfg.stall_timeout_s, cfg.max_num_batched_tokens) == (
        False, "priority", 3.0, 64)


def test_engine_config_defaults_agree_with_the_table():
    from pagedserve.engine import EngineConfig, engine_config_from_args
    assert engine_config_from_args(parse(["generate"])) == EngineConfig()
    cfg = engine_config_from_args(parse(["chat", "--no-prefix-caching", "--tensor-parallel-size", "2",
                                         "--long-prefill-token-threshold", "8"]), progress=False)
    assert (cfg.enable_prefix_caching, cfg.tensor_parallel_size, cfg.long_prefill_token_threshold, cfg.progress) == (
        False, 2, 8, False)


def test_gateway_limits_defaults_agree_with_the_table():
    from pagedserve.gateway.limits import Limits
    limits, table = Limits(), settings.defaults("gateway")
    assert (limits.max_body_bytes, limits.max_n, limits.max_tokens_in_flight) == (
        table["max_body_bytes"], table["max_n"], table["max_tokens_in_flight"])
    assert (limits.shutdown_timeout_s, limits.resume_grace_s) == (table["shutdown_timeout"], table["resume_grace"])


def test_store_defaults_come_from_the_store():
    from pagedserve.common.store import DEFAULT_PREFIX, DEFAULT_TTL_S
    for service in ("scheduler", "gateway"):
        assert settings.defaults(service)["redis_prefix"] == DEFAULT_PREFIX
        assert settings.defaults(service)["redis_ttl"] == DEFAULT_TTL_S


def test_tls_variables_are_the_settings_variables():
    from pagedserve.common.grpc_util import TLS_ENV
    assert {settings.setting("serve", f"tls_{name}").env for name in TLS_ENV} == set(TLS_ENV.values())

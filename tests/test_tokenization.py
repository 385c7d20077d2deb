"""Chat-template control and the tokenize/detokenize logic as plain classes: model_files.chat_templates
(add_generation_prompt, continue_final_message, chat_template_kwargs, --chat-template),
tokenizer.tokenization (the tokenizer service's /tokenize and /detokenize), the gateway's request
parsing (gateway.tokenization) and a model folder without a tokenizer. The services end to end are
in tests/stack/test_tokenize_stack.py."""

from __future__ import annotations

import json

import grpc
import pytest

from pagedserve.common.grpc_util import StatusError
from pagedserve.gateway.protocol import RequestError
from pagedserve.gateway.tokenization import detokenize_request, tokenize_request
from pagedserve.model_files import chat_templates
from pagedserve.model_files.tokenizer_files import load_tokenizer
from pagedserve.tokenizer import tokenization
from pagedserve.tokenizer.chat_render import template_kwargs
from pagedserve.v1 import generate_pb2

pytestmark = pytest.mark.slow  # the default model's tokenizer

CHAT = [{"role": "user", "content": "What is 2+2?"}]
# A template of our own: reads a kwarg, writes no special tokens, ends with the generation prompt.
TEMPLATE = ("{% for m in messages %}[{{ m.role }}{% if shout %}!{% endif %}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def tok(default_model_path):
    return load_tokenizer(default_model_path)


def test_render_chat_options(tok):
    plain = chat_templates.render_chat(tok, CHAT)
    assert plain.endswith("<|im_start|>assistant\n")
    assert not chat_templates.render_chat(tok, CHAT, add_generation_prompt=False).endswith("assistant\n")
    ref = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert plain == ref
    open_turn = CHAT + [{"role": "assistant", "content": "It is"}]
    text = chat_templates.render_chat(tok, open_turn, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nIt is")
    ids, rendered = chat_templates.chat_token_ids(tok, CHAT)
    assert rendered == plain and ids == tok.encode(plain, add_special_tokens=False)


def test_operator_template_and_kwargs(tok):
    assert chat_templates.render_chat(tok, CHAT, chat_template=TEMPLATE) == "[user] What is 2+2?\n[assistant] "
    shout = chat_templates.render_chat(tok, CHAT, chat_template=TEMPLATE, chat_template_kwargs={"shout": True})
    assert shout.startswith("[user!]")


@pytest.mark.parametrize("messages, options, message", [
    ([], {}, "non-empty list"),
    ([{"content": "x"}], {}, r"messages\[0\] must be an object with a string 'role'"),
    (CHAT, {"continue_final_message": True}, "cannot both be true"),
    (CHAT, {"continue_final_message": True, "add_generation_prompt": False}, "last message to be the assistant's"),
    (CHAT, {"chat_template_kwargs": {"add_generation_prompt": False}}, "may not set add_generation_prompt"),
    (CHAT, {"chat_template_kwargs": [1]}, "must be an object"),
    (CHAT, {"chat_template": "{{ raise_exception('no system role') }}"}, "template failed.*no system role"),
])
def test_bad_chats_name_the_problem(tok, messages, options, message):
    with pytest.raises(chat_templates.ChatTemplateError, match=message):
        chat_templates.render_chat(tok, messages, **options)


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert chat_templates.load_chat_template(str(path)) == TEMPLATE
    assert chat_templates.load_chat_template(TEMPLATE) == TEMPLATE  # inline, as vLLM accepts
    assert chat_templates.load_chat_template(None) is None
    with pytest.raises(ValueError, match="no-such.jinja: no such file"):
        chat_templates.load_chat_template(str(tmp_path / "no-such.jinja"))


def chat_pb(messages, **options) -> generate_pb2.ChatMessages:
    chat = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**m) for m in messages], **options)
    return chat


def test_tokenize_prompt_and_chat(tok):
    def render(chat):
        return chat_templates.render_chat(tok, [{"role": m.role, "content": m.content} for m in chat.messages],
                                          add_generation_prompt=chat.add_generation_prompt,
                                          chat_template_kwargs=template_kwargs(chat))
    r = tokenization.tokenize(tok, generate_pb2.TokenizeRequest(prompt="Hello world", return_token_strs=True), render)
    assert list(r.token_ids) == tok.encode("Hello world") and list(r.token_strs) == ["Hello", "Ġworld"]
    r = tokenization.tokenize(tok, generate_pb2.TokenizeRequest(chat=chat_pb(CHAT, add_generation_prompt=True)),
                              render)
    assert r.text.endswith("<|im_start|>assistant\n") and list(r.token_ids) == tok.encode(r.text)
    assert not r.token_strs
    # add_special_tokens: the tokenizer's own (a BOS for tokenizers that add one) on top of the text.
    with_special = tokenization.tokenize(tok, generate_pb2.TokenizeRequest(prompt="Hi", add_special_tokens=True),
                                         render)
    assert list(with_special.token_ids) == tok.encode("Hi", add_special_tokens=True)
    with pytest.raises(StatusError, match="chat_template_kwargs is not JSON"):
        tokenization.tokenize(tok, generate_pb2.TokenizeRequest(chat=chat_pb(CHAT, chat_template_kwargs="{x")), render)


def test_detokenize_checks_the_vocabulary(tok):
    ids = tok.encode("Hello <|im_end|>")
    r = tokenization.detokenize(tok, generate_pb2.DetokenizeRequest(token_ids=ids), len(tok))
    assert r.text == "Hello <|im_end|>"
    with pytest.raises(StatusError) as err:
        tokenization.detokenize(tok, generate_pb2.DetokenizeRequest(token_ids=[5, len(tok)]), len(tok))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and f"tokens[1] = {len(tok)}" in err.value.details


def test_gateway_parses_vllm_shapes():
    model, req = tokenize_request({"prompt": "hi", "model": "m", "return_token_strs": True})
    assert (model, req.prompt, req.add_special_tokens, req.return_token_strs) == ("m", "hi", True, True)
    _, req = tokenize_request({"messages": CHAT, "add_generation_prompt": False, "continue_final_message": False,
                               "chat_template_kwargs": {"enable_thinking": False}})
    assert req.WhichOneof("input") == "chat" and not req.add_special_tokens
    assert req.chat.messages[0].content == CHAT[0]["content"] and not req.chat.add_generation_prompt
    assert json.loads(req.chat.chat_template_kwargs) == {"enable_thinking": False}
    _, dreq = detokenize_request({"tokens": [1, 2, 3]})
    assert list(dreq.token_ids) == [1, 2, 3] and not dreq.skip_special_tokens
    for body, message in [({}, "exactly one of 'prompt'"), ({"prompt": "a", "messages": CHAT}, "exactly one"),
                          ({"prompt": 3}, "prompt: Input should be a valid string"),
                          ({"messages": CHAT, "continue_final_message": True}, "cannot both be true"),
                          ({"messages": CHAT, "chat_template": "{{x}}"}, "chat_template per request"),
                          ({"messages": [{"role": "wizard", "content": "x"}]}, r"messages\[0\].role must be one of")]:
        with pytest.raises(RequestError, match=message) as err:
            tokenize_request(body)
        assert err.value.status == 400
    with pytest.raises(RequestError, match=r"tokens\[1\] = -1"):
        detokenize_request({"tokens": [1, -1]})


def test_a_folder_without_tokenizer_names_itself(tmp_path, default_model_path):
    from pagedserve.tokenizer.service import load_tokenizer as service_load
    (tmp_path / "config.json").write_text((default_model_path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=f"no tokenizer in {tmp_path}.*--tokenizer"):
        service_load(str(tmp_path))
    tokenizer, name, _, folder = service_load(str(tmp_path), str(default_model_path))  # --tokenizer
    assert folder == tmp_path  # where the generation config is read (the model's, not the tokenizer's)
    assert name == tmp_path.name and tokenizer.encode("Hello world") == load_tokenizer(default_model_path).encode(
        "Hello world")


def test_the_tokenizer_service_refuses_such_a_folder_by_name(tmp_path, default_model_path):
    import subprocess
    import sys

    from pagedserve.common.grpc_util import free_port
    (tmp_path / "config.json").write_text((default_model_path / "config.json").read_text())
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", "tokenizer", "--model", str(tmp_path),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"no tokenizer in {tmp_path}" in proc.stderr and "--tokenizer" in proc.stderr
    assert "sentencepiece" not in proc.stderr


def test_chat_completions_carry_the_template_options():
    from pagedserve.gateway.protocol import ChatCompletionRequest, chat_to_generate
    partial = CHAT + [{"role": "assistant", "content": "It is"}]
    gen = chat_to_generate(ChatCompletionRequest(messages=partial, add_generation_prompt=False,
                                                 continue_final_message=True,
                                                 chat_template_kwargs={"enable_thinking": False}))
    assert gen.chat.continue_final_message and not gen.chat.add_generation_prompt
    assert json.loads(gen.chat.chat_template_kwargs) == {"enable_thinking": False}
    assert not chat_to_generate(ChatCompletionRequest(messages=CHAT)).chat.chat_template_kwargs  # default bytes
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template": "{{ x }}"}, "chat_template")):
        with pytest.raises(RequestError) as err:
            chat_to_generate(ChatCompletionRequest(messages=partial, **extra))
        assert (err.value.status, err.value.param) == (400, param)


def test_detokenize_is_bounded_by_the_context():
    """Issue 42 row 7: more ids than the context are refused before any decoding."""
    _, req = detokenize_request({"tokens": [28] * 1024}, max_ids=1024)
    assert len(req.token_ids) == 1024
    with pytest.raises(RequestError) as refused:
        detokenize_request({"tokens": [28] * 1025}, max_ids=1024)
    assert refused.value.status == 400 and refused.value.param == "tokens" and "1024" in refused.value.message

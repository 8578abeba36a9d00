"""Chat templates other than the model's own: `lantau serve --chat-template FILE` (every
conversation rendered through it) and a request's `chat_template`, which runs only with
`--trust-request-chat-template` (vLLM's flags); each prompt equal to HF transformers'
apply_chat_template with the same template on the same tokenizer; bad ones refused."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from lantau.errors import InvalidRequestError
from lantau.model.source import load_tokenizer, resolve_model_source
from lantau.server.openai_api import parse_request
from lantau.server.schemas import RequestLimits
from tests.servers import lantau_serve

MODEL = "random:tiny"  # the default model's tokenizer, with its own chat template
SERVER_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
REQUEST_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where is my parcel?"},
]


def hf_ids(template: str | None, generation: bool = True) -> list[int]:
    """The prompt HF transformers renders with `template` (None: the tokenizer's own)."""
    tokenizer = load_tokenizer(resolve_model_source(MODEL))
    text = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=generation, chat_template=template
    )
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(SERVER_TEMPLATE)
    flags = ("--chat-template", str(template), "--trust-request-chat-template")
    with lantau_serve(MODEL, *flags) as (base, _):
        yield base


def tokenize(base: str, **extra) -> httpx.Response:
    return httpx.post(f"{base}/tokenize", json={"messages": MESSAGES, **extra}, timeout=30)


def test_server_template_replaces_the_models(served):
    """/tokenize and the chat route render through --chat-template: the prompt HF renders
    with it, not with the model's own."""
    ids = tokenize(served).json()["tokens"]
    assert ids == hf_ids(SERVER_TEMPLATE) != hf_ids(None)
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="x")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert r.usage.prompt_tokens == len(ids)


def test_request_template_when_trusted(served):
    """A request's own template (trusted here) renders its conversation, on /tokenize and on
    the chat route; a broken one is a 400 naming the messages, and the server stays up."""
    ids = tokenize(served, chat_template=REQUEST_TEMPLATE, add_generation_prompt=False)
    assert ids.json()["tokens"] == hf_ids(REQUEST_TEMPLATE, generation=False)
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="x")
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2,
        extra_body={"chat_template": REQUEST_TEMPLATE},
    )  # fmt: skip
    assert r.usage.prompt_tokens == len(hf_ids(REQUEST_TEMPLATE))
    bad = tokenize(served, chat_template="{% for m in messages %}")
    assert bad.status_code == 400 and "chat template" in bad.json()["error"]["message"]
    assert tokenize(served).status_code == 200


def test_request_template_refused_unless_trusted():
    """Without --trust-request-chat-template a client's Jinja never runs: a 400 naming
    chat_template (the RequestLimits every server route checks with)."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template": "x"}'
    with pytest.raises(InvalidRequestError, match="chat_template: this server does not take"):
        parse_request(body, chat=True, limits=RequestLimits())
    trusted = RequestLimits(trust_request_chat_template=True)
    assert parse_request(body, chat=True, limits=trusted).chat_template == "x"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("no/such/file.jinja", "is neither a file nor a Jinja template"),
        ("{% for m in messages %}{{ m }}", "--chat-template: line 1: Unexpected end of template"),
    ],
)
def test_bad_server_templates_stop_the_start(value, message):
    result = subprocess.run(
        [sys.executable, "-m", "lantau.cli", "serve", MODEL, "--chat-template", value],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_offline_chat_takes_a_template():
    from lantau import LLM, SamplingParams

    llm = LLM(MODEL, device="cpu", num_kv_blocks=64, max_model_len=256)
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=1), chat_template=SERVER_TEMPLATE)
    assert out[0].prompt_token_ids == hf_ids(SERVER_TEMPLATE)

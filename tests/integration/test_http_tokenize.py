"""The served tokenizer, outside the server: `pdserve export-tokenizer DIR` writes it as a Hugging
Face directory that transformers loads and that encodes tricky strings exactly as the server's
/tokenize does (for the bundled SmolLM2 GGUF, whose tokenizer transformers would otherwise rebuild
differently); vLLM's /tokenize and /detokenize; served-name aliases; GET /version and ModelInfo's
version. A real `pdserve serve --no-ray` stack (gRPC + HTTP) on the GGUF."""
from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request

import pytest

from cluster.cli import main
from cluster.cli.client import GenerationClient
from cluster.config import ServeConfig
from cluster.server_stack import start_stack
from cluster.version import version
from grpc_harness import LoopThread

pytestmark = pytest.mark.smollm2
transformers = pytest.importorskip("transformers", reason="transformers is a test extra")

TRICKY = [".\n 1", "a 123 4567", "x\n\n  42", "3.14159 and 2,718", "tab\t9 ", "  leading spaces",
          "héllo wörld 🙂 日本語 ½", "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>after", "end.<|im_end|>",
          "trailing\n"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    loop = LoopThread()
    cfg = ServeConfig(ray=False, grpc_port=free_port(), http_port=free_port(), metrics_port=0, max_model_len=1024,
                      num_kv_blocks=128, served_model_name=("smol", "smol-alias"))
    stack = loop.run(start_stack(cfg), timeout=300)
    yield stack
    loop.run(stack.drain_and_stop(1.0))
    loop.close()


def call(stack, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(stack.http.url + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "smol-tokenizer"
    assert main(["export-tokenizer", str(out)]) == 0
    return transformers.AutoTokenizer.from_pretrained(str(out))


def test_exported_tokenizer_encodes_as_the_server_does(server, exported):
    for text in TRICKY:
        for special in (True, False):
            status, body = call(server, "POST", "/tokenize", {"prompt": text, "add_special_tokens": special})
            assert status == 200, body
            assert exported.encode(text, add_special_tokens=special) == body["tokens"], text
            assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
            assert exported.decode(body["tokens"]) == call(server, "POST", "/detokenize",
                                                           {"tokens": body["tokens"]})[1]["prompt"]
    assert call(server, "POST", "/tokenize", {"prompt": ".\n 1"})[1]["tokens"] == [30, 3805, 33]


def test_exported_chat_template_renders_as_the_server_does(server, exported):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 =\n 4?"}]
    status, body = call(server, "POST", "/tokenize", {"messages": messages})
    assert status == 200, body
    text = exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert exported.encode(text, add_special_tokens=False) == body["tokens"]


def test_tokenize_and_detokenize_refuse_bad_input(server):
    vocab = server.backend.model_info().vocab_size
    status, body = call(server, "POST", "/detokenize", {"tokens": [1, vocab]})
    assert status == 400 and body["error"]["param"] == "tokens[1]"
    status, body = call(server, "POST", "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert status == 400
    status, body = call(server, "POST", "/tokenize", {"prompt": "a", "model": "nope"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_served_names_first_listed_aliases_accepted_others_404(server):
    status, body = call(server, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["smol"]
    for name in ("smol", "smol-alias"):
        status, body = call(server, "POST", "/v1/completions", {"model": name, "prompt": "Hi", "max_tokens": 2})
        assert status == 200 and body["model"] == "smol", body
    status, body = call(server, "POST", "/v1/chat/completions",
                        {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert call(server, "GET", "/v1/models/smol-alias")[0] == 200
    assert call(server, "GET", "/v1/models/other")[0] == 404


def test_version_over_http_and_grpc(server):
    assert call(server, "GET", "/version") == (200, {"version": version()})

    async def info():
        async with GenerationClient(server.grpc.target) as c:
            return await c.model_info()
    mi = asyncio.run(info())
    assert mi.version == version() and mi.model_name == "smol"
    assert mi.tokenizer_vocab_size == mi.vocab_size == 49152

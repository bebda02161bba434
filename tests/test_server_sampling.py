"""The requests real clients send: sampled requests (with speculation), logprobs in OpenAI's
formats, streamed and not, and the fields Phoenix does not serve refused by name."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from pipeline.server import create_app
from tests.conftest import wait_http
from tests.servers import ServerThread, tiny_core

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


@pytest.fixture(scope="module")
def server(tiny_models):
    with ServerThread(create_app(lambda: tiny_core(tiny_models), queue_size=8)) as s:
        wait_http(s.url + "/health")
        yield s


def chat(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "Add two numbers."}],
            "max_tokens": 12, **kw}  # fmt: skip


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.2}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": "yes please"}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"n": 2}, "n"),
    ],
)
def test_unserved_or_out_of_range_fields_get_a_400_naming_them(server, extra, param):
    r = post(server, CHAT, chat(**extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logprobs": 21}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "}"}, "suffix"),
    ],  # fmt: skip
)
def test_completions_refuse_by_name_too(server, body, param):
    r = post(server, TEXT, {"model": "tiny", "prompt": "def f(", "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_fields_that_change_nothing_are_accepted(server):
    neutral = dict(user="u1", metadata={"a": "b"}, store=False, presence_penalty=0,
                   frequency_penalty=0.0, tools=[], tool_choice="none", n=1, top_k=0,
                   response_format={"type": "text"}, logit_bias={}, parallel_tool_calls=True)  # fmt: skip
    assert post(server, CHAT, chat(**neutral)).status_code == 200


def test_openai_client_with_common_sdk_defaults(server):
    """temperature 1, top_p 1, logprobs on: a sampled answer with the target's logprobs, one
    entry per completion token, each with its top 2 (tokens as ids: exact)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for mode in ("target", "fixed:2", "ngram:4", "bandit"):
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Sort a list."}], max_tokens=10,
            temperature=1, top_p=1, logprobs=True, top_logprobs=2, seed=5,
            extra_body={"phoenix": {"mode": mode, "token_ids": True},
                        "return_tokens_as_token_ids": True},
        )  # fmt: skip
        content = r.choices[0].logprobs.content
        ids = r.model_extra["phoenix"]["token_ids"]
        assert [c.token for c in content] == [f"token_id:{i}" for i in ids]
        assert len(content) == r.usage.completion_tokens > 0
        for c in content:
            assert c.logprob <= 0 and len(c.top_logprobs) == 2
            assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
            assert c.logprob <= c.top_logprobs[0].logprob + 1e-6


def test_a_seed_reproduces_a_sampled_answer_streamed_or_not(server):
    body = chat(temperature=0.9, seed=11, logprobs=True, top_logprobs=1, max_tokens=16,
                phoenix={"mode": "fixed:2"})  # fmt: skip
    a = post(server, CHAT, body).json()
    b = post(server, CHAT, body).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["choices"][0]["logprobs"] == b["choices"][0]["logprobs"]
    with requests.post(server.url + CHAT, json={**body, "stream": True}, stream=True,
                       timeout=60) as r:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]  # fmt: skip
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    streamed = [
        e for c in chunks for e in (c["choices"][0].get("logprobs") or {}).get("content", [])
    ]
    assert text == a["choices"][0]["message"]["content"]
    assert streamed == a["choices"][0]["logprobs"]["content"]
    others = {post(server, CHAT, {**body, "seed": s}).json()["choices"][0]["message"]["content"]
              for s in range(4)}  # fmt: skip
    assert len(others) > 1


def test_completions_logprobs_in_the_legacy_format(server):
    r = post(server, TEXT, {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 8,
                            "logprobs": 3, "temperature": 0,
                            "return_tokens_as_token_ids": True})  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = r.json()["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert all(len(t) == 3 for t in lp["top_logprobs"])  # as ids: no two texts collide
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # greedy: each chosen token is the most likely one
    assert all(abs(v - max(t.values())) < 1e-5 for v, t in zip(lp["token_logprobs"],
                                                              lp["top_logprobs"], strict=True))  # fmt: skip

"""kvpool serve: OpenAI-compatible HTTP in real processes, hit with the openai client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from hf_models import start_daemon  # noqa: E402
from servers import Server, wait_for  # noqa: E402

import kvpool  # noqa: E402
from kvpool.serve.demo_model import build_demo_model  # noqa: E402

pytestmark = pytest.mark.timeout(180)

SYSTEM = ("the quick brown fox jumps over the lazy dog a pool of blocks holds the keys and values of every "
          "sequence two servers share one prefix through the daemon")


@pytest.fixture(scope="module")
def daemon(request):
    return start_daemon(request)


@pytest.fixture(scope="module")
def servers(request, daemon, tmp_path_factory):
    model_dir = build_demo_model(str(tmp_path_factory.mktemp("tiny-llama")))
    pair = [Server(model_dir, daemon.socket), Server(model_dir, daemon.socket)]
    for s in pair:
        request.addfinalizer(s.stop)
    return [s.wait_ready() for s in pair]


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers[0].url + "/v1", api_key="none", max_retries=0)


def daemon_stats(daemon):
    with kvpool.Connection(daemon.socket) as conn:
        return conn.stats()


def test_models_and_health(servers, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(servers[0].url + "/health").json() == {"status": "ok"}


def test_completion_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", prompt="hello world this is", max_tokens=8, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert 1 <= full.usage.completion_tokens <= 8 and full.usage.prompt_tokens == 4  # one token a word, no <s> added
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", messages=[{"role": "system", "content": "the lazy dog"},
                                      {"role": "user", "content": "hello world"}], max_tokens=6, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_concurrent_requests_get_their_own_greedy_answers(client):
    prompts = [" ".join(SYSTEM.split()[i:i + 3 + i]) for i in range(6)]
    ask = lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0,  # noqa: E731
                                              extra_body={"ignore_eos": True}).choices[0].text
    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="tiny", prompt="the quick brown fox", max_tokens=10, temperature=1.0, top_p=0.9, seed=3,
              extra_body={"top_k": 40, "ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


@pytest.mark.parametrize("kw, status", [
    (dict(model="nope", prompt="hello"), 404),
    (dict(model="tiny", prompt="hello", temperature=5), 400),
    (dict(model="tiny", prompt="hello", n=2), 400),
    (dict(model="tiny", prompt="hello", max_tokens=0), 400),
    (dict(model="tiny", prompt=""), 400),
    (dict(model="tiny", prompt=[1, 2, 99999]), 400),
    (dict(model="tiny", prompt="hello " * 600), 400),
])
def test_bad_completions_are_4xx_with_a_message(client, kw, status):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**kw)
    assert info.value.status_code == status
    assert info.value.body["message"]


def test_bad_bodies_have_the_openai_error_shape(servers):
    url = servers[0].url
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(servers, daemon):
    server = servers[0]
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                assert daemon_stats(daemon).sequences == 1
                break
    wait_for(lambda: daemon_stats(daemon).sequences == 0)
    wait_for(lambda: server.metric('kvpool_serve_requests_finished_total{finish_reason="abort"}') >= 1)


def test_two_servers_share_a_prompt_prefix_through_the_daemon(servers, daemon):
    first, second = (openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0) for s in servers)
    before = servers[1].metric("kvpool_serve_prefix_hit_tokens_total")
    a = first.completions.create(model="tiny", prompt=SYSTEM + " hello", max_tokens=2, temperature=0)
    b = second.completions.create(model="tiny", prompt=SYSTEM + " world", max_tokens=2, temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == 30  # 29 shared words, one not
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached == 24  # three full blocks of 8
    assert servers[1].metric("kvpool_serve_prefix_hit_tokens_total") - before == 24
    assert sum(c.prefix_hit_tokens for c in daemon_stats(daemon).classes) >= 24

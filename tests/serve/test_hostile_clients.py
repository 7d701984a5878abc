"""kvpool serve against clients that send too much, too deep, too many, or hang up: a real server process
hit over real sockets."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi")

from hf_models import start_daemon  # noqa: E402
from servers import Server, read_raw, send_raw, wait_for  # noqa: E402

from kvpool.serve.demo_model import build_demo_model  # noqa: E402
from kvpool.serve.limits import DEFAULT_MAX_BODY_BYTES  # noqa: E402

pytestmark = pytest.mark.timeout(240)

MAX_WAITING = 2
#: a request that runs for hundreds of steps unless it is aborted (the demo model's length is 512)
LONG = {"model": "tiny", "prompt": "hello world", "max_tokens": 500, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    daemon = start_daemon(request)
    model_dir = build_demo_model(str(tmp_path_factory.mktemp("tiny-llama")))
    s = Server(model_dir, daemon.socket, "--max-num-seqs", "1", "--max-waiting-requests", str(MAX_WAITING))
    request.addfinalizer(s.stop)
    return s.wait_ready()


def finished(server, reason: str) -> float:
    return server.metric(f'kvpool_serve_requests_finished_total{{finish_reason="{reason}"}}', default=0)


def idle(server) -> bool:
    return server.metric("kvpool_serve_requests_running") == server.metric("kvpool_serve_requests_waiting") == 0


def assert_openai_error(response: httpx.Response | tuple, status: int) -> dict:
    """The response has ``status`` and OpenAI's error body (never FastAPI's ``{"detail": ...}``)."""
    got, body = (response.status_code, response.content) if isinstance(response, httpx.Response) else response
    assert got == status, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_a_body_declared_over_the_limit_is_refused_before_it_is_sent(server):
    sock = send_raw(server.url, "/v1/completions", content_length=str(100 * DEFAULT_MAX_BODY_BYTES))
    status, _, body = read_raw(sock)  # nothing of the body was sent: the answer cannot wait for it
    error = assert_openai_error((status, body), 413)
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"


def test_a_chunked_body_is_cut_off_at_the_limit(server):
    chunk = b" " * 65536
    chunks = (chunk for _ in range(DEFAULT_MAX_BODY_BYTES // len(chunk) + 2))  # no Content-Length: chunked
    r = httpx.post(server.url + "/v1/completions", content=chunks, headers={"content-type": "application/json"},
                   timeout=60)
    assert_openai_error(r, 413)
    assert httpx.get(server.url + "/health").status_code == 200


def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    # just under the body limit: ~1.5e5 words, seconds of tokenizing, and 300x the model's length
    prompt = "hello world " * ((DEFAULT_MAX_BODY_BYTES - 100) // 12)
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt},
                          timeout=120)
        # the queue gauge counts requests being tokenized: answered by the event loop while this one is
        wait_for(lambda: big.done() or server.metric("kvpool_serve_requests_waiting") == 1, timeout=60)
        assert not big.done(), big.result().text
        assert httpx.get(server.url + "/health", timeout=60).json() == {"status": "ok"}
        assert not big.done()
        error = assert_openai_error(big.result(), 400)
    assert "tokens" in error["message"] and "at most 511" in error["message"]


def test_a_non_streaming_request_whose_client_hangs_up_is_aborted(server):
    wait_for(lambda: idle(server), timeout=120)
    aborted, completed = finished(server, "abort"), finished(server, "length")
    sock = send_raw(server.url, "/v1/completions", json.dumps(LONG).encode())
    wait_for(lambda: server.metric("kvpool_serve_requests_running") == 1, timeout=60)
    sock.close()
    wait_for(lambda: idle(server), timeout=120)
    assert finished(server, "abort") == aborted + 1
    assert finished(server, "length") == completed


def test_requests_past_the_queue_limit_get_429_with_retry_after(server):
    wait_for(lambda: idle(server), timeout=120)
    send = lambda: send_raw(server.url, "/v1/completions", json.dumps(LONG).encode())  # noqa: E731
    socks = [send()]
    try:
        wait_for(lambda: server.metric("kvpool_serve_requests_running") == 1, timeout=60)
        socks += [send() for _ in range(MAX_WAITING)]  # they wait for the one running (--max-num-seqs 1)
        wait_for(lambda: server.metric("kvpool_serve_requests_waiting") == MAX_WAITING, timeout=60)
        for path, body in (("/v1/completions", {"model": "tiny", "prompt": "hello"}),
                           ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                     "stream": True})):
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert assert_openai_error(r, 429)["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: idle(server), timeout=120)  # the dropped requests are aborted and the queue empties
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200


DEEP = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("path, body, status", [
    pytest.param("/v1/completions", b"{not json", 400, id="invalid-json"),
    pytest.param("/v1/completions", b"", 400, id="empty"),
    pytest.param("/v1/completions", b'{"model": "tiny", "prompt": "caf\xe9"}', 400, id="latin-1-not-utf-8"),
    pytest.param("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}', 400, id="lone-surrogate"),
    pytest.param("/v1/completions", DEEP, 400, id="deep-nesting"),
    pytest.param("/v1/completions", b"[1, 2]", 400, id="not-an-object"),
    pytest.param("/v1/completions", b'{"model": 3, "prompt": "hello"}', 400, id="wrong-type"),
    pytest.param("/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": "many"}', 400, id="not-a-number"),
    pytest.param("/v1/completions", b'{"prompt": "hello"}', 400, id="missing-model"),
    pytest.param("/v1/completions", b'{"model": "nope", "prompt": "hello"}', 404, id="unknown-model"),
    pytest.param("/v1/chat/completions", b'{"model": "tiny"}', 400, id="missing-messages"),
    pytest.param("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": '
                 b'[{"type": "text", "text": {"a": 1}}]}]}', 400, id="text-part-not-a-string"),
    pytest.param("/v1/nowhere", b"{}", 404, id="unknown-path"),
    pytest.param("/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop": [' + b",".join([b'"x"'] * 17) + b"]}",
                 400, id="too-many-stop-strings"),
    pytest.param("/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop": "' + b"y" * 257 + b'"}', 400,
                 id="stop-string-too-long"),
    pytest.param("/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop_token_ids": [' +
                 b",".join([b"1"] * 65) + b"]}", 400, id="too-many-stop-ids"),
])
def test_bad_bodies_get_openai_errors(server, path, body, status):
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert "detail" not in r.json()
    assert_openai_error(r, status)


def test_a_wrong_method_gets_an_openai_error(server):
    assert_openai_error(httpx.get(server.url + "/v1/completions"), 405)

"""`vegas serve` on loopback with the real SmolLM2 model, driven by the official `openai`
client (and raw HTTP where the bytes matter): completions and chat, streamed and not, equal
to offline `generate`; concurrent requests of every kind; disconnects; every bad input's
status and OpenAI-style body; the queue bound; the API key; every page free afterwards."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import itertools
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from conftest import kv_bytes

from vegas_spec.config import SamplingParams
from vegas_spec.engine import LLM, LLMEngine
from vegas_spec.serve.app import HEADER_TIMEOUT_S, Server, build_app, http_protocol
from vegas_spec.tokenizer import encode_chat

pytestmark = pytest.mark.slow

# A round every iteration: seeded sampled answers are compared with the offline ones, and
# where adaptive speculation runs plain steps instead depends on timings.
SPEC = {"method": "vegas", "gamma": 4, "min_tokens": 16, "adaptive": False}
MODEL = "smollm2"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village by the sea,", "List three colours:",
           "The three laws of thermodynamics are", "import numpy as np\n",
           "Dear Sir or Madam,", "In 1492, Columbus"]


class Running:
    """A server on a free loopback port, in a thread."""

    def __init__(self, engine: LLMEngine, max_queue: int = 64,
                 api_key: str | None = None, header_timeout: float = HEADER_TIMEOUT_S,
                 **limits: Any) -> None:
        self.engine = engine
        self.api = Server(engine, MODEL, max_queue, api_key, **limits)
        self.app = build_app(self.api)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port,
                                                    log_level="warning",
                                                    http=http_protocol(header_timeout)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0,
                             timeout=300)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


# The longest request these tests make to completion or hold open: a short prompt (a chat
# template's ~40 tokens at most) with 400 new tokens and a round of γ 4. Every engine of the
# file shares one copy of the model's weights (`vegas_spec.models.shared`).
ROW = 40 + 400 + 8
# The streams of 4,000 tokens that hold an engine's only row while others queue: room for
# all of them, though they are closed long before (pages are taken as a stream decodes).
LONG_ROW = 40 + 4000 + 8


def engine(**kw: Any) -> LLMEngine:
    """A served engine whose KV pool holds its every row at ROW positions at once."""
    rows = kw.get("max_num_seqs", 8)
    return LLMEngine(None, speculative=SPEC, **{"kv_cache_bytes": kv_bytes([ROW] * rows), **kw})


@pytest.fixture(scope="module")
def served() -> Iterator[Running]:
    running = Running(engine(max_num_seqs=8))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def offline() -> LLM:
    # as much as the served engine: a larger batch queues for pages, with the same outputs
    return LLM(None, speculative=SPEC, kv_cache_bytes=kv_bytes([ROW] * 8))


def offline_texts(llm: LLM, prompts: list[str], params: list[dict[str, Any]],
                  chat: bool = False) -> list[tuple[str, str]]:
    """(text, finish reason) of every (prompt, params) pair, from one `generate` call (a
    request's output does not depend on what shares its batch: greedy rows, and seeded
    sampled ones)."""
    outs = llm.generate(prompts, [SamplingParams(**p) for p in params], chat=chat)
    return [(out.text, out.finish_reason) for out in outs]


def offline_text(llm: LLM, prompt: str, chat: bool = False, **params: Any) -> tuple[str, str]:
    return offline_texts(llm, [prompt], [params], chat)[0]


@contextlib.contextmanager
def streaming(running: Running, prompt: str, max_tokens: int) -> Iterator[Iterator[str]]:
    """A greedy stream of max_tokens (end of sequence ignored), open from its first chunk:
    its remaining lines."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{running.url}/v1/completions", json=body,
                      timeout=300) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        yield lines


def free_pages(running: Running) -> int:
    return len(running.engine.runner.cache.free_pages)


def settle(running: Running) -> None:
    """Wait until the engine holds no request."""
    for _ in range(600):
        if not running.engine.seqs:
            return
        time.sleep(0.05)
    raise AssertionError(f"requests still held: {list(running.engine.seqs)}")


# --- the happy paths ----------------------------------------------------------------------

def test_models_health_metrics(served: Running) -> None:
    assert [m.id for m in served.client().models.list().data] == [MODEL]
    assert httpx.get(f"{served.url}/health", timeout=300).json() == {"status": "ok"}
    metrics = httpx.get(f"{served.url}/metrics", timeout=300).text
    for name in ("vegas_requests_total", "vegas_generation_tokens_total",
                 "vegas_tokens_per_iteration_bucket", "vegas_accepted_tokens_total",
                 "vegas_num_requests_waiting", "vegas_num_requests_running",
                 "vegas_step_seconds_bucket"):
        assert name in metrics


def test_greedy_completion_equals_generate(served: Running, offline: LLM) -> None:
    client = served.client()
    wanted = offline_texts(offline, PROMPTS[:3], [{"max_tokens": 8}] * 3)
    for prompt, (want, reason) in zip(PROMPTS[:3], wanted, strict=True):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                        temperature=0)
        assert got.choices[0].text == want and got.choices[0].finish_reason == reason
        assert got.usage.completion_tokens <= 8
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                           temperature=0, stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == reason


def test_greedy_chat_equals_generate(served: Running, offline: LLM) -> None:
    client = served.client()
    question = "What is the capital of France?"
    want, reason = offline_text(offline, question, chat=True, max_tokens=40)
    messages = [{"role": "user", "content": question}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                         temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].finish_reason == reason
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == reason


def test_a_stream_that_asks_for_usage_ends_with_it(served: Running) -> None:
    """stream_options.include_usage: one more chunk, no choices, the whole request's usage
    (what a load generator counts tokens by)."""
    client = served.client()
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=7, temperature=0, stream=True,
                              stream_options={"include_usage": True},
                              extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(prompt=PROMPTS[0], **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-2].choices[0].finish_reason == "length"
    chat = list(client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], **kw))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 7
    assert chat[-1].usage.prompt_tokens > 0
    plain = httpx.post(f"{served.url}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}})
    assert plain.status_code == 400
    assert plain.json()["error"]["param"] == "stream_options"


def test_concurrent_requests_complete_and_match_offline(served: Running, offline: LLM) -> None:
    """Ten requests at once, of different lengths and settings (greedy and seeded sampling,
    stop strings, streamed and not): each gives its offline text."""
    jobs = [dict(prompt=p, max_tokens=4 + 2 * i, temperature=0.0 if i % 3 else 0.8,
                 seed=i, top_p=0.9 if i % 3 == 0 else 1.0, stream=i % 2 == 0,
                 stop=[", "] if i % 4 == 1 else None)
            for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    client = served.client()

    def run(job: dict) -> str:
        if job["stream"]:
            return "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, **job))
        return client.completions.create(model=MODEL, **job).choices[0].text

    before = free_pages(served)
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(run, jobs))
    params = [{"stop": tuple(job["stop"] or ()),
               **{k: job[k] for k in ("max_tokens", "temperature", "seed", "top_p")}}
              for job in jobs]
    wanted = offline_texts(offline, [job["prompt"] for job in jobs], params)
    for job, text, (want, _) in zip(jobs, texts, wanted, strict=True):
        assert text == want, job
    settle(served)
    assert free_pages(served) == before


def test_a_disconnect_mid_stream_aborts_only_that_request(served: Running,
                                                          offline: LLM) -> None:
    before = free_pages(served)
    want, _ = offline_text(offline, PROMPTS[2], max_tokens=24)
    with cf.ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: served.client().completions.create(
            model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0).choices[0].text)
        with streaming(served, PROMPTS[0], 400):
            pass  # closed after its first chunk
        assert other.result() == want
    settle(served)
    assert free_pages(served) == before


# --- bad input ------------------------------------------------------------------------------

BAD: list[tuple[str, Any, int, str | None]] = [
    ("malformed json", b"{not json", 400, None),
    ("unknown model", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("prompt past the context", {"model": MODEL, "prompt": [5] * 9000}, 400, "prompt"),
    ("negative temperature", {"model": MODEL, "prompt": "x", "temperature": -1}, 400,
     "temperature"),
    ("zero max_tokens", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("bad top_p", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("n > 1", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
    ("logprobs", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("token id out of range", {"model": MODEL, "prompt": [10**7]}, 400, "prompt"),
    # the API's options this server does not implement, refused by name (true is not 1)
    ("echo", {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
    ("tools", {"model": MODEL, "prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
    ("best_of true", {"model": MODEL, "prompt": "x", "best_of": True}, 400, "best_of"),
    ("json mode", {"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}},
     400, "response_format"),
    ("n = 0", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    # strict types: no string for a number, no bool for an int or a token id
    ("max_tokens string", {"model": MODEL, "prompt": "x", "max_tokens": "10"}, 400,
     "max_tokens"),
    ("max_tokens bool", {"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("temperature string", {"model": MODEL, "prompt": "x", "temperature": "0.5"}, 400,
     "temperature"),
    ("temperature NaN", b'{"model": "smollm2", "prompt": "x", "temperature": NaN}', 400,
     "temperature"),
    ("stream yes", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("bool token ids", {"model": MODEL, "prompt": [True, False]}, 400, "prompt"),
    # JSON's \\ud800 escape decodes to a lone surrogate: no Unicode text, no tokenizer takes it
    ("lone surrogate", b'{"model": "smollm2", "prompt": "abc\\ud800", "max_tokens": 4}', 400,
     "prompt"),
]


@pytest.mark.parametrize("name, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_status_and_an_openai_error(served: Running, name: str, body: Any,
                                                       status: int, param: str | None) -> None:
    url = f"{served.url}/v1/completions"
    response = httpx.post(url, content=body, headers={"content-type": "application/json"},
                          timeout=300) if isinstance(body, bytes) else \
        httpx.post(url, json=body, timeout=300)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param
    ok = served.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")  # everyone else is still served


def _bad_inputs() -> list[tuple[str, str, Any]]:
    """(name, path, body) of every bad request below: each field of both endpoints given
    each wrong type or value, bodies that are not a JSON object, and broken chat messages."""
    comp, chat = "/v1/completions", "/v1/chat/completions"
    base = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    msgs = [{"role": "user", "content": "x"}]
    wrong: dict[str, list[Any]] = {
        "model": [None, 1, [], {}, True, "gpt-4", ""],
        "max_tokens": [0, -1, 1.5, "10", True, [], {}, 10**30],
        "temperature": [-1, 2.5, "0.5", True, [], {}, 10**400],
        "top_p": [0, -0.5, 1.5, "x", True, []],
        "top_k": [-2, 1.5, "x", True, []],
        "n": [0, 2, 1.5, "1", True],
        "stream": ["yes", 1, [], {}],
        "stream_options": [{"include_usage": "yes"}, "x", 1],
        "stop": [1, [1], [None], {"a": 1}, True],
        "seed": [1.5, "x", True, [], 2**70],
        "ignore_eos": ["yes", 1, []],
        "logprobs": [2, True],
        "presence_penalty": [0.5, "x"],
        "frequency_penalty": [0.5, "x"],
        "echo": [True], "tools": [[{"type": "function"}]], "functions": [[{"name": "f"}]],
        "best_of": [True, 2], "logit_bias": [{"1": 5}], "suffix": ["x"],
        "response_format": [{"type": "json_object"}], "top_logprobs": [2],
        "tool_choice": ["auto"], "function_call": ["auto"],
    }
    out: list[tuple[str, str, Any]] = []
    for field, values in wrong.items():
        for value in values:
            out.append((f"completion {field}={value!r:.20}", comp, {**base, field: value}))
            out.append((f"chat {field}={value!r:.20}", chat,
                        {"model": MODEL, "messages": msgs, "max_tokens": 2, field: value}))
    prompts = [None, "", [], [[]], [-1], [10**7], [1.5], [True], {"a": 1}, True, 1,
               ["a", "b"], [[1], [2]], [5] * 9000, "word " * 1_000_000]
    out += [(f"prompt={p!r:.20}", comp, {**base, "prompt": p}) for p in prompts]
    messages = [None, [], "x", [{}], [{"role": "x", "content": "y"}], [{"role": "user"}],
                [{"role": "user", "content": 1}], [{"content": "x"}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
                [{"role": "user", "content": [{"type": "text"}]}],
                [{"role": "system", "content": None}], [{"role": "user", "content": "x" * 50_000}]]
    out += [(f"messages={m!r:.20}", chat, {"model": MODEL, "messages": m}) for m in messages]
    raw = [b"", b"null", b"[]", b"1", b'"x"', b"{", b"\xff\xfe", b"[" * 100_000,
           b'{"model": "smollm2", "prompt": "x", "max_tokens": NaN}',
           b'{"model": "smollm2", "prompt": "x", "temperature": Infinity}',
           b'{"model": "smollm2", "prompt": "abc\\ud800"}',
           b'{"model": "smollm2", "prompt": "x", "model": 1}']
    out += [(f"body {r[:12]!r}", path, r) for r in raw for path in (comp, chat)]
    return out


BAD_INPUTS = _bad_inputs()


def test_no_bad_input_is_a_500_or_a_traceback(served: Running,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Every one of the bad requests above is a 4xx with an OpenAI-style error body, none
    logs an error, and the server goes on answering."""
    assert len(BAD_INPUTS) >= 134
    failures = []
    uvicorn_log = logging.getLogger("uvicorn.error")  # it does not propagate to the root
    uvicorn_log.addHandler(caplog.handler)
    with caplog.at_level("ERROR"), contextlib.ExitStack() as stack:
        stack.callback(uvicorn_log.removeHandler, caplog.handler)
        for name, path, body in BAD_INPUTS:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = httpx.post(served.url + path, content=data, timeout=300,
                                  headers={"content-type": "application/json"})
            error = response.json().get("error", {}) if response.content[:1] == b"{" else {}
            if not 400 <= response.status_code < 500 or not error.get("message"):
                failures.append((name, response.status_code, response.text[:200]))
    assert not failures, failures
    assert not [r for r in caplog.records if r.levelno >= 40], caplog.text
    ok = served.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
    settle(served)


def test_forms_the_api_accepts(served: Running, offline: LLM) -> None:
    """null sampling settings (the defaults), a developer message (a system message), content
    as text parts, a message without content from the assistant."""
    client = served.client()
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4,
                                    extra_body={"temperature": None, "top_p": None, "n": None})
    # sampled at the default temperature: the end of text may come within the 4 tokens
    reason, tokens = out.choices[0].finish_reason, out.usage.completion_tokens
    assert reason in ("length", "stop") and (tokens == 4) == (reason == "length") and tokens
    parts = [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": parts}])
    ids = encode_chat(offline.tokenizer, [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Name a colour."}])
    want = offline.generate(ids, SamplingParams(max_tokens=4))[0].text
    assert chat.choices[0].message.content == want


def test_bad_chat_input(served: Running) -> None:
    for stream in ("false", "true"):  # a lone surrogate in a message: 400, streamed or not
        body = ('{"model": "smollm2", "max_tokens": 4, "stream": ' + stream + ', "messages": '
                '[{"role": "user", "content": "hi \\udfff"}]}').encode()
        response = httpx.post(f"{served.url}/v1/chat/completions", content=body, timeout=300,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert "surrogate" in response.json()["error"]["message"]
    client = served.client()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                "content": "x"}])


def test_many_requests_leave_every_page_free(served: Running) -> None:
    """32 requests of 1-4 tokens from 16 clients at once, on 8 rows (each of the 8 prompts
    four times): every page comes back."""
    client = served.client()
    before = free_pages(served)

    def run(i: int) -> str | None:
        return client.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)],
                                         max_tokens=1 + i % 4, temperature=0).choices[0].text

    with cf.ThreadPoolExecutor(16) as pool:
        assert len([t for t in pool.map(run, range(32)) if t is not None]) == 32
    settle(served)
    assert free_pages(served) == before == served.engine.runner.cache.num_pages


# --- admission and keys ---------------------------------------------------------------------

def test_a_full_queue_answers_429() -> None:
    running = Running(engine(max_num_seqs=1, kv_cache_bytes=kv_bytes([LONG_ROW])), max_queue=1)
    try:
        url = f"{running.url}/v1/completions"
        long = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        pool = cf.ThreadPoolExecutor(1)
        with httpx.stream("POST", url, json=long, timeout=300) as first:
            lines = first.iter_lines()  # kept: a dropped iterator closes the connection
            assert next(lines).startswith("data: ")  # it holds the only row
            queued = pool.submit(httpx.post, url, json={**long, "stream": False,
                                                        "max_tokens": 3}, timeout=300)
            for _ in range(400):
                if running.engine.num_waiting == 1:
                    break
                time.sleep(0.05)
            refused = httpx.post(url, json={**long, "stream": False}, timeout=300)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["type"] == "rate_limit_exceeded"
            assert refused.headers["retry-after"] == "1"
            with pytest.raises(openai.RateLimitError):
                running.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert queued.result().status_code == 200  # the first left: the queued one ran
        pool.shutdown()
        settle(running)
        assert free_pages(running) == running.engine.runner.cache.num_pages
    finally:
        running.stop()


def test_a_burst_waits_while_rows_are_free(served: Running, offline: LLM) -> None:
    """16 requests that arrive together (the engine thread held until all 16 are queued) on
    8 free rows and a queue bound of 8: none is refused, every answer is offline's."""
    gate = threading.Event()
    engine_side = served.app.state.server.engine
    old_bound, engine_side.max_queue = engine_side.max_queue, 8
    held = cf.ThreadPoolExecutor(1).submit(
        lambda: __import__("asyncio").run(engine_side.run(lambda e: gate.wait(60))))
    try:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
        with cf.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(httpx.post, f"{served.url}/v1/completions", timeout=300,
                                   json={"model": MODEL, "prompt": p, "max_tokens": 6,
                                         "temperature": 0}) for p in prompts]
            for _ in range(400):  # every request's command waits behind the held thread
                if engine_side._commands.qsize() >= 16:
                    break
                time.sleep(0.02)
            assert engine_side._commands.qsize() >= 16
            # the bound reached, with the engine thread still held: refused at once
            started = time.perf_counter()
            bounced = [httpx.post(f"{served.url}/v1/completions", timeout=300,
                                  json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                       for _ in range(3)]
            assert time.perf_counter() - started < 3.0
            gate.set()
            answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * 16, [a.text for a in answers]
        assert bounced and all(r.status_code == 429 for r in bounced), bounced
        want = offline_texts(offline, prompts, [{"max_tokens": 6}] * 16)
        assert [a.json()["choices"][0]["text"] for a in answers] == [w for w, _ in want]
    finally:
        gate.set()
        held.result()
        engine_side.max_queue = old_bound
    settle(served)


async def _burst(url: str, bodies: list[dict]) -> list[tuple[int, float, str]]:
    """Every body posted at once -> (status, seconds to the answer, text) of each."""
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def one(body: dict) -> tuple[int, float, str]:
            started = time.perf_counter()
            response = await client.post(url, json=body)
            return response.status_code, time.perf_counter() - started, response.text

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def test_bursts_of_64_wait_and_of_200_are_bounded(served: Running, offline: LLM) -> None:
    """At 8 rows and a queue bound of 64: a burst of 64 requests is answered in full, each
    as offline; of a burst of 200 while 8 streams decode, the queue takes 64 and the rest
    are refused (429), as is every request after them, each within 100 ms or as fast as a
    health check (the check does not wait for the engine's step), and every request the
    queue took is answered."""
    url = f"{served.url}/v1/completions"
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    # one token each (the prefill's): what is tested is the queue, not the decoding
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 1, "temperature": 0} for p in prompts]
    answers = asyncio.run(_burst(url, bodies))
    assert [status for status, _, _ in answers] == [200] * 64
    want = offline_texts(offline, prompts, [{"max_tokens": 1}] * 64)
    assert [json.loads(t)["choices"][0]["text"] for _, _, t in answers] == [w for w, _ in want]
    pool = cf.ThreadPoolExecutor(1)
    with contextlib.ExitStack() as stack:  # 8 streams hold the 8 rows: long enough that
        # none is done before the probes below end (a round drafts up to 5 tokens); closed
        # after them, so that their rows go to the requests in the queue
        for i in range(8):
            stack.enter_context(streaming(served, PROMPTS[i], 400))
        assert served.engine.num_running == 8
        burst = pool.submit(asyncio.run, _burst(url, bodies * 3 + bodies[:8]))
        for _ in range(400):
            if served.engine.num_waiting == 64 or burst.done():
                break
            time.sleep(0.02)
        late, health = [], []  # one at a time, the queue full and the rows decoding
        for _ in range(10):
            started = time.perf_counter()
            status = httpx.post(url, json=bodies[0], timeout=300).status_code
            late.append((status, time.perf_counter() - started))
            started = time.perf_counter()
            assert httpx.get(f"{served.url}/health", timeout=300).status_code == 200
            health.append(time.perf_counter() - started)
        assert served.engine.num_running == 8 and not burst.done()
    answers = burst.result()
    pool.shutdown()
    assert sorted({status for status, _, _ in answers}) == [200, 429]
    assert sum(status == 429 for status, _, _ in answers) == 200 - 64  # the queue took 64
    assert [status for status, _ in late] == [429] * 10
    seconds, probe = sorted(t for _, t in late), sorted(health)
    # within 100 ms, or as fast as the server answers a health check on a machine loaded
    # by other work: the refusal does not wait for the step in flight
    assert seconds[0] < max(0.1, 2 * probe[0]), (seconds, probe)
    assert seconds[5] < max(0.2, 2 * probe[5]) and seconds[-1] < 1.0, (seconds, probe)
    settle(served)
    assert free_pages(served) == served.engine.runner.cache.num_pages


def test_random_disconnects_leave_gauges_and_counters_right(served: Running) -> None:
    """64 requests, 32 at a time on 8 rows (so some wait in the queue): non-streamed ones run
    to their end, streams are closed after 1-4 chunks (of 300 tokens: they cannot finish
    first). Within a second of the last, no request runs, every page is free, and the request
    counter went up by 64: the closed streams as finish reason abort, the rest as stop or
    length."""
    import random

    rng = random.Random(0)
    before = metric(served, "vegas_requests_total")
    url = f"{served.url}/v1/completions"
    plan = [rng.random() < 0.4 for _ in range(64)]  # True: a stream closed early

    async def one(client: httpx.AsyncClient, gate: asyncio.Semaphore, i: int,
                  close: bool) -> None:
        body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "temperature": 0,
                "max_tokens": 300 if close else 1 + i % 4, "stream": close,
                "ignore_eos": close}
        async with gate:
            if not close:
                assert (await client.post(url, json=body)).status_code == 200
                return
            async with client.stream("POST", url, json=body) as response:
                assert response.status_code == 200
                chunks, keep = 0, 1 + i % 4
                async for line in response.aiter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == keep:
                        break

    async def run() -> None:
        gate = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=300) as client:
            await asyncio.gather(*(one(client, gate, i, c) for i, c in enumerate(plan)))

    asyncio.run(run())
    settle(served)
    time.sleep(1.0)
    after = metric(served, "vegas_requests_total")
    added = {k: v - before.get(k, 0.0) for k, v in after.items()}
    assert added.get('{finish_reason="abort"}') == sum(plan), added
    assert sum(added.values()) == 64, added
    assert metric(served, "vegas_num_requests_running")[""] == 0
    assert metric(served, "vegas_num_requests_waiting")[""] == 0
    assert metric(served, "vegas_kv_free_pages")[""] == served.engine.runner.cache.num_pages


def metric(running: Running, name: str) -> dict[str, float]:
    """The samples of one metric from /metrics: {labels (or ""): value}."""
    text = httpx.get(f"{running.url}/metrics", timeout=300).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            out[head[len(name):]] = float(value)
    return out


def test_disconnects_show_in_the_metrics_at_once(served: Running) -> None:
    """Two requests that finish and two whose clients leave mid-stream: within a second of
    the last one, no request runs, every page is free, and the request counter went up by
    four, two of them with finish reason abort."""
    before = metric(served, "vegas_requests_total")
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    for _ in range(2):
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body,
                          timeout=300) as response:
            assert next(response.iter_lines()).startswith("data: ")
        served.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    settle(served)
    time.sleep(0.5)  # no step runs once idle: the gauges must already be right
    after = metric(served, "vegas_requests_total")
    added = {k: v - before.get(k, 0.0) for k, v in after.items()}
    assert added.get('{finish_reason="abort"}') == 2 and sum(added.values()) == 4, added
    assert metric(served, "vegas_num_requests_running")[""] == 0
    assert metric(served, "vegas_kv_free_pages")[""] == served.engine.runner.cache.num_pages


def test_a_huge_prompt_is_refused_at_once_beside_a_stream(served: Running) -> None:
    """A 5 MB prompt holds more characters than the 8K context's tokens can: refused (400)
    in under 0.5 s without being tokenized, while a stream goes on with no chunk gap above
    three times its median (one step's, two where a step sends no text); the tokenizing of
    any prompt runs on a worker thread, not the engine's."""
    huge = {"model": MODEL, "prompt": "word " * 1_000_000, "max_tokens": 2}

    def refuse() -> tuple[httpx.Response, float, float]:
        started = time.perf_counter()
        response = httpx.post(f"{served.url}/v1/completions", json=huge, timeout=300)
        return response, started, time.perf_counter()

    arrivals: list[float] = []

    def past(ended: float) -> bool:
        """Whether the stream has sent more than 20 chunks, the last one three median
        gaps after the refusal's end (what the checks below read)."""
        gaps = sorted(b - a for a, b in itertools.pairwise(arrivals))
        return len(arrivals) > 20 and arrivals[-1] > ended + 3 * gaps[len(gaps) // 2]

    # 200 tokens: chunks keep coming after the 12th, however many tokens a round accepts;
    # closed once the checks have what they read
    with streaming(served, PROMPTS[0], 200) as lines, cf.ThreadPoolExecutor(1) as pool:
        for line in lines:
            if line:
                arrivals.append(time.perf_counter())
            if len(arrivals) == 12:  # the stream's pace is known: the big request now
                refusal = pool.submit(refuse)
            if len(arrivals) > 12 and refusal.done() and past(refusal.result()[2]):
                break
        response, started, ended = refusal.result()
    assert response.status_code == 400, response.text
    assert "characters" in response.json()["error"]["message"]
    assert ended - started < 0.5, ended - started  # was 11.6 s of tokenizing in the engine
    gaps = [(b, b - a) for a, b in itertools.pairwise(arrivals)]
    median = sorted(g for _, g in gaps)[len(gaps) // 2]
    # the chunks from the refusal's start to the first one after its end: a gap is a step's
    # time, or two where a step's tokens end in text held back (no chunk is sent for it)
    during = [g for at, g in gaps if started <= at <= ended + 3 * median]
    assert during and max(during) <= 3 * median, (during, median)
    assert len(arrivals) > 20  # it went on past the refusal
    settle(served)


def test_a_queued_client_that_leaves_gives_its_place_up() -> None:
    """A request waiting for the only row whose client disconnects leaves the queue at once
    (it is never prefilled), so the bound counts only clients that still wait."""
    running = Running(engine(max_num_seqs=1, kv_cache_bytes=kv_bytes([LONG_ROW])), max_queue=1)
    try:
        url = f"{running.url}/v1/completions"
        long = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=long, timeout=300) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")  # it holds the only row
            with pytest.raises(httpx.ReadTimeout):  # waits, then its client gives up
                httpx.post(url, json={**long, "stream": False, "max_tokens": 3}, timeout=1.0)
            for _ in range(400):  # nothing on its way in, nothing waiting
                if running.api.engine.arriving == 0 and running.engine.num_waiting == 0:
                    break
                time.sleep(0.05)
            assert running.api.engine.arriving == 0 and running.engine.num_waiting == 0
            with cf.ThreadPoolExecutor(1) as pool:  # its place is free for the next one
                nxt = pool.submit(httpx.post, url, timeout=300,
                                  json={**long, "stream": False, "max_tokens": 3})
                for _ in range(400):  # a machine loaded by other work takes its time
                    if running.engine.num_waiting == 1:
                        break
                    time.sleep(0.05)
                assert running.engine.num_waiting == 1
                first.close()
                assert nxt.result().status_code == 200
        settle(running)
        assert free_pages(running) == running.engine.runner.cache.num_pages
    finally:
        running.stop()


def test_requests_that_may_fill_the_context_do_not_block_a_short_one() -> None:
    """Five streams with max_tokens 10^9 (capped to a 1K context: said in a warning header)
    hold only the pages they have written, so in a pool of 100 pages (a whole context is 65)
    all five decode at once and a short request behind them is answered while they stream,
    the pool preempting and resuming the newest streams as they grow."""
    probe = LLM(None, max_model_len=1024, kv_cache_bytes=1 << 22)
    page = probe.engine.runner.cache.bytes_per_page
    del probe
    running = Running(engine(max_num_seqs=8, max_model_len=1024, kv_cache_bytes=101 * page))
    body = {"model": MODEL, "max_tokens": 10**9, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with contextlib.ExitStack() as stack:
            streams = [stack.enter_context(httpx.stream(
                "POST", f"{running.url}/v1/completions", json={**body, "prompt": p},
                timeout=300)) for p in PROMPTS[:5]]
            lines = [s.iter_lines() for s in streams]
            assert all(next(it).startswith("data: ") for it in lines)
            for s in streams:
                assert "capped to" in s.headers["x-vegas-warning"]
            started = time.perf_counter()
            short = running.client().completions.create(model=MODEL, prompt="Hi",
                                                        max_tokens=4, temperature=0)
            assert short.choices[0].finish_reason in ("length", "stop")
            assert time.perf_counter() - started < 60
            assert running.engine.num_running == 5  # the streams are still decoding
            for it in lines:  # each goes on streaming
                assert any(line.startswith("data: {") for line in itertools.islice(it, 4))
        settle(running)
        assert free_pages(running) == running.engine.runner.cache.num_pages
    finally:
        running.stop()


def test_cli_api_key_from_a_file_or_the_environment(tmp_path: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from vegas_spec import cli
    from vegas_spec.config import ConfigError

    def key(*argv: str) -> str | None:
        return cli._api_key(cli._parser().parse_args(["serve", *argv]))

    monkeypatch.delenv("VEGAS_API_KEY", raising=False)
    assert key() is None and key("--api-key", "a") == "a"
    secret = tmp_path / "key"
    secret.write_text("from-file\nignored\n")
    assert key("--api-key-file", str(secret)) == "from-file"
    monkeypatch.setenv("VEGAS_API_KEY", "from-env")
    assert key() == "from-env" and key("--api-key", "a") == "a"
    with pytest.raises(ConfigError, match="once"):
        key("--api-key", "a", "--api-key-file", str(secret))
    with pytest.raises(ConfigError, match="cannot read"):
        key("--api-key-file", str(tmp_path / "missing"))
    secret.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        key("--api-key-file", str(secret))


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_cli_serve_refuses_a_bad_port_before_loading(port: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import vegas_spec.engine
    from vegas_spec import cli
    from vegas_spec.config import ConfigError

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(vegas_spec.engine, "LLMEngine", never)
    with pytest.raises(ConfigError, match="--port must be a TCP port"):
        cli.serve(cli._parser().parse_args(["serve", "--port", port]))


def test_cli_serve_without_the_serve_extra_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from vegas_spec import cli
    from vegas_spec.config import ConfigError

    monkeypatch.setitem(sys.modules, "vegas_spec.serve.app", None)
    args = cli._parser().parse_args(["serve"])
    with pytest.raises(ConfigError, match=r"pip install 'vegas-spec\[serve\]'"):
        cli.serve(args)


def test_api_key() -> None:
    running = Running(engine(max_num_seqs=2), api_key="sesame", max_body=1 << 20,
                      body_timeout=1.0, header_timeout=1.0)
    try:
        # refused from the headers: the body is never read or parsed, whatever it is
        url, json_type = f"{running.url}/v1/completions", {"content-type": "application/json"}
        for body in (b"{not json", b"x" * (8 << 20)):
            started = time.perf_counter()
            refused = httpx.post(url, content=body, headers=json_type, timeout=300)
            assert refused.status_code == 401 and time.perf_counter() - started < 5.0
            assert refused.json()["error"]["type"] == "authentication_error"
        for path in ("/v1/nonexistent", "/docs", "/openapi.json", "/redoc"):
            assert httpx.get(running.url + path, timeout=300).status_code == 401, path
        # with the key: a body past the limit is 413, by its length or as it arrives
        keyed = {**json_type, "authorization": "Bearer sesame"}
        big = httpx.post(url, content=b"x" * (2 << 20), headers=keyed, timeout=300)
        assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer
            for _ in range(40):
                yield b" " * (64 << 10)

        streamed = httpx.post(url, content=chunks(), headers=keyed, timeout=300)
        assert streamed.status_code == 413, streamed.text
        # a response that outlives the body timeout is not cut: the body came whole
        with httpx.stream("POST", url, headers=keyed, timeout=300, json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 24, "ignore_eos": True,
                "stream": True}) as response:
            got = []
            for line in response.iter_lines():
                got.append(line)
                if len(got) == 2:
                    time.sleep(1.5)  # the stream goes on past both timeouts (1 s)
        assert [line for line in got if line][-1] == "data: [DONE]"
        # a body shorter than its Content-Length: 408 once it stops arriving, not a hang
        with socket.create_connection(("127.0.0.1", int(running.url.rsplit(":", 1)[1]))) as raw:
            raw.settimeout(30)
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Authorization: Bearer sesame\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"model\": ")
            assert raw.recv(4096).startswith(b"HTTP/1.1 408")
        # silent, slow headers, slow headers on a kept-alive connection: 408 and closed
        for first, trickle in ((b"", b""), (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"),
                               (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /hea")):
            with socket.create_connection(("127.0.0.1", running.port)) as raw:
                raw.settimeout(30)
                started = time.perf_counter()
                if first:
                    raw.sendall(first)
                    answer = b""
                    while not answer.endswith(b'{"status":"ok"}'):
                        answer += raw.recv(4096)
                    assert answer.startswith(b"HTTP/1.1 200")
                    started = time.perf_counter()
                for byte in trickle:  # a byte every 0.1 s: never a whole header block
                    try:
                        raw.sendall(bytes([byte]))
                    except OSError:  # closed by the server meanwhile
                        break
                    time.sleep(0.1)
                reply = b"".join(iter(lambda: raw.recv(4096), b""))  # until it is closed
                assert reply.startswith(b"HTTP/1.1 408"), reply
                assert b"headers within 1 s" in reply
                assert 0.9 < time.perf_counter() - started < 5.0
        assert httpx.get(f"{running.url}/metrics", timeout=300).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            running.client("wrong").models.list()
        response = httpx.post(f"{running.url}/v1/completions",
                              json={"model": MODEL, "prompt": "x"}, timeout=300)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        out = running.client("sesame").completions.create(model=MODEL, prompt="Hi",
                                                          max_tokens=2)
        assert out.choices[0].text is not None
        assert httpx.get(f"{running.url}/health", timeout=300).status_code == 200
    finally:
        running.stop()


def test_cli_serve_binds_loopback_unless_told(tmp_path: Any) -> None:
    """Defaults bind loopback; a `vegas tune` settings file (--config) sets the speculative
    defaults of serve as of every command, and explicit options still win."""
    from vegas_spec.cli import _engine_kwargs, _parser, _settings_file, _spec
    from vegas_spec.config import SpecConfig
    from vegas_spec.config_file import write_config

    args = _parser().parse_args(["serve", "--method", "stream", "--max-num-seqs", "4"])
    assert (args.host, args.port, args.max_queue, args.api_key) == ("127.0.0.1", 8000, 256, None)
    assert _spec(args, args.method).method == "stream"
    assert _engine_kwargs(args)["device"] == "cpu"
    config = tmp_path / "config.json"
    write_config(config, SpecConfig(method="vegas", gamma=5, ratio=0.04), {})
    argv = ["serve", "--config", str(config)]
    args = _parser(_settings_file(argv)).parse_args(argv)
    spec = _spec(args, args.method)
    assert (spec.method, spec.gamma, spec.ratio) == ("vegas", 5, 0.04)
    argv = ["serve", "--config", str(config), "--gamma", "3"]
    args = _parser(_settings_file(argv)).parse_args(argv)
    assert _spec(args, args.method).gamma == 3


def test_cli_serve_freezes_the_heap_after_its_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """`vegas serve` warms every graph up, then moves what it made out of the garbage
    collector's full collections (gc.freeze) before it takes requests."""
    import gc

    import vegas_spec.engine
    import vegas_spec.serve.app
    from vegas_spec import cli

    calls: list[str] = []

    class Engine:
        draft_weight_bytes, draft_weight_kind = 0, "model"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.source = type("Source", (), {"path": cli.Path("model.gguf")})()

        def warm_up(self, rows: int) -> int:
            calls.append(f"warm_up {rows}")
            return 0

    def run(engine: Any, *args: Any) -> None:
        calls.append(f"serve, frozen {gc.get_freeze_count() > 0}")

    monkeypatch.setattr(vegas_spec.engine, "LLMEngine", Engine)
    monkeypatch.setattr(vegas_spec.serve.app, "serve", run)
    gc.unfreeze()
    try:
        args = cli._parser().parse_args(["serve", "--max-num-seqs", "4"])
        assert cli.serve(args) == 0
    finally:
        gc.unfreeze()
    assert calls == ["warm_up 4", "serve, frozen True"]


# --- shutdown -------------------------------------------------------------------------------

def serve_process(*extra: str) -> tuple[Any, str]:
    """`vegas serve` in a process of its own on a free loopback port, once it answers."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from vegas_spec.cli import main; sys.exit(main())",
         "serve", "--port", str(port), "--max-num-seqs", "2", "--kv-cache-gb", "0.25",
         "--method", "vanilla", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.25)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.kill()
    raise AssertionError("vegas serve did not start")


def stream_through(url: str, on_first: Any) -> list[str]:
    """A long greedy stream; on_first() after its first chunk -> every line it sent."""
    body = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "prompt": PROMPTS[0],
            "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        got = [next(lines)]
        on_first()
        got += [line for line in lines if line]
    return got


@pytest.mark.parametrize("second", [False, True], ids=["grace", "second-signal"])
def test_a_signal_ends_requests_cleanly_and_the_process_with_one_line(second: bool) -> None:
    """SIGTERM: the stream in flight gets the grace period (1 s here), then ends with finish
    reason abort and [DONE]; the process exits 0 with one line. With a long grace period, a
    second signal (SIGINT) ends it at once, as cleanly."""
    import json
    import signal

    proc, url = serve_process("--shutdown-timeout", "60" if second else "1")
    try:
        def signal_it() -> None:
            proc.send_signal(signal.SIGTERM)
            if second:
                time.sleep(0.5)
                proc.send_signal(signal.SIGINT)

        started = time.perf_counter()
        lines = stream_through(url, signal_it)
        took = time.perf_counter() - started
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "abort"
        assert took < 30.0
        code = proc.wait(timeout=60)
        err = proc.stderr.read() if proc.stderr else ""
        assert code == 0, err[-3000:]
        assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
        ended = [line for line in err.splitlines() if line.startswith("vegas: shut down")]
        assert ended == [f"vegas: shut down after SIGTERM (1 request(s) aborted"
                         f"{', at a second signal' if second else ''})"], err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_stopped_server_lets_its_engine_go() -> None:
    """Nothing outlives the app that holds its engine (FastAPI caches route callables for
    the process): the engine, its KV pool and its share of the model are freed with it."""
    import gc
    import weakref

    running = Running(engine(max_num_seqs=1))
    assert running.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
    gone = weakref.ref(running.engine)
    running.stop()
    del running
    gc.collect()
    assert gone() is None

"""`concept serve` (one server started for the module, called with the official `openai` client) and
`concept chat`, on a tiny trained run: the served text is the library's greedy text, plain and streamed, for
both endpoints; bad requests get 4xx JSON errors in OpenAI's shape and the server stays up; concurrent requests
are served one at a time, each getting its own answer; chat turns use the chat template (SmolLM2's, or plain
turns for a backbone without one) and carry the conversation."""
import copy
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from click.testing import CliRunner

import concept
from concept import chat
from concept.tokens import tokenizer_for
from concept.training import Trainer
from concept_cli.main import cli
from tests.conftest import in_a_fresh_process
from tests.test_training import built, corpus, small  # noqa: F401  (fixtures)

NAME = "tiny"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(built, corpus, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("serve") / NAME
    Trainer.start(built, out, small(data=str(corpus), steps=2, eval_every=2, checkpoint_every=2)).train()
    return out


@pytest.fixture(scope="module")
def model(trained):
    return concept.load(trained)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(trained):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "concept_cli", "serve", str(trained), "--port", str(port),
                             "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/models", timeout=2).read()
            break
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the server did not start:\n{proc.communicate()[0]}")
            time.sleep(0.2)
    try:
        yield base, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="unused", max_retries=0, timeout=120)


def greedy(model, prompt: str, n: int, stops=()) -> str:
    return concept.generate(model, prompt, max_new_tokens=n, stop_strings=stops)


def test_completions_plain_and_streamed(client, model):
    assert [m.id for m in client.models.list().data] == [NAME]
    expected = greedy(model, "def f(x):", 12)
    r = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=12, temperature=0)
    assert r.choices[0].text == expected and r.object == "text_completion"
    assert r.usage.prompt_tokens == len("def f(x):".encode()) and r.usage.completion_tokens <= 12
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.completions.create(model=NAME, prompt="def f(x):", max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason and len(chunks) > 2
    seeded = [client.completions.create(model=NAME, prompt="import", max_tokens=6, temperature=0.9, seed=3).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]  # a seed makes sampling repeatable


def test_chat_plain_and_streamed(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    tokenizer = tokenizer_for(model)
    prompt = chat.prompt(tokenizer, messages)
    assert prompt == "System: Be brief.\nUser: What is a list?\nAssistant:"  # (no chat template: plain turns)
    expected = greedy(model, prompt, 10, chat.stop_strings(tokenizer))
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices


def test_bad_requests_get_openai_errors_and_the_server_stays_up(client, server):
    base, proc = server
    cases = [(dict(model="nope"), openai.NotFoundError, "model_not_found"),
             (dict(temperature=-1), openai.BadRequestError, None),
             (dict(n=2), openai.BadRequestError, None),
             (dict(max_tokens=0), openai.BadRequestError, None),
             (dict(prompt="x" * 5000), openai.BadRequestError, "context_length_exceeded"),
             (dict(prompt=""), openai.BadRequestError, None)]
    for change, error, code in cases:
        with pytest.raises(error) as caught:
            client.completions.create(**{"model": NAME, "prompt": "hi", "max_tokens": 2, **change})
        assert 400 <= caught.value.status_code < 500 and caught.value.body["message"]
        assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["code"] == code
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"role": "assistant", "content": "hi"}], max_tokens=2)
    request = urllib.request.Request(f"{base}/completions", data=b'{"model": "tiny", "prompt": ',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400
    assert json.loads(caught.value.read())["error"]["code"] == "invalid_json"
    assert proc.poll() is None
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0).choices[0].text is not None


def test_concurrent_requests_each_get_their_own_answer(client, model):
    prompts = ["def a(", "class B:", "import os\n", "x = [1,"]
    expected = {p: greedy(model, p, 8) for p in prompts}
    got = {}

    def ask(p, stream):
        if stream:
            got[p] = "".join(c.choices[0].text for c in client.completions.create(
                model=NAME, prompt=p, max_tokens=8, temperature=0, stream=True))
        else:
            got[p] = client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(p, i % 2 == 0)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == expected


def engine_runs(engine, prompts, stream_every=2) -> tuple[dict, set]:
    """Each prompt sent to ``engine.run`` from a thread of its own (every ``stream_every``-th with a ``write``, as a
    streamed request's), at once: (the replies' texts by prompt, the callers' thread ids)."""
    texts, callers = {}, set()

    def ask(i, p):
        callers.add(threading.get_ident())
        pieces = []
        reply = engine.run(engine.prompt_ids(p), engine_settings(), write=pieces.append if i % stream_every == 0 else None)
        texts[p] = reply.text
        assert not pieces or "".join(pieces) == reply.text

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return texts, callers


def engine_settings() -> dict:
    return {"max_new_tokens": 6, "stop_strings": (), "do_sample": False, "seed": None}


def test_every_request_decodes_in_the_engines_one_thread(model, monkeypatch):
    """Plain and streamed requests sent at once from their own threads all decode in one thread, the engine's (what a
    compiled model's CUDA-graph trees need: they belong to the thread that records them), none of the callers',
    each reply the text it gets alone."""
    from concept import serving

    decoders = []
    real = serving.generate
    monkeypatch.setattr(serving, "generate", lambda *a, **k: decoders.append(threading.current_thread()) or real(*a, **k))
    engine = serving.Engine(model, NAME)
    prompts = ["def a(", "class B:", "import os\n", "x = [1,"]
    texts, callers = engine_runs(engine, prompts)
    assert texts == {p: greedy(model, p, 6) for p in prompts}
    assert len(decoders) == 4 and len({t.ident for t in decoders}) == 1
    assert decoders[0].name.startswith("concept-decode") and decoders[0].ident not in callers | {threading.get_ident()}


def compiled_engine_replies(run: str, choice: str) -> dict:
    """(eager greedy texts, a compiled engine's replies, the compile choice it ran) of two prompts sent at once."""
    from concept import serving
    from concept.compiled import compile_model, compiled_choice

    model = concept.load(run)
    compiled = compile_model(copy.deepcopy(model), choice)
    prompts = ["def a(", "class B:"]
    texts, _ = engine_runs(serving.Engine(compiled, NAME), prompts)
    return {"eager": {p: greedy(model, p, 6) for p in prompts}, "served": texts, "choice": compiled_choice(compiled)}


@pytest.mark.slow  # (about 25 s: a fresh process and a compilation; the GPU's is in tests/test_cuda.py)
def test_a_compiled_model_serves_the_eager_models_replies(trained):
    """In a fresh process (it compiles in the engine's thread: ``tests.conftest.in_a_fresh_process``)."""
    out = in_a_fresh_process("tests.test_serving:compiled_engine_replies", str(trained), "aot-eager")
    assert out["choice"] == "aot-eager" and out["served"] == out["eager"]


def test_serve_and_chat_take_compile(trained, monkeypatch):
    """``--compile`` reaches ``concept.load`` (the server itself is not started: ``uvicorn.run`` stands in; the model is
    loaded eagerly, the compiled paths' own tests run them)."""
    import uvicorn

    loaded = []
    real = concept.load
    monkeypatch.setattr(concept, "load", lambda *a, **k: loaded.append(k) or real(*a, **{**k, "compile": "off"}))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    r = CliRunner().invoke(cli, ["serve", str(trained), "--compile", "aot-eager", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["chat", str(trained), "--compile", "aot-eager", "--device", "cpu", "--message", "hi",
                                 "--max-new-tokens", "2"])
    assert r.exit_code == 0, r.output
    assert [k.get("compile") for k in loaded] == ["aot-eager", "aot-eager"]


# -- concept chat -------------------------------------------------------------------------------------
def test_chat_command_one_shot_and_multi_turn(trained, model):
    tokenizer = tokenizer_for(model)
    stops = chat.stop_strings(tokenizer)
    r = CliRunner().invoke(cli, ["chat", str(trained), "--message", "hello", "--max-new-tokens", "6", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    first = greedy(model, chat.prompt(tokenizer, [{"role": "user", "content": "hello"}]), 6, stops)
    assert r.stdout == first + "\n"

    r = CliRunner().invoke(cli, ["chat", str(trained), "--system", "S", "--max-new-tokens", "6", "--device", "cpu"],
                           input="hello\n/reset\nhello\nmore\n/exit\nignored\n")
    assert r.exit_code == 0, r.output
    turns = [{"role": "system", "content": "S"}, {"role": "user", "content": "hello"}]
    one = greedy(model, chat.prompt(tokenizer, turns), 6, stops)
    turns += [{"role": "assistant", "content": one}, {"role": "user", "content": "more"}]
    two = greedy(model, chat.prompt(tokenizer, turns), 6, stops)  # the second turn sees the first
    assert r.stdout == f"{one}\n{one}\n{two}\n"  # (/reset: the second "hello" starts again)


def test_history_is_trimmed_to_the_context():
    from concept.tokens import ByteTokenizer

    tokenizer = ByteTokenizer()
    turns = [{"role": "system", "content": "S"}, {"role": "user", "content": "a" * 40},
             {"role": "assistant", "content": "b" * 40}, {"role": "user", "content": "c"}]
    kept, ids = chat.fit(tokenizer, turns, limit=40, reserve=10)
    assert kept == [turns[0], turns[3]] and len(ids) + 10 <= 40
    assert chat.fit(tokenizer, turns, limit=None, reserve=10)[0] == turns
    with pytest.raises(concept.ConceptError, match="last message alone"):
        chat.fit(tokenizer, turns, limit=12, reserve=10)


@pytest.mark.integration
def test_smollm2_chat_template():
    """The real backbone's own template (SmolLM2-Instruct's <|im_start|> turns), ending at <|im_end|>."""
    from transformers import AutoTokenizer

    from concept_plugins.backbones.smollm2 import converted_folder

    tokenizer = AutoTokenizer.from_pretrained(converted_folder())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = chat.prompt(tokenizer, messages)
    assert text == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi!<|im_end|>" in text
    assert chat.stop_strings(tokenizer) == () and tokenizer.eos_token == "<|im_end|>"
    ids = chat.encode(tokenizer, text)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids.count(ids[0]) == 3  # no extra BOS

"""`flexplan serve`'s HTTP front, tested with the official openai client against a server started
on 127.0.0.1: completions, chat, streaming, models, errors (a bad request, then a good one),
/metrics, concurrency, a client leaving mid-stream (its KV freed), a full queue (429), SIGTERM.

Most tests run over a deterministic stand-in engine (tests/serving_double.py: fast, no torch);
those marked ``real`` run the actual Engine over a tiny random Llama with SmolLM2's tokenizer and
chat template (offline)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from serving_double import DoubleEngine

from flexplan.serving import server

TESTS = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A server on a thread, on a free port."""

    def __init__(self, engine, name="double", **kwargs):
        self.engine, self.port = engine, free_port()
        self.app = server.create_app(engine, name, aliases=("alias-of-double",), **kwargs)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=30)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def double():
    s = Running(DoubleEngine(max_model_len=4096))
    yield s
    s.stop()


def wait_until(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---- the double: the front's translation ----
def test_completion_returns_text_finish_reason_and_usage(double):
    r = double.client.completions.create(model="double", prompt="hello", max_tokens=5, temperature=0)
    assert r.choices[0].text == "abcde"
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)
    assert r.object == "text_completion" and r.model == "double"


def test_completion_takes_token_ids_an_alias_stop_and_max_tokens_default(double):
    r = double.client.completions.create(model="alias-of-double", prompt=[1, 2, 3], stop=["c"])
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.prompt_tokens) == ("ab", "stop", 3)
    r = double.client.completions.create(model="double", prompt="x")
    assert r.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_chat_applies_the_template_and_max_completion_tokens(double):
    msgs = [{"role": "user", "content": "hi"}]
    r = double.client.chat.completions.create(model="double", messages=msgs, max_completion_tokens=3)
    assert r.choices[0].message.content == "abc" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len("user: hi\nassistant: ")


def test_streaming_completion_and_chat_end_with_done_and_report_usage(double):
    chunks = list(double.client.completions.create(model="double", prompt="hi", max_tokens=4, stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "abcd"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4
    chunks = list(double.client.chat.completions.create(model="double", messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "abc"
    assert chunks[-1].choices[0].finish_reason == "length"
    with httpx.stream("POST", f"{double.url}/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_models_and_health(double):
    ids = [m.id for m in double.client.models.list()]
    assert ids[0] == "double" and "alias-of-double" in ids
    assert httpx.get(f"{double.url}/health").json() == {"status": "ok"}


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("body, status, param, code", [
    (b"{not json", 400, None, "invalid_json"),
    ({"model": "double"}, 400, "prompt", "missing_required_parameter"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ({"prompt": "x" * 5000}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "x", "n": 2}, 400, "n", "unsupported"),
    ({"prompt": "x", "temperature": 7}, 400, "temperature", "invalid_value"),
    ({"prompt": "x", "logprobs": 3}, 400, "logprobs", "unsupported"),
    ({"prompt": "x", "seed": 2**70}, 400, "seed", "invalid_value"),
    ({"prompt": "x", "top_k": -2}, 400, "top_k", "invalid_value"),
    ({"prompt": ["a", "b"]}, 400, "prompt", "invalid_value"),
    ([1, 2], 400, None, "invalid_json"),
])
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(double, body, status, param, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{double.url}/v1/completions", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = _error(r)
    assert (err["param"], err["code"]) == (param, code), err
    assert "Traceback" not in r.text
    assert double.client.completions.create(model="double", prompt="ok", max_tokens=1).choices[0].text == "a"


def test_chat_errors_name_their_field(double):
    for body, param in (({}, "messages"), ({"messages": [{"content": "x"}]}, "messages.[0].role"),
                        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.[0].role"),
                        ({"messages": [{"role": "user", "content": "x" * 5000}]}, "messages")):
        r = httpx.post(f"{double.url}/v1/chat/completions", json=body)
        assert r.status_code == 400 and _error(r)["param"] == param
    with pytest.raises(openai.NotFoundError):
        double.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_fields_other_servers_send_are_read_as_they_mean(double):
    # vLLM's clients send top_k=-1 for "off"; max_completion_tokens is honoured on /v1/completions too
    out = double.client.completions.create(model="double", prompt="hi", max_tokens=5,
                                           extra_body={"top_k": -1, "max_completion_tokens": 2})
    assert out.choices[0].text == "ab" and out.usage.completion_tokens == 2
    big = double.client.completions.create(model="double", prompt="hi", max_tokens=1, seed=2**64 - 1)
    assert big.choices[0].text == "a"


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/nothing", 404), ("POST", "/health", 405),
                                                  ("GET", "/v1/completions", 405)])
def test_an_unknown_path_or_method_gets_an_openai_error_naming_the_endpoints(double, method, path, status):
    r = httpx.request(method, f"{double.url}{path}")
    assert r.status_code == status
    err = _error(r)
    assert path in err["message"] and "POST /v1/chat/completions" in err["message"]


def test_metrics_export_queue_running_blocks_tokens_latencies_and_modes(double):
    double.client.completions.create(model="double", prompt="hi", max_tokens=3)
    text = httpx.get(f"{double.url}/metrics").text
    for name in ("flexplan_requests_waiting", 'flexplan_requests_running{device="cpu"', 'flexplan_kv_blocks_used{',
                 'pool="host"', "flexplan_kv_blocks_free{", "flexplan_generation_tokens_total",
                 "flexplan_generation_tokens_per_second", "flexplan_time_to_first_token_seconds_bucket",
                 "flexplan_time_per_output_token_seconds_bucket", 'flexplan_iterations_total{mode="cpu-only"',
                 "flexplan_prompt_tokens_total", "flexplan_iteration_token_budget{",
                 "flexplan_prefix_cache_queries_total", "flexplan_prefix_cache_hits_total", "flexplan_kv_blocks_cached{"):
        assert name in text, name
    ttft = [line for line in text.splitlines() if line.startswith("flexplan_time_to_first_token_seconds_count")]
    assert float(ttft[0].split()[-1]) >= 1


def test_concurrent_requests_all_answered(double):
    results = {}

    def ask(i):
        results[i] = double.client.completions.create(model="double", prompt=f"p{i}", max_tokens=3 + i).choices[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert {i: c.text for i, c in results.items()} == {i: "abcdefghijk"[:3 + i] for i in range(8)}


def test_a_client_that_leaves_mid_stream_aborts_its_request(double):
    body = {"prompt": "long", "max_tokens": 4000, "stream": True}  # 20 s of steps: ended by the abort
    with httpx.stream("POST", f"{double.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
    wait_until(lambda: double.engine.stats().running_by_device["cpu"] == 0 and not double.engine.has_unfinished())
    assert double.engine.stats().blocks_used == {"host": 0}
    assert _aborted(double) >= 1


def _aborted(s) -> float:
    text = httpx.get(f"{s.url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("flexplan_requests_finished_total") and 'finish_reason="abort"' in line)


def test_a_non_streaming_client_that_leaves_aborts_its_request(double):
    before = _aborted(double)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{double.url}/v1/completions", json={"prompt": "long", "max_tokens": 4000}, timeout=0.1)
    wait_until(lambda: not double.engine.has_unfinished() and _aborted(double) > before)
    assert double.engine.stats().blocks_used == {"host": 0}


def test_a_streaming_client_that_leaves_while_queued_aborts_its_request():
    engine = DoubleEngine(max_model_len=8192)
    s = Running(engine)
    try:
        engine.gate.clear()  # nothing runs: the request stays queued, its stream's headers unsent
        with pytest.raises(httpx.ReadTimeout), httpx.stream("POST", f"{s.url}/v1/completions", timeout=0.3,
                                                            json={"prompt": "q", "max_tokens": 8000, "stream": True}):
            pass
        engine.gate.set()
        wait_until(lambda: _aborted(s) == 1 and not engine.has_unfinished())
        assert engine.stats().blocks_used == {"host": 0}
    finally:
        engine.gate.set()
        s.stop()


def test_an_engine_failure_is_a_500_with_an_error_body_and_the_next_request_is_served(double):
    double.engine.fail_next = True
    r = httpx.post(f"{double.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 500 and _error(r)["code"] == "engine_failure"
    assert "Traceback" not in r.text
    assert double.client.completions.create(model="double", prompt="y", max_tokens=2).choices[0].text == "ab"


def test_a_full_queue_is_429_and_the_server_recovers():
    engine = DoubleEngine(max_running=1)
    s = Running(engine, max_waiting=1)
    try:
        engine.gate.clear()  # step() waits: the first request stays in the queue
        first = threading.Thread(target=lambda: s.client.completions.create(model="double", prompt="a", max_tokens=2))
        first.start()
        wait_until(lambda: s.app.state.served.loop.stats().waiting == 1)
        with pytest.raises(openai.RateLimitError) as e:
            s.client.completions.create(model="double", prompt="b", max_tokens=2)
        assert e.value.body["code"] == "queue_full"
        engine.gate.set()
        first.join(10)
        assert s.client.completions.create(model="double", prompt="c", max_tokens=2).choices[0].text == "ab"
    finally:
        engine.gate.set()
        s.stop()


def test_a_server_that_cannot_bind_its_port_exits_with_an_error():
    """server.run steps the engine on the main thread and serves HTTP on another: when that one
    cannot start (the port is taken), the process exits non-zero at once, saying so, not waits."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        r = subprocess.run([sys.executable, str(TESTS / "serving_double.py"), str(port), "1.0"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"127.0.0.1:{port}" in r.stderr and "--port" in r.stderr, r.stderr[-2000:]


def test_sigterm_drains_in_flight_requests_then_exits_zero():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, str(TESTS / "serving_double.py"), str(port), "1.0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: _healthy(port), 30)
        short = {}

        def ask_short():  # 10 tokens at 50 ms: done within the 1 s grace
            short["r"] = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "s", "max_tokens": 10},
                                    timeout=30)

        asker = threading.Thread(target=ask_short)
        asker.start()
        got = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                          json={"prompt": "x", "max_tokens": 1000, "stream": True}, timeout=30) as r:
            for line in r.iter_lines():
                got.append(line)
                if len(got) == 2:
                    proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(10) == 0, proc.stdout.read()
        assert time.monotonic() - t0 < 5
        asker.join(10)
        assert short["r"].status_code == 200 and short["r"].json()["choices"][0]["text"] == "abcdefghij"
        events = [json.loads(g[6:]) for g in got if g.startswith("data: {")]
        assert events[-1]["error"]["code"] == "shutting_down"  # aborted past the 1 s grace, and told so
        assert [g for g in got if g][-1] == "data: [DONE]"
    finally:
        if proc.poll() is None:
            proc.kill()


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ---- the real engine over a tiny random Llama (SmolLM2's tokenizer and chat template, offline) ----
CONTEXT = 4096


def tiny_llama(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from flexplan.smollm import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir(verbose=False))


@pytest.fixture(scope="module")
def real(tokenizer):
    import torch

    from flexplan.serving.engine import Engine

    torch.set_num_threads(1)
    engine = Engine(tiny_llama(tokenizer), tokenizer, device_blocks=0, host_blocks=2 * CONTEXT // 16)
    s = Running(engine, name="tiny-llama")
    yield s
    s.stop()
    engine.close()


def alone(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy generate() on the prompt alone (ignoring EOS, as the requests below do)."""
    import torch

    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_real_engine_concurrent_greedy_requests_equal_generate_alone(real, tokenizer):
    reference = tiny_llama(tokenizer)  # the same seed: the same weights, untouched by the engine
    prompts = ["The capital of France is", "Hello", "1 2 3 4 5 6 7 8 9 10 11 12"]
    results = {}

    def ask(i, p):
        results[i] = real.client.completions.create(model="tiny-llama", prompt=p, max_tokens=6 + i, temperature=0,
                                                    extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, p in enumerate(prompts):
        ids = tokenizer.encode(p)
        want = alone(reference, ids, 6 + i)
        got = results[i]
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 6 + i)
        assert got.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)


def test_real_engine_seeded_sampling_repeats_and_metrics_show_both_pools(real):
    def ask():
        return real.client.completions.create(model="tiny-llama", prompt="Once", max_tokens=8, temperature=1.0,
                                              top_p=0.9, seed=7, extra_body={"top_k": 50, "ignore_eos": True})

    assert ask().choices[0].text == ask().choices[0].text
    text = httpx.get(f"{real.url}/metrics").text
    for pool in ("device", "host"):
        assert f'flexplan_kv_blocks_free{{model_name="tiny-llama",pool="{pool}"}}' in text


def test_real_engine_conversation_turns_reuse_their_prefix(real, tokenizer):
    """A conversation's second turn re-sends the first: its prompt's leading blocks come from the
    prefix cache (/metrics' hits grow by at least the first turn's whole blocks), and its greedy
    text is what transformers gives on that prompt alone."""
    reference = tiny_llama(tokenizer)

    def hits() -> float:
        text = httpx.get(f"{real.url}/metrics").text
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith('flexplan_prefix_cache_hits_total{model_name="tiny-llama"}')))

    first = [{"role": "system", "content": "You answer briefly. " * 6}, {"role": "user", "content": "Hi there"}]
    r1 = real.client.chat.completions.create(model="tiny-llama", messages=first, max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True})
    before = hits()
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "And again?"}]
    r2 = real.client.chat.completions.create(model="tiny-llama", messages=second, max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert hits() - before >= r1.usage.prompt_tokens // 16 * 16 > 0
    ids = tokenizer.encode(tokenizer.apply_chat_template(second, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    assert r2.choices[0].message.content == tokenizer.decode(alone(reference, ids, 4), skip_special_tokens=True)


def test_real_engine_chat_stream_uses_the_chat_template(real, tokenizer):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    chunks = list(real.client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=5, stream=True,
                                                      temperature=0, stream_options={"include_usage": True}))
    templated = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.encode(templated, add_special_tokens=False))
    assert chunks[-1].usage.completion_tokens <= 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_real_engine_context_errors_then_serves(real):
    r = httpx.post(f"{real.url}/v1/completions", json={"prompt": list(range(10, 10 + CONTEXT))})
    assert r.status_code == 400 and _error(r)["code"] == "context_length_exceeded"
    r = httpx.post(f"{real.url}/v1/completions", json={"prompt": "hi", "max_tokens": CONTEXT})
    assert r.status_code == 400 and _error(r)["param"] == "max_tokens"
    r = httpx.post(f"{real.url}/v1/completions", json={"prompt": [10**7]})  # outside the vocabulary
    assert r.status_code == 400 and "vocabulary" in _error(r)["message"] and _error(r)["param"] == "prompt"
    assert real.client.completions.create(model="tiny-llama", prompt="ok", max_tokens=2).usage.completion_tokens >= 1


def test_real_engine_client_leaving_mid_stream_frees_its_kv(real):
    before = _aborted(real)
    body = {"prompt": "go on", "max_tokens": CONTEXT - 10, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{real.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
    wait_until(lambda: _aborted(real) > before)
    stats = real.engine.stats()
    assert sum(stats.running_by_device.values()) == 0 and stats.waiting == 0
    assert stats.blocks_used == {"device": 0, "host": 0}


def test_a_placed_model_served_over_http_equals_generate_alone(tokenizer):
    """A FlexModel (the planner's placement on the CPU stand-in: streamed prefill, SplitGen decode)
    behind the server: the openai client's greedy text equals generate() alone, and /metrics counts
    the iterations by the placement each ran under."""
    import torch

    import flexplan.api as api
    from flexplan.executor.plans import fixed_plan
    from flexplan.serving.engine import Engine

    torch.set_num_threads(1)
    reference = tiny_llama(tokenizer)
    plan = fixed_plan(reference.config, "gpu-offload", "splitgen", 1, batch_size=1, input_len=8, output_len=8,
                      gpu_memory_bytes=1 << 30)
    lm = api.load(tiny_llama(tokenizer), plan=plan, accelerator="cpu", gpu_memory_bytes=1 << 30)
    engine = Engine(lm, tokenizer, device_blocks=8, host_blocks=64)
    s = Running(engine, name="placed")
    try:
        for prompt in ("The capital of France is", "1 2 3"):
            got = s.client.completions.create(model="placed", prompt=prompt, max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True})
            want = alone(reference, tokenizer.encode(prompt), 6)
            assert got.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
        text = httpx.get(f"{s.url}/metrics").text
        counted = [line for line in text.splitlines() if line.startswith("flexplan_placed_iterations_total{")]
        assert counted and sum(float(line.split()[-1]) for line in counted) > 0
    finally:
        s.stop()
        engine.close()


@pytest.mark.parametrize("args, says", [
    (["--prefill", "gpu-offload"], "add --accelerator"),
    (["--accelerator", "cpu", "--device", "cpu"], "give one of them"),
])
def test_flexplan_serve_placement_flags_refused_with_what_works(args, says, capsys, tokenizer):
    from flexplan.cli import main

    assert main(["serve", *args, "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


@pytest.mark.parametrize("flag, value, says", [("--tpot-target-ms", "0", "milliseconds"),
                                               ("--tpot-target-ms", "-5", "milliseconds"),
                                               ("--tpot-target-ms", "nan", "milliseconds"),
                                               ("--tpot-target-ms", "fast", "milliseconds"),
                                               ("--port", "99999", "0-65535"), ("--port", "http", "port number")])
def test_flexplan_serve_refuses_a_bad_flag_saying_what_works(flag, value, says, capsys):
    from flexplan.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and says in err


def _serve(args: list[str], port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flexplan", "serve", *args, "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@contextlib.contextmanager
def _served(args: list[str], start_s: float = 120):
    """`flexplan serve ARGS` on a free port, healthy: (its process, an openai client); killed if still
    running at the end (a test that stops it checks how)."""
    port = free_port()
    proc = _serve(args, port)
    try:
        wait_until(lambda: _healthy(port) or proc.poll() is not None, start_s)
        assert proc.poll() is None, proc.stdout.read()
        yield proc, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()


def _tiny_folder(tmp_path, tokenizer):
    folder = tmp_path / "tiny-llama"
    tiny_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_flexplan_serve_a_model_folder_then_sigterm_exits_zero(tmp_path, tokenizer):
    with _served([str(_tiny_folder(tmp_path, tokenizer)), "--cpu-memory", "0.05", "--drain-s", "1"]) as (proc, client):
        assert next(m.id for m in client.models.list()) == "tiny-llama"
        r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
        assert 1 <= r.usage.completion_tokens <= 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.stdout.read()


@pytest.mark.slow
def test_flexplan_serve_without_a_model_serves_the_embedded_smollm2():
    with _served([], start_s=300) as (proc, client):
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


@pytest.mark.slow
def test_flexplan_serve_places_a_model_with_accelerator(tmp_path, tokenizer):
    """`flexplan serve FOLDER --accelerator cpu` loads it through the planner and serves it."""
    args = [str(_tiny_folder(tmp_path, tokenizer)), "--accelerator", "cpu", "--prefill", "gpu-offload", "--decode",
            "splitgen", "--gpu-layers", "1", "--gpu-memory", "0.5", "--cpu-memory", "0.05"]
    with _served(args) as (proc, client):
        r = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == tokenizer.decode(alone(tiny_llama(tokenizer), tokenizer.encode("Hello"), 5),
                                                     skip_special_tokens=True)
        port = int(str(client.base_url).split(":")[-1].split("/")[0])
        assert 'flexplan_placed_iterations_total{' in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.stdout.read()


@pytest.mark.slow
def test_flexplan_serve_on_a_port_in_use_exits_2_naming_it(tmp_path, tokenizer):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = _serve([str(_tiny_folder(tmp_path, tokenizer)), "--cpu-memory", "0.05"], port)
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2, out
    assert f"flexplan serve: error: the HTTP server on 127.0.0.1:{port}" in out and "--port" in out


def test_flexplan_serve_on_a_folder_without_a_model_is_one_line_and_exit_2(tmp_path, capsys, tokenizer):
    from flexplan.cli import main

    assert main(["serve", str(tmp_path), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flexplan serve: error: could not load") and "\n" not in err


def test_flexplan_serve_without_the_serve_extra_says_how_to_install_it(monkeypatch, capsys, tokenizer):
    import importlib.util

    from flexplan import serve_cmd
    from flexplan.cli import main

    real_find = importlib.util.find_spec
    monkeypatch.setattr(serve_cmd.importlib.util, "find_spec", lambda n, *a: None if n == "fastapi" else real_find(n, *a))
    assert main(["serve"]) == 2
    assert "pip install 'flexplan-infer[serve]'" in capsys.readouterr().err

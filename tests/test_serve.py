"""`mlx-fastops serve` (mlx_lm.server on the patched model) as a process on a free loopback port,
queried over HTTP: greedy answers equal stock mlx_lm.server's on the same model directory, with
requests in flight together (mlx-lm batches them: BatchKVCache, rows of different lengths that
finish at different steps), streaming and not; clean shutdown on SIGINT and SIGTERM; command lines
refused before any model work; the seam (mlx_lm.server's ModelProvider) and its warm-up (a
decode at each batch size before serving) in process; the load generator benchmarks/serve_load.py
against real servers. Every wait is bounded; every process started here is stopped in a finally
block."""

import contextlib
import importlib.util
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest
from loopback import free_port, port_is_free
from mlx_lm.models.cache import QuantizedKVCache

import mlx_fastops
from mlx_fastops import serve
from mlx_fastops.cli import main

ROOT = Path(__file__).resolve().parents[1]
UP_TIMEOUT = 60      # s for a server to answer /health
HTTP_TIMEOUT = 60    # s per request
STOP_TIMEOUT = 30    # s from a signal to the exit
COMMANDS = {"stock": [sys.executable, "-m", "mlx_lm", "server"],
            "patched": [sys.executable, "-m", "mlx_fastops", "serve"]}

# (endpoint, body, stream): in flight together; different prompt lengths (one past the KV cache's
# 256-token step) and max_tokens, so rows join the batch with different left padding and finish
# at different steps.
REQUESTS = [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 12}, False),
    ("/v1/completions", {"prompt": "a longer prompt, " * 18, "max_tokens": 7}, True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}, False),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "tell me more"}], "max_tokens": 5}, True),
    ("/v1/completions", {"prompt": "x", "max_tokens": 20}, True),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A float model (float32 activations: greedy decoding is deterministic on the CPU)."""
    return mlx_fastops.save_synthetic("qwen3-tiny", tmp_path_factory.mktemp("model") / "qwen3-tiny", bits=None)


def _load_serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serve_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The load generator's module: its sigint_default starts these servers too (a CI script run with `&`
# would leave SIGINT ignored in them, and the SIGINT tests would wait out STOP_TIMEOUT).
SERVE_LOAD = _load_serve_load()


class Server:
    def __init__(self, kind, model, log, flags=()):
        self.port, self.log = free_port(), log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([*COMMANDS[kind], "--model", str(model), "--port", str(self.port), *flags],
                                         stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                         preexec_fn=SERVE_LOAD.sigint_default)

    def wait_up(self):
        deadline = time.monotonic() + UP_TIMEOUT
        while self.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            time.sleep(0.2)
        raise AssertionError(f"server not up (exit status {self.proc.poll()}):\n{self.text()[-3000:]}")

    def stop(self, sig=signal.SIGINT):
        """The exit status after `sig`."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT)
                raise AssertionError(f"no exit {STOP_TIMEOUT} s after {sig!r}:\n{self.text()[-3000:]}") from None
        return self.proc.returncode

    def text(self):
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def running(kind, model, tmp_path, flags=()):
    server = Server(kind, model, tmp_path / f"{kind}-{time.monotonic_ns()}.log", flags)
    try:
        yield server.wait_up()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(STOP_TIMEOUT)


def ask(port, endpoint, body, stream):
    """(text, finish_reason, completion tokens) of one greedy request, streamed or not."""
    body = {**body, "temperature": 0.0, "stream": stream, **({"stream_options": {"include_usage": True}}
                                                            if stream else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{endpoint}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    chat = "chat" in endpoint
    with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as r:
        if not stream:
            answer = json.load(r)
            choice = answer["choices"][0]
            return (choice["message"]["content"] if chat else choice["text"], choice["finish_reason"],
                    answer["usage"]["completion_tokens"])
        text, finish, usage = "", None, None
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text += (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")
                finish = choice["finish_reason"] or finish
        return text, finish, usage


def answers(port):
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        futures = [pool.submit(ask, port, *r) for r in REQUESTS]
        return [f.result(timeout=2 * HTTP_TIMEOUT) for f in futures]


def test_the_provider_patches_each_model_it_loads_and_judges_batching_on_it(model_dir, monkeypatch, capsys):
    """In process, the seam alone: mlx_lm.server's ModelProvider, extended. A patched model whose
    caches could not merge into a batch is served one request at a time (the server's own rule)."""
    args = serve.server_args(["--model", str(model_dir)])
    provider = serve.patching_provider("gate_up", threading.Event())(args)
    model, _ = provider.load("default_model")
    assert mlx_fastops.is_patched(model) and provider.is_batchable
    assert ("gate_up", "disabled") in {(e.fusion, e.reason) for e in mlx_fastops.patch(model).skipped}
    assert f"[serve] {model_dir}: patched\nmlx_fastops patch: family=qwen3" in capsys.readouterr().err

    real = mlx_fastops.patch

    def patch_with_unmergeable_caches(model, disable):
        report = real(model, disable=disable)
        object.__setattr__(model, "make_cache", lambda: [QuantizedKVCache() for _ in model.layers])
        return report

    monkeypatch.setattr(mlx_fastops, "patch", patch_with_unmergeable_caches)
    provider = serve.patching_provider("", threading.Event(), 2)(args)
    provider.load("default_model")
    assert provider.is_batchable is False
    assert capsys.readouterr().err.endswith("[serve] warm-up: skipped, the model is served one request at a time\n")


def test_the_provider_warms_up_each_model_once_patched(model_dir, monkeypatch, capsys):
    calls = []   # (patched?, rows) per warm_up call

    def warm_up(model, rows):
        calls.append((mlx_fastops.is_patched(model), rows))
        return [1.0, 0.5], 2.0

    monkeypatch.setattr(serve, "warm_up", warm_up)
    args = serve.server_args(["--model", str(model_dir)])
    serve.patching_provider("", threading.Event(), 2)(args).load("default_model")
    assert calls == [(True, 2)]
    assert capsys.readouterr().err.endswith("[serve] warm-up: decode of 1-2 rows in 1.5 s "
                                                "(longest: 1 rows 1.0 s, 2 rows 0.5 s); prompts of 2-64 rows in 2.0 s\n")


def test_no_warm_up_where_the_server_never_batches(model_dir, monkeypatch, capsys):
    monkeypatch.setattr(serve, "warm_up", lambda model, rows: pytest.fail("warmed up"))
    args = serve.server_args(["--model", str(model_dir), "--kv-bits", "8"])   # mlx_lm.server: one at a time
    serve.patching_provider("", threading.Event(), 2)(args).load("default_model")
    assert capsys.readouterr().err.endswith("[serve] warm-up: skipped, the model is served one request at a time\n")


def test_a_failed_warm_up_stops_the_load_and_says_so(model_dir, monkeypatch):
    def warm_up(model, rows):
        raise MemoryError("out of memory at 2 rows")

    monkeypatch.setattr(serve, "warm_up", warm_up)
    provider = serve.patching_provider("", threading.Event(), 2)(serve.server_args(["--model", str(model_dir)]))
    with pytest.raises(RuntimeError, match=r"the warm-up failed \(MemoryError: out of memory at 2 rows\); "
                                           r"--warm-up-rows 0 skips it"):
        provider.load("default_model")
    assert provider.model is None   # reset: the server does not go on with this model cold


class _Shapes:
    """A model as BatchGenerator uses it, recording the (batch, tokens) shape of every call."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, inputs, *args, **kwargs):
        self.calls.append(tuple(inputs.shape))
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_warm_up_runs_the_servers_shapes_and_leaves_the_model_as_it_was():
    """What the model sees: a decode step at every batch size, then every prompt chunk of 2-64 rows
    alone and the batches of up to 8 rows (equal and padded lengths), as their own prefill calls."""
    from mlx_lm.models.cache import make_prompt_cache

    model = mlx_fastops.synthetic_model("qwen3-tiny")
    mlx_fastops.patch(model)
    tokens = mx.array([[5, 17, 300, 9]])
    before = model(tokens, cache=make_prompt_cache(model))
    seen = _Shapes(model)
    decode, prompts = serve.warm_up(seen, 3)
    assert len(decode) == 3 and all(t > 0 for t in decode) and prompts > 0
    steps = [c for c in seen.calls if c[1] == 1]
    assert {(b, 1) for b in (1, 2, 3)} <= set(steps) and {c[0] for c in steps} <= {1, 2, 3, 4}
    chunks = [c for c in seen.calls if c[1] > 1]
    few = [(2, 2), (2, 3), (2, 4), (3, 2), (4, 2)]
    assert chunks == [(1, n) for n in range(2, serve.WARM_UP_PROMPT_ROWS + 1)] + [c for c in few for _ in "ep"]
    assert mx.array_equal(model(tokens, cache=make_prompt_cache(model)), before)


@pytest.mark.parametrize("requested, backend, concurrency, rows", [
    (None, "cuda", (32, 8), 32),         # the server's --decode-concurrency, --prompt-concurrency defaults
    (None, "cuda", (4, 16), 16),         # its BatchGenerator decodes up to the larger
    (None, "metal", (32, 8), 0),
    (None, "reference", (32, 8), 0),
    (0, "cuda", (32, 8), 0),
    (3, "reference", (32, 8), 3),
])
def test_warm_up_rows_default_by_backend(requested, backend, concurrency, rows):
    cli_args = serve.server_args(["--decode-concurrency", str(concurrency[0]),
                                  "--prompt-concurrency", str(concurrency[1])])
    assert serve.rows_to_warm_up(requested, backend, cli_args) == rows


# (the patched server's flags, the patterns of its warm-up lines): on the CPU none unless asked for
@pytest.mark.parametrize("flags, warm_up_lines", [
    ([], []),
    (["--warm-up-rows", "3"], [r"\[serve\] warm-up: decode of 1-3 rows in \d+\.\d s \(longest: (\d rows \d+\.\d s(, )?){3}\); prompts of 2-64 rows in \d+\.\d s"]),
], ids=["default", "warm-up-rows-3"])
def test_greedy_answers_equal_stock_servers(model_dir, tmp_path, flags, warm_up_lines):
    results, logs = {}, {}
    for kind in ("stock", "patched"):
        with running(kind, model_dir, tmp_path, flags if kind == "patched" else ()) as server:
            results[kind] = answers(server.port)
            server.stop(signal.SIGINT)
            logs[kind] = server.text()
    assert results["patched"] == results["stock"]
    for (_, body, _), (text, finish, n) in zip(REQUESTS, results["stock"]):
        assert (finish, n) == ("length", body["max_tokens"]) and text   # every row ran to its own length
    assert len({text for text, _, _ in results["stock"]}) == len(REQUESTS)
    report = logs["patched"].split(f"[serve] {model_dir}: patched\n", 1)[1]
    assert report.startswith("mlx_fastops patch: family=qwen3 backend=reference\n")
    assert "| qkv | fused | reference | 2 |" in report and "| lm_head | fused | reference | 1 |" in report
    assert "mlx_fastops patch" not in logs["stock"]
    warm_ups = [line for line in logs["patched"].splitlines() if line.startswith("[serve] warm-up")]
    assert len(warm_ups) == len(warm_up_lines), logs["patched"]
    assert all(re.fullmatch(pattern, line) for pattern, line in zip(warm_up_lines, warm_ups)), warm_ups


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_shuts_down_cleanly_with_a_request_in_flight(model_dir, tmp_path, sig):
    with running("patched", model_dir, tmp_path) as server:
        body = {"prompt": "go on", "max_tokens": 4000, "temperature": 0.0, "stream": True}
        req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as r:
            while not (line := r.readline()).startswith(b"data: "):   # the first token: generation runs
                assert line, "the stream ended before its first token"
            assert server.stop(sig) == 0
        assert port_is_free(server.port)
        assert "Traceback" not in server.text()


def test_a_model_that_cannot_be_patched_stops_the_server(model_dir, tmp_path):
    """mlx-lm loads it, patch() refuses it: exit status 1 and the reason, not a server that never answers."""
    from mlx_lm.utils import _get_classes, save_config, save_model

    cfg = {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
           "num_attention_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 4096, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "rope_theta": 10000.0, "eos_token_id": 1}
    folder = tmp_path / "phi3"
    shutil.copytree(model_dir, folder)   # the tokenizer
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    Model, Args = _get_classes(cfg)
    save_model(folder, Model(Args.from_dict(cfg)))
    save_config(cfg, folder / "config.json")
    server = Server("patched", folder, tmp_path / "phi3.log")
    try:
        assert server.proc.wait(UP_TIMEOUT) == 1
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(STOP_TIMEOUT)
    assert "unsupported model family 'phi3'" in server.text()
    assert server.text().rstrip().endswith("could not be loaded, patched and warmed up (see above); server stopped")


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "abc"], "argument --port: invalid int value: 'abc'"),
    (["serve", "--port", "{free}", "--max-tokens"], "argument --max-tokens: expected one argument"),
    (["serve", "--port", "{busy}"], "cannot listen on 127.0.0.1 port {busy}: Address already in use"),
    (["serve", "--port", "{free}", "--model", "no/such/dir"], "no such directory"),
    (["serve", "--port", "{free}", "--bits", "4", "--model", "{dir}"], "--bits: for synthetic models only"),
    (["serve", "--port", "{free}", "--warm-up-rows", "-1"], "argument --warm-up-rows: must be at least 0, got -1"),
    (["bench", "--port", "8080"], "unrecognized arguments: --port 8080"),   # only serve passes flags on
])
def test_bad_command_lines_are_refused(argv, message, busy_port, model_dir, monkeypatch, capsys):
    def serve_(*a, **k):   # the real one would build the model, serve, and end this process
        raise AssertionError("a bad command line reached the server")

    monkeypatch.setattr(serve, "serve", serve_)
    fill = {"busy": busy_port, "free": free_port(), "dir": model_dir}
    assert main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message.format(**fill) in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def serve_load():
    return SERVE_LOAD


def _check_rows(doc, servers, clients, per_client, max_tokens):
    assert [(r["server"], r["clients"]) for r in doc["rows"]] == [(s, c) for s in servers for c in clients]
    for r in doc["rows"]:
        assert (r["requests"], r["errors"]) == (r["clients"] * per_client, 0)
        assert r["completion_tokens"] == r["requests"] * max_tokens
        assert r["tok_s"] == pytest.approx(r["completion_tokens"] / r["wall_s"])
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] < 1e3 * r["wall_s"]
        assert 0 < r["token_ms"]["p50"] <= r["token_ms"]["p99"]
    assert doc["machine"]["mlx"] and doc["machine"]["sources"]


def test_load_generator_against_a_running_server(serve_load, model_dir, tmp_path):
    out = tmp_path / "load"
    with running("patched", model_dir, tmp_path) as server:
        assert serve_load.main(["--url", f"patched=http://127.0.0.1:{server.port}", "--clients", "1,3",
                                "--requests-per-client", "2", "--max-tokens", "4", "--prompt-words", "4",
                                "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    _check_rows(doc, ["patched"], [1, 3], 2, 4)
    assert doc["exit_status"] == {} and "ratio" not in doc["rows"][0]
    assert "| patched | 3 | 6 | 0 |" in out.with_suffix(".md").read_text()


def test_load_generator_starts_stock_then_patched(serve_load, model_dir, tmp_path):
    out = tmp_path / "load"
    assert serve_load.main(["--model", str(model_dir), "--clients", "2", "--requests-per-client", "1",
                            "--max-tokens", "3", "--prompt-words", "2", "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    _check_rows(doc, ["stock", "patched"], [2], 1, 3)
    stock, patched = doc["rows"]
    assert patched["ratio"] == patched["tok_s"] / stock["tok_s"] and "ratio" not in stock
    assert doc["exit_status"]["patched"] == 0
    assert doc["patch_report"].startswith("mlx_fastops patch: family=qwen3 backend=reference\n")
    assert set(doc["startup_s"]) == {"stock", "patched"} and all(v > 0 for v in doc["startup_s"].values())
    assert doc["warm_up"] is None   # the reference backend's default: no warm-up


@pytest.mark.parametrize("argv, message", [
    (["--url", "x=http://192.0.2.1:8080"], "not a loopback address (192.0.2.1)"),
    (["--url", "x=https://127.0.0.1:8080"], "expected http://HOST:PORT"),
    (["--url", "http://127.0.0.1:8080"], "expected LABEL=URL"),
    (["--clients", "1,65"], "client counts from 1 to 64"),
    (["--requests-per-client", "65"], "argument --requests-per-client: invalid choice: 65"),
])
def test_load_generator_refuses(serve_load, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        serve_load.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err

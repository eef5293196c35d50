"""Each CLI command end to end on a tiny synthetic model; every bad command line refused before any
model work; verify's standard (bit-exact in float32 on the reference path, judged by the float32
evaluation in half precision); a saved synthetic model directory loaded by mlx-lm itself."""

import io
import json
import re
import subprocess
import sys

import mlx.core as mx
import pytest

import mlx_fastops
from mlx_fastops import bench, models
from mlx_fastops.backends import reference
from mlx_fastops.cli import build_parser, main
from mlx_fastops.synthetic import CONFIGS

TINY = ["--model", "qwen3-tiny"]


def test_bench_json_and_table(tmp_path, capsys):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    assert main(["bench", *TINY, "-p", "16,40", "-g", "4", "-n", "2", "--json", str(out), "--markdown", str(md)]) == 0
    text = capsys.readouterr()
    for test in ("pp16", "tg4 @16", "pp40", "tg4 @40"):
        assert f"| qwen3-tiny (synthetic, 4-bit g64) | 4-bit g64 | {test} |" in text.out
    assert "| 5/5 |" in text.out   # the float32 reference path: every greedy token equals stock's
    assert "[bench]" in text.err   # progress
    assert "[INFO] Quantized model" in text.err and "[INFO]" not in text.out   # mlx-lm's notes stay off the table
    assert md.read_text().startswith("# mlx-fastops bench\n") and "mlx_fastops patch:" in md.read_text()
    doc = json.loads(out.read_text())
    assert doc["machine"]["mlx"] and doc["machine"]["sources"] and doc["settings"]["trials"] == 2
    (result,) = doc["models"]
    assert result["variants"] == ["stock", "patched"] and list(result["patch"]) == ["patched"]
    assert [(r["kind"], r["prompt"], r["gen"]) for r in result["rows"]] == [
        ("pp", 16, 4), ("tg", 16, 4), ("pp", 40, 4), ("tg", 40, 4)]
    for row in result["rows"]:
        stock, patched = row["variants"]["stock"], row["variants"]["patched"]
        assert len(stock["samples"]) == len(patched["samples"]) == 2
        assert stock["min"] <= stock["median"] <= stock["max"] and patched["peak_memory_gb"] > 0
        assert patched["ratio"] == patched["median"] / stock["median"]
        assert patched["agreement"] == {"matching": 5, "tokens": 5, "per_trial": [5, 5]}


def test_bench_several_models_and_a_variant(tmp_path):
    """Two models in one run, each beside a copy patched without one fusion; -g 0: prompt rows only."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "qwen3-tiny,llama-tiny", "-p", "8", "-g", "0", "-n", "1", "--warmup", "0",
                 "--variant", "gate_up", "-q", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["model"].split(" ")[0] for r in doc["models"]] == ["qwen3-tiny", "llama-tiny"]
    for result in doc["models"]:
        assert result["variants"] == ["stock", "patched", "without gate_up"]
        assert [r["test"] for r in result["rows"]] == ["pp8"]
        fused = {name: {s["fusion"] for s in report["summary"] if s["status"] == "fused"}
                 for name, report in result["patch"].items()}
        assert fused["without gate_up"] == fused["patched"] - {"gate_up"} and "gate_up" in fused["patched"]


def test_bench_kv_bits_adds_the_patched_model_over_a_quantised_cache(tmp_path, monkeypatch):
    """--kv-bits 8: a third column, the patched model with generate_step's kv_bits=8 from the first
    token (mlx-lm's conversion sees it); stock and patched keep the float cache."""
    step_module = sys.modules["mlx_lm.generate"]   # (mlx_lm.generate is also a function's name)
    seen, convert = [], step_module.maybe_quantize_kv_cache
    def spy(prompt_cache, quantized_kv_start, kv_group_size, kv_bits):
        seen.append((kv_bits, kv_group_size, quantized_kv_start))
        return convert(prompt_cache, quantized_kv_start, kv_group_size, kv_bits)

    monkeypatch.setattr(step_module, "maybe_quantize_kv_cache", spy)
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    assert main(["bench", *TINY, "-p", "8", "-g", "2", "-n", "1", "--warmup", "0", "-q", "--kv-bits", "8",
                 "--json", str(out), "--markdown", str(md)]) == 0
    (result,) = json.loads(out.read_text())["models"]
    assert result["variants"] == ["stock", "patched", "patched kv8"]
    assert all(r["variants"]["patched kv8"]["median"] > 0 for r in result["rows"])
    assert (8, 64, 0) in seen and {bits for bits, _, _ in seen} == {None, 8}
    assert "patched kv8: the patched model generating with mlx-lm's kv_bits=8" in md.read_text()


def test_bench_on_a_cpu_takes_the_cpu_plan_and_says_how_long(tmp_path, monkeypatch, capsys):
    """--model named, no GPU: the CPU plan (-p 32 -g 16 -n 3), and a time estimate before the run."""
    monkeypatch.setattr(models, "on_gpu", lambda: False)
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--json", str(out)]) == 0
    settings = json.loads(out.read_text())["settings"]
    assert (settings["prompts"], settings["gen"], settings["trials"]) == ([32], 16, 3)
    err = capsys.readouterr().err
    assert "qwen3-tiny (synthetic, 4-bit g64): about " in err and "for -p 32 -g 16, 4 rounds of 2 variants" in err
    assert "-token prefill took " in err and "a decode step " in err


def test_estimate_is_the_measured_pass_times_the_plan():
    model = mlx_fastops.synthetic_model("qwen3-tiny")
    e = bench.estimate(model, [8, 40], 5, rounds=3, n_variants=2)
    assert e["prefill_tokens"] == 8 and e["prefill_s"] > 0 and e["step_s"] > 0
    per_round = (8 + 40) * e["prefill_s"] / 8 + 2 * 5 * e["step_s"]
    assert e["seconds"] == pytest.approx(2 * 3 * per_round)


def test_progress_moves_within_a_generation():
    """Ticks report the tokens so far inside each generation (here: every token, every=0)."""
    model = mlx_fastops.synthetic_model("qwen3-tiny")
    stream = io.StringIO()
    say = bench.Progress("m", every=0, stream=stream)
    bench.compare([("stock", model, None)], [8], 4, trials=1, warmup=0, progress=say.line, tick=say.tick,
                  tick_every=say.every)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[bench] m p=8 trial 1/1 stock: prompt of 8 tokens"
    assert [line.split(": ")[1] for line in lines[1:-1]] == [f"{k}/5 tokens" for k in range(1, 6)]
    assert " tok/s" in lines[-1]


def test_bench_batched_through_batch_generator():
    """batch=B: B rows at once through mlx-lm's BatchGenerator, rates of all B rows' tokens; on the
    reference path patched generates stock's tokens."""
    model = mlx_fastops.synthetic_model("qwen3-tiny")
    res = bench.run(model, "m", prompts=[8], gen=4, trials=1, warmup=0, progress=False, batch=3)
    mlx_fastops.unpatch(model)
    assert [r["test"] for r in res["rows"]] == ["pp8 x3", "tg4 @8 x3"]
    patched = res["rows"][1]["variants"]["patched"]
    assert patched["agreement"]["matching"] == 5 and patched["median"] > 0


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert main(["bench", *TINY, "-p", "8", "-g", "2", "-n", "1", "-q", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_generate_synthetic(capsys):
    assert main(["generate", *TINY, "--prompt", "t5 t6 hello", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count(" t") >= 8 and "Generation: 8 tokens" in out


def test_profile_and_trace(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert main(["profile", *TINY, "-n", "3", "--warmup", "1", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "| qkv_proj | 2 |" in out and "host time to build" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {"qkv_proj", "gate_up_silu", "lm_head"} <= {e["name"] for e in events}


# profile --prefill, stock and patched: ops of the chunk in the table (mlx-lm never evaluates a prefill
# chunk's logits: no lm_head), their sum beside the unsynchronised chunk
PREFILL = [([], "patched", {"qkv_proj", "qk_norm_rope", "flash_attention", "o_proj", "rms_norm_residual",
                            "gate_up_silu", "down_proj", "kv_cache_update"}),
           (["--stock"], "stock", {"q_proj", "q_norm", "rope", "sdpa", "o_proj", "post_attention_layernorm",
                                   "gate_proj", "swiglu", "down_proj", "kv_cache_update"})]


@pytest.mark.parametrize("flags,variant,ops", PREFILL)
def test_profile_prefill(flags, variant, ops, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert main(["profile", *TINY, "--prefill", "24", "--prompt-tokens", "30", "-n", "2", "--warmup", "1",
                 "--trace", str(trace), *flags]) == 0
    out = capsys.readouterr().out
    assert f"({variant}), device" in out and "compiled decode step" not in out
    assert "| op | calls/chunk | ms/chunk (median) | share |" in out
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
             if line.startswith("| ") and line.count("|") == 5]
    table = {row[0]: row[1:] for row in cells[cells.index(["op", "calls/chunk", "ms/chunk (median)", "share"]) + 1:]}
    total = float(table.pop("**total (ops evaluated one by one)**")[1])
    assert ops <= set(table) and "lm_head" not in table
    ms = [float(v[1]) for v in table.values()]
    assert all(t > 0 for t in ms) and total == pytest.approx(sum(ms), abs=1e-3 * len(ms))
    found = re.search(r"Prefill chunk of 24 tokens after 30 cached tokens, unsynchronised .*: ([\d.]+) ms = \d+ tok/s "
                      r"\(median of 2 chunks after 1 warm-up; the ops one by one: ([\d.]+)x that\)", out)
    assert found and float(found[1]) > 0 and float(found[2]) == pytest.approx(total / float(found[1]), abs=0.01)
    assert ops <= {e["name"] for e in json.loads(trace.read_text())["traceEvents"]}


# --- bad command lines: exit 2, one line naming the problem, nothing loaded ---

NO_METAL = pytest.mark.skipif(mx.metal.is_available(), reason="this machine has Metal")
BAD = [
    (["bench", "-n", "0"], "argument -n/--num-trials: must be at least 1, got 0"),
    (["bench", "-g", "-1"], "argument -g/--generation-tokens: must be at least 0, got -1"),
    (["bench", "-p", "-5"], "argument -p/--prompt-tokens: must be at least 1, got -5"),
    (["bench", "-p", "0"], "argument -p/--prompt-tokens: must be at least 1, got 0"),
    (["bench", "-p", ","], "argument -p/--prompt-tokens: expected comma-separated integers"),
    (["bench", "-p", "8,x"], "argument -p/--prompt-tokens: expected an integer, got 'x'"),
    (["bench", "--warmup", "-1"], "argument --warmup: must be at least 0"),
    (["bench", "--kv-bits", "3"], "argument --kv-bits: invalid choice: 3"),
    (["bench", "--variant", "no_such_fusion"], "argument --variant: 'no_such_fusion': unknown fusion name"),
    (["bench", "--variant", ","], "argument --variant: names no fusion"),
    (["bench", "--disable", "qkvv"], "argument --disable: 'qkvv': unknown fusion name"),
    (["bench", "--json", "{tmp}/missing/b.json"], "argument --json: folder {tmp}/missing does not exist"),
    (["bench", "--markdown", "{tmp}/missing/b.md"], "argument --markdown: folder {tmp}/missing does not exist"),
    (["bench", "--plot", "{tmp}/missing/b.png"], "argument --plot: folder {tmp}/missing does not exist"),
    (["bench", "--json", "{tmp}"], "argument --json: {tmp} is a folder"),
    (["bench", "--group-size", "100"], "argument --group-size: invalid choice: 100 (choose from 32, 64, 128)"),
    (["bench", "--bits", "7"], "argument --bits: invalid choice: 7"),
    (["bench", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["bench", "--nosuch"], "unrecognized arguments: --nosuch"),
    (["bench", "--model", "qwen3-tiny,,llama-tiny"], "an empty model name"),
    (["bench", "--model", "/no/such/path"], "--model '/no/such/path': no such directory"),
    (["bench", "--model", "qwen9-huge"], "not a synthetic model (qwen3-0.6b, "),
    (["bench", "--model", "{tmp}/empty"], "{tmp}/empty has no config.json"),
    (["bench", "--model", "{tmp}/file"], "is a file; it takes a model directory"),
    (["bench", "--model", "{tmp}/noweights"], "{tmp}/noweights has no model*.safetensors"),
    (["bench", "--model", "{tmp}/model", "--bits", "8"], "--bits: for synthetic models only"),
    (["bench", "--model", "{tmp}/model", "--group-size", "32"], "--group-size: for synthetic models only"),
    (["tune", "--samples", "2"], "argument --samples: must be at least 4, got 2"),
    (["tune", "--rows", "0"], "argument --rows: must be at least 1, got 0"),
    (["tune", "--prefill", "512,x"], "argument --prefill: expected an integer, got 'x'"),
    (["tune", "--json", "{tmp}/missing/t.json"], "argument --json: folder {tmp}/missing does not exist"),
    (["generate", "-m", "-1"], "argument --max-tokens/-m: must be at least 1, got -1"),
    (["generate", "--prompt", ""], "--prompt is empty"),
    (["verify", "-n", "0"], "argument -n/--num-tokens: must be at least 1, got 0"),
    (["verify", "--prompt-len", "0"], "argument --prompt-len: must be at least 1"),
    (["verify", "--seed", "-1"], "argument --seed: must be at least 0"),
    (["verify", "--model", "qwen3-tiny,llama-tiny"], "--model takes one model here"),
    (["profile", "-n", "0"], "argument -n/--num-tokens: must be at least 1, got 0"),
    (["profile", "--prompt-tokens", "0"], "--prompt-tokens: a decode profile needs at least 1 token before its steps"),
    (["profile", "--prefill", "8", "--prompt-tokens", "-1"], "argument --prompt-tokens: must be at least 0, got -1"),
    (["profile", "--prefill", "0"], "argument --prefill: must be at least 1, got 0"),
    (["profile", "--prefill", "x"], "argument --prefill: expected an integer, got 'x'"),
    (["profile", "--prefill", "8", "-n", "0"], "argument -n/--num-tokens: must be at least 1, got 0"),
    (["profile", "--prefill", "8", "--capture", "{tmp}/x.gputrace"], "--capture records decode steps; it does not take --prefill"),
    (["profile", "--warmup", "-1"], "argument --warmup: must be at least 0"),
    (["profile", "--trace", "{tmp}/missing/t.json"], "argument --trace: folder {tmp}/missing does not exist"),
    pytest.param(["profile", "--capture", "{tmp}/x.gputrace"], "this machine has no Metal device", marks=NO_METAL),
]


@pytest.fixture
def no_model_work(tmp_path, monkeypatch):
    """Model directories that are not, and a guard: a test fails if anything loads a model."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for name in ("noweights", "model"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"model_type": "qwen3"}')
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")

    def load(*a, **k):
        raise AssertionError("a model was loaded for a bad command line")

    monkeypatch.setattr(models, "load", load)
    return tmp_path


def _refused(argv, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err   # one line, no traceback
    return err


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_command_line(argv, message, no_model_work, capsys):
    tmp = str(no_model_work)
    err = _refused([a.replace("{tmp}", tmp) for a in argv], capsys)
    assert err.startswith("mlx-fastops") and message.replace("{tmp}", tmp) in err


@pytest.mark.parametrize("env,message", [({"MLX_FASTOPS_DISABLE": "qkvv"}, "MLX_FASTOPS_DISABLE: unknown fusion"),
                                         ({"MLX_FASTOPS_BACKEND": "tpu"}, "MLX_FASTOPS_BACKEND='tpu'"),
                                         ({"MLX_FASTOPS_TUNE": "sometimes"}, "MLX_FASTOPS_TUNE='sometimes'")])
def test_bad_environment(env, message, no_model_work, monkeypatch, capsys):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert message in _refused(["verify", *TINY], capsys)


@pytest.mark.parametrize("offline,message", [(True, "not in the local Hugging Face cache ({cache}), and HF_HUB_OFFLINE "
                                                    "is set, so it cannot be downloaded"),
                                             (False, "the Hugging Face Hub cannot be reached: ConnectError")])
def test_hub_repo_out_of_reach(offline, message, no_model_work, monkeypatch, capsys):
    from huggingface_hub import constants

    cache = no_model_work / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")   # a closed port: unreachable
    err = _refused(["bench", "--model", "someone/not-cached", "-q"], capsys)
    assert "--model 'someone/not-cached': no such local directory" in err and message.format(cache=cache) in err


def test_help_shows_every_default_and_the_synthetic_names(capsys):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        flags = [a for a in parser._actions if a.dest != "help"]
        for action in flags:
            assert "(default: " in action.help, (name, action.option_strings)
        model = next(a for a in flags if a.dest == "model")
        assert all(synthetic in model.help for synthetic in CONFIGS)
        assert main([name, "--help"]) == 0
        assert capsys.readouterr().out.count("(default:") == len(flags)


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "mlx_fastops", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "bench" in r.stdout and "profile" in r.stdout


# --- verify's standard ---

def _float32_linear(x, w):
    """The reference projection summed in float32, as the GPU kernels do: closer to the float32
    evaluation than stock's half-precision sums, so bf16 tokens may flip at near-ties."""
    if not w.quantized:
        return _stock_linear(x, w)
    y = mx.quantized_matmul(x.astype(mx.float32), w.weight, w.scales.astype(mx.float32),
                            w.biases.astype(mx.float32), transpose=True, group_size=w.group_size, bits=w.bits)
    return (y if w.bias is None else y + w.bias.astype(mx.float32)).astype(x.dtype)


_stock_linear = reference.linear
CHANGES = {
    "none": None,
    "float32 sums": ("linear", _float32_linear),
    "last bits": ("linear", lambda x, w: _stock_linear(x, w) * (1 + 2**-20)),
    "broken gate/up": ("gate_up_silu", lambda x, w: 0.5 * _stock_linear(x, w)[..., : w.splits[0]]),
}


@pytest.mark.parametrize("dtype,change,code,says", [
    ("float32", "none", 0, ["bit-exact", "OK: 24/24 greedy tokens identical, log-probs bit-identical"]),
    ("float32", "last bits", 1, ["24/24 greedy tokens identical, but the log-probs differ by up to"]),
    ("float32", "broken gate/up", 1, ["FAILED: tokens differ from token"]),
    ("bfloat16", "none", 0, ["judged by the same model in float32", "tokens: 24/24 greedy tokens identical",
                             "OK: patched is no further from float32 than stock"]),
    ("bfloat16", "float32 sums", 0, ["tokens differ from token", ": a near-tie, where either half-precision path",
                                     "OK: patched is no further from float32 than stock"]),
    ("bfloat16", "broken gate/up", 1, ["FAILED: patched is further from float32 than stock"]),
])
def test_verify_standard(dtype, change, code, says, monkeypatch, capsys):
    """On the reference path (the changes are to its ops); a bf16 flip at a near-tie comes at token 11."""
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "reference")
    if CHANGES[change]:
        monkeypatch.setattr(reference, *CHANGES[change])
    assert main(["verify", *TINY, "--dtype", dtype, "-n", "24"]) == code
    out = capsys.readouterr().out
    for text in says:
        assert text in out, out


def test_verify_with_float32_oracle(capsys):
    assert main(["verify", "--model", "qwen2-tiny", "-n", "8", "--oracle"]) == 0
    out = capsys.readouterr().out
    assert "| stock |" in out and "| patched |" in out and "top-1 = float32" in out and "clear decisions" in out


def test_saved_synthetic_model_runs_in_mlx_lm(tmp_path):
    path = mlx_fastops.save_synthetic("qwen2-tiny", tmp_path / "m", bits=4)
    r = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(path), "--prompt",
                        "t3 t4 t5", "--max-tokens", "5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Generation: " in r.stdout
    assert main(["verify", "--model", str(path), "-n", "8", "--prompt", "t3 t4 t5"]) == 0


def test_synthetic_model_refuses_a_group_size_mlx_lm_cannot_use():
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        mlx_fastops.synthetic_model("qwen3-tiny", group_size=100)

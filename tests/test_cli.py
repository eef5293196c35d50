"""Each CLI command end to end on a tiny synthetic model, and a saved synthetic model directory
loaded by mlx-lm itself."""

import json
import subprocess
import sys

import pytest

import mlx_fastops
from mlx_fastops.cli import main

TINY = ["--model", "qwen3-tiny"]


def test_bench_json_and_table(tmp_path, capsys):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    assert main(["bench", *TINY, "-p", "16,40", "-g", "4", "-n", "2", "--json", str(out), "--markdown", str(md)]) == 0
    text = capsys.readouterr()
    for test in ("pp16", "tg4 @16", "pp40", "tg4 @40"):
        assert f"| qwen3-tiny (synthetic, 4-bit g64) | 4-bit g64 | {test} |" in text.out
    assert "| 5/5 |" in text.out   # the float32 reference path: every greedy token equals stock's
    assert "[bench]" in text.err   # progress
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


@pytest.mark.parametrize("args", [["-p", "0"], ["-g", "-1"], ["-n", "0"], ["--variant", "no_such_fusion"]])
def test_bench_rejects_bad_settings(args, capsys):
    assert main(["bench", *TINY, "-q", *args]) == 2
    assert "error" in capsys.readouterr().err


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert main(["bench", *TINY, "-p", "8", "-g", "2", "-n", "1", "-q", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_generate_synthetic(capsys):
    assert main(["generate", *TINY, "--prompt", "t5 t6 hello", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count(" t") >= 8 and "Generation: 8 tokens" in out


def test_verify_passes(capsys):
    assert main(["verify", "--model", "llama-tiny", "--bits", "8", "-n", "32"]) == 0
    out = capsys.readouterr().out
    assert "OK: 32/32 greedy tokens identical" in out and "median" in out and "distinct tokens" in out


def test_verify_fails_on_divergence(monkeypatch, capsys):
    # A broken op must be caught: make the fused gate/up return a wrong activation.
    from mlx_fastops.backends import reference

    monkeypatch.setattr(reference, "gate_up_silu", lambda x, w: 0.5 * reference.linear(x, w)[..., : w.splits[0]])
    assert main(["verify", *TINY, "-n", "16"]) == 1
    assert "DIVERGED at token" in capsys.readouterr().out


def test_profile_and_trace(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert main(["profile", *TINY, "-n", "3", "--warmup", "1", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "| qkv_proj | 2 |" in out and "host time to build" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {"qkv_proj", "gate_up_silu", "lm_head"} <= {e["name"] for e in events}


def test_capture_explains_without_metal(tmp_path, capsys):
    import mlx.core as mx

    if mx.metal.is_available():
        pytest.skip("this machine has Metal")
    assert main(["profile", *TINY, "--capture", str(tmp_path / "x.gputrace")]) == 2
    assert "no Metal device" in capsys.readouterr().err


def test_bad_model_name(capsys):
    assert main(["bench", "--model", "qwen9-huge"]) == 2
    assert "neither a synthetic model" in capsys.readouterr().err


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "mlx_fastops", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "bench" in r.stdout and "profile" in r.stdout


def test_saved_synthetic_model_runs_in_mlx_lm(tmp_path):
    path = mlx_fastops.save_synthetic("qwen2-tiny", tmp_path / "m", bits=4)
    r = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(path), "--prompt",
                        "t3 t4 t5", "--max-tokens", "5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Generation: " in r.stdout
    assert main(["verify", "--model", str(path), "-n", "8", "--prompt", "t3 t4 t5"]) == 0


def test_verify_with_float32_oracle(capsys):
    assert main(["verify", "--model", "qwen2-tiny", "-n", "8", "--oracle"]) == 0
    out = capsys.readouterr().out
    assert "| stock |" in out and "| patched |" in out and "top-1 = float32" in out

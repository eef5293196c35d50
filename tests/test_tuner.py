"""The tuner (patch(model, tune=...)): the noise-aware decision rule; a fusion made slow by a test
double is turned off and the others kept, a fast one kept (real clock and injected clock);
decisions cached and reused without timing, a corrupt or stale cache ignored with a warning; the
tuned model's outputs equal the untuned patched model's with the same fusions off; when "auto"
measures; `mlx-fastops tune` and `bench --tune` end to end on a tiny model."""

import json
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_fastops
from mlx_fastops import kernels, tune_cache
from mlx_fastops.backends import reference
from mlx_fastops.cli import main
from mlx_fastops.tuner import Shape, Tuner, _judge

SMALL = {"rows": (1, 2), "prefill": (8,), "context": 24, "samples": 5, "quiet": True}
PER_OP = {"qkv", "gate_up", "qk_norm_rope", "residual_norm", "lm_head", "attention"}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(tune_cache.ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def model():
    return mlx_fastops.synthetic_model("qwen3-tiny")


class ScriptedClock:
    """A timer double: runs the work, returns stock 1 ms (+-1% jitter) and the fusion
    `speed[fusion]` times that (default 0.5: twice as fast); counts its calls."""

    def __init__(self, speed=None):
        self.speed, self.calls = speed or {}, 0

    def __call__(self, fusion, variant, run):
        run()
        self.calls += 1
        base = 1e-3 * (1 + 0.01 * (self.calls % 3))
        return base * (self.speed.get(fusion, 0.5) if variant == "fused" else 1.0)


@pytest.mark.parametrize("fused, stock, verdict", [
    ([1.0] * 7, [2.0] * 7, "win"),
    ([2.0] * 7, [1.0] * 7, "loss"),
    ([1.0, 1.1, 1.2, 1.3, 1.4], [1.2, 1.3, 1.4, 1.5, 1.6], "tie"),      # quartiles overlap
    ([1.0, 1.0, 1.0, 1.0, 9.0], [2.0, 2.0, 2.0, 2.0, 2.0], "win"),      # one preempted sample
    ([1.00, 1.01, 1.02, 1.03], [1.04, 1.05, 1.06, 1.07], "win"),        # small, but beyond the spread
])
def test_verdict_is_quartile_separation(fused, stock, verdict):
    assert Shape("s", fused, stock).verdict == verdict


@pytest.mark.parametrize("verdicts, kept", [
    (["win"], True), (["win", "tie"], True), (["tie", "tie"], False), (["win", "loss"], False), (["loss"], False),
])
def test_a_fusion_is_kept_where_it_wins_and_loses_nowhere(verdicts, kept):
    times = {"win": ([1.0] * 5, [2.0] * 5), "tie": ([1.0] * 5, [1.0] * 5), "loss": ([2.0] * 5, [1.0] * 5)}
    decision = _judge("qkv", [Shape(f"s{i}", *times[v]) for i, v in enumerate(verdicts)])
    assert decision.kept is kept


@pytest.mark.parametrize("speed, off", [
    ({}, set()),
    ({"qkv": 3.0}, {"qkv"}),
    ({"attention": 1.0, "lm_head": 2.0}, {"attention", "lm_head"}),   # a tie is not a win
])
def test_scripted_clock_turns_off_what_loses(speed, off):
    m = model()
    clock = ScriptedClock(speed)
    report = mlx_fastops.patch(m, tune=Tuner(timer=clock, **SMALL))
    assert clock.calls > 0 and report.tuning.source == "measured" and report.tuning.off == off
    assert set(report.tuning.decisions) == PER_OP   # the reference backend has no whole-step switches
    assert {e.fusion for e in report.fused} == PER_OP - off
    for e in report.skipped:
        assert e.fusion in off and e.reason.startswith("tuned off: ")
    assert "| qkv | " + ("off" if "qkv" in off else "kept") + " |" in str(report)
    doc = report.to_dict()["tuning"]
    assert {d["fusion"]: d["kept"] for d in doc["decisions"]} == {f: f not in off for f in PER_OP}
    slow = [d for d in doc["decisions"] if d["fusion"] in speed and speed[d["fusion"]] > 1]
    assert all(d["ratio"] == pytest.approx(1 / speed[d["fusion"]], rel=0.05) for d in slow)


def _sleeping(op):
    def slow(x, w):
        time.sleep(0.003)
        return op(x, w)
    return slow


def _precomputed(op):
    """Returns one call's outputs, already evaluated, for every call: no work at all."""
    done = {}

    def fast(x, w):
        if x.shape not in done:
            done[x.shape] = op(x, w)
            mx.eval(done[x.shape])
        return done[x.shape]
    return fast


@pytest.mark.parametrize("op, double, fusion, kept", [
    ("qkv_proj", _sleeping, "qkv", False),
    ("gate_up_silu", _precomputed, "gate_up", True),
])
def test_real_clock_with_an_injected_kernel(monkeypatch, op, double, fusion, kept):
    monkeypatch.setattr(reference, op, double(getattr(reference, op)))
    report = mlx_fastops.patch(model(), tune=Tuner(**SMALL))
    decision = report.tuning.decisions[fusion]
    assert decision.kept is kept, decision
    assert decision.ratio < 0.5 if not kept else decision.ratio > 2


def test_decisions_are_cached_and_reused(cache_dir):
    first = ScriptedClock({"qkv": 3.0})
    mlx_fastops.patch(model(), tune=Tuner(timer=first, **SMALL))
    assert (cache_dir / "tune.json").is_file()
    again = ScriptedClock()
    report = mlx_fastops.patch(model(), tune=Tuner(timer=again, **SMALL))
    assert again.calls == 0 and report.tuning.source == "cache" and report.tuning.off == {"qkv"}
    other_shapes = ScriptedClock()
    mlx_fastops.patch(model(), tune=Tuner(timer=other_shapes, **{**SMALL, "rows": (1,)}))
    forced = ScriptedClock()
    report = mlx_fastops.patch(model(), tune=Tuner("force", timer=forced, **SMALL))
    assert other_shapes.calls > 0 and forced.calls > 0 and report.tuning.off == set()
    entries = json.loads((cache_dir / "tune.json").read_text())["entries"]
    assert len(entries) == 2   # the forced measurement replaced its key's entry


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps({"schema": tune_cache.SCHEMA + 1, "entries": []}),   # stale: another schema
    json.dumps([1, 2]),
    "corrupt entry",
])
def test_a_corrupt_or_stale_cache_is_ignored_with_a_warning(cache_dir, content):
    clock = ScriptedClock()
    tuner = Tuner(timer=clock, **SMALL)
    if content == "corrupt entry":
        mlx_fastops.patch(model(), tune=tuner)
        doc = json.loads((cache_dir / "tune.json").read_text())
        doc["entries"][0]["tuning"]["decisions"][0]["fusion"] = "warp_drive"
        content = json.dumps(doc)
    cache_dir.mkdir(exist_ok=True)
    (cache_dir / "tune.json").write_text(content)
    calls = clock.calls
    with pytest.warns(RuntimeWarning, match="ignoring"):
        report = mlx_fastops.patch(model(), tune=tuner)
    assert clock.calls > calls and report.tuning.source == "measured"
    assert json.loads((cache_dir / "tune.json").read_text())["schema"] == tune_cache.SCHEMA   # rewritten


def _logits(m, prompt):
    cache = make_prompt_cache(m)
    out = [m(prompt[None], cache=cache)]
    for _ in range(3):
        out.append(m(mx.argmax(out[-1][:, -1:], axis=-1), cache=cache))
    return mx.concatenate([o[:, -1] for o in out])


@pytest.mark.parametrize("speed", [{"qkv": 3.0, "residual_norm": 2.0}, {"attention": 2.0, "gate_up": 4.0}])
def test_tuned_outputs_equal_the_untuned_patch_with_the_same_fusions_off(speed):
    prompt = mx.random.randint(0, 4096, (20,), key=mx.random.key(3))
    stock = _logits(model(), prompt)
    tuned = model()
    report = mlx_fastops.patch(tuned, tune=Tuner(timer=ScriptedClock(speed), **SMALL))
    assert report.tuning.off == set(speed)
    same = model()
    mlx_fastops.patch(same, disable=sorted(speed), tune="off")
    assert mx.array_equal(_logits(tuned, prompt), _logits(same, prompt))
    assert mx.array_equal(_logits(tuned, prompt), stock)   # float32 reference path: bit-exact


@pytest.mark.parametrize("mode, backend, replaced, measures", [
    ("auto", "reference", False, False),   # the fused ops compose stock's own: nothing to find
    ("auto", "metal", False, True),
    ("auto", "metal", True, False),        # emulated kernels are never timed unless asked
    ("on", "reference", False, True),
    ("on", "metal", True, True),
    ("force", "cuda", False, True),
    ("off", "cuda", False, False),
])
def test_when_tuning_measures(mode, backend, replaced, measures):
    tuner = Tuner(mode)
    if replaced:
        with kernels.use_metal_factory(lambda **spec: None):
            assert tuner.measures(backend) is measures
    else:
        assert tuner.measures(backend) is measures


@pytest.mark.parametrize("tune, env, error", [
    ("sometimes", None, ValueError),
    (3, None, TypeError),
    (None, "maybe", ValueError),
])
def test_bad_tune_values_are_refused_before_work(monkeypatch, tune, env, error):
    if env is not None:
        monkeypatch.setenv("MLX_FASTOPS_TUNE", env)
    m = model()
    with pytest.raises(error, match="tune|TUNE"):
        mlx_fastops.patch(m, tune=tune)
    assert not mlx_fastops.is_patched(m)


def test_a_failure_while_tuning_leaves_the_model_unpatched():
    def broken(fusion, variant, run):
        raise RuntimeError("clock broke")
    m = model()
    with pytest.raises(RuntimeError, match="clock broke"):
        mlx_fastops.patch(m, tune=Tuner(timer=broken, **SMALL))
    assert not mlx_fastops.is_patched(m) and type(m.model.layers[0]).__name__ == "TransformerBlock"


def test_cli_tune_writes_the_decisions(tmp_path, capsys, cache_dir):
    out = tmp_path / "tune.json"
    assert main(["tune", "--model", "qwen3-tiny", "--rows", "1", "--prefill", "8", "--context", "16",
                 "--samples", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| fusion | tuned | ratio (worst shape) |" in text and "first tuning:" in text
    doc = json.loads(out.read_text())
    assert doc["wall_s"] > 0 and {d["fusion"] for d in doc["patch"]["tuning"]["decisions"]} == PER_OP
    assert (cache_dir / "tune.json").is_file()


@pytest.mark.parametrize("argv", [["--samples", "2"], ["--rows", "0"], ["--prefill", "x"], ["--json", "/no/such/f"]])
def test_cli_tune_refuses_bad_flags(capsys, argv):
    assert main(["tune", "--model", "qwen3-tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err


def test_bench_tune_adds_a_tuned_column(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "qwen3-tiny", "-p", "8", "-g", "2", "-n", "1", "--warmup", "0", "--tune",
                 "-q", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["models"]
    assert result["variants"] == ["stock", "patched", "tuned"]
    assert result["patch"]["patched"]["tuning"] is None and result["patch"]["tuned"]["tuning"]["decisions"]
    assert all("tuned" in row["variants"] for row in result["rows"])

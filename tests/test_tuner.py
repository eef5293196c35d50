"""The tuner (patch(model, tune=...)): the noise-aware decision rule; a fusion made slow by a test
double is turned off and the others kept, a fast one kept (real clock and injected clock);
decisions cached and reused without timing, a corrupt or stale cache ignored with a warning; the
tuned model's outputs equal the untuned patched model's with the same fusions off; when "auto"
measures; `prefill` kept per chunk size; the whole-step switches (a stub DecodePath on the CPU)
and the parts they keep on; `mlx-fastops tune` and `bench --tune` end to end on a tiny model (bad
flags: tests/test_cli.py's table)."""

import json
import time
from dataclasses import asdict

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

import mlx_fastops
from mlx_fastops import kernels, ops, tune_cache
from mlx_fastops.backends import DecodePath, reference
from mlx_fastops.cli import main
from mlx_fastops.tuner import (Decision, Shape, Tuner, Tuning, _judge, _judge_prefill, _whole_prefill, same_plan,
                                stock_rows)

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


@pytest.mark.parametrize("name, bits, speed", [
    ("qwen3-tiny", 4, {"qkv": 3.0, "residual_norm": 2.0}),
    ("qwen3-tiny", 4, {"attention": 2.0, "gate_up": 4.0}),
    ("llama-tiny", 4, {"lm_head": 2.0, "qk_norm_rope": 1.5}),   # an untied head
    ("qwen2-tiny", None, {"qkv": 2.0}),
])
def test_tuned_outputs_equal_the_untuned_patch_with_the_same_fusions_off(name, bits, speed):
    model = lambda: mlx_fastops.synthetic_model(name, bits=bits)
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


def test_bench_tune_adds_a_tuned_column(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "qwen3-tiny", "-p", "8", "-g", "2", "-n", "1", "--warmup", "0", "--tune",
                 "-q", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["models"]
    assert result["variants"] == ["stock", "patched", "tuned"]
    assert result["patch"]["patched"]["tuning"] is None and result["patch"]["tuned"]["tuning"]["decisions"]
    assert all("tuned" in row["variants"] for row in result["rows"])


# (verdict per chunk size, kept, the rows left to stock: lo < rows <= hi)
PREFILL_VERDICTS = [
    ({512: "win", 2048: "win"}, True, None),
    ({512: "tie", 2048: "win"}, True, (0, 512)),      # stock up to 512 rows, the backend's path above
    ({512: "loss", 1024: "win", 2048: "win"}, True, (0, 512)),
    ({512: "win", 1024: "tie", 2048: "win"}, True, (512, 1024)),   # the path up to 512 and above 1024
    ({512: "win", 2048: "tie"}, False, None),    # no win at the largest chunk: off
    ({64: "loss", 1024: "win", 2048: "win"}, True, (0, 64)),   # a GPU's defaults: CUDA's qmm loses, stock up to 64
    ({64: "win", 1024: "tie", 2048: "win"}, True, (64, 1024)),  # qmm wins, the dense path ties at 1024
    ({64: "win", 512: "loss", 1024: "win", 2048: "tie"}, False, None),
    ({16: "win", 64: "win", 512: "tie", 1024: "win", 2048: "win"}, True, (64, 512)),
    ({16: "win", 64: "tie", 512: "win", 1024: "tie", 2048: "win"}, True, (16, 1024)),   # one stock range
]


@pytest.mark.parametrize("verdicts, kept, stock", PREFILL_VERDICTS)
def test_prefill_is_kept_outside_the_sizes_it_does_not_win(verdicts, kept, stock):
    times = {"win": ([1.0] * 5, [2.0] * 5), "tie": ([1.0] * 5, [1.0] * 5), "loss": ([2.0] * 5, [1.0] * 5)}
    sized = [(n, Shape(f"prefill {n}", *times[v])) for n, v in verdicts.items()]
    decision = _judge_prefill(sized)
    assert (decision.kept, stock_rows(decision)) == (kept, stock)
    again = Tuning.from_dict({"device": "d", "seconds": 1.0, "decisions": [asdict(decision)]}).decisions["prefill"]
    assert (again.above, again.upto) == (decision.above, decision.upto)


# (above, upto) that a cached prefill decision may not hold
BAD_ROWS = [(None, 64), (64, 64), (64, 128), (0, None), (512, 0), ("512", None), (512, True)]


@pytest.mark.parametrize("above,upto", BAD_ROWS)
def test_a_cached_prefill_decision_with_bad_rows_does_not_parse(above, upto):
    d = {"fusion": "prefill", "kept": True, "note": "", "shapes": [], "above": above, "upto": upto}
    with pytest.raises(ValueError):
        Tuning.from_dict({"device": "d", "seconds": 1.0, "decisions": [d]})


def _tuned(kept=True, **rows):
    return Tuning("d", "measured", 1.0, {"prefill": Decision("prefill", kept, "t", [], **rows)})


# (a parked state's tuning, a new patch's, whether it may be resumed: the same plan)
SAME_PLAN = [(None, None, True), (None, _tuned(), True), (_tuned(above=1024), _tuned(above=1024), True),
             (_tuned(above=1024), _tuned(above=1024, upto=64), False), (None, _tuned(above=1024), False),
             (None, _tuned(kept=False), False), (_tuned(above=1024, upto=64), _tuned(above=1024, upto=64), True)]


@pytest.mark.parametrize("parked,new,same", SAME_PLAN)
def test_same_plan(parked, new, same):
    assert same_plan(parked, new) is same


@pytest.mark.parametrize("ratio, kept, stock", [
    ({16: 0.5, 64: 0.5}, True, None),
    ({16: 1.0, 64: 0.5}, True, (0, 16)),       # a tie at the short chunk: stock up to it
    ({16: 0.5, 64: 1.0}, False, None),    # no win at mlx-lm's chunk size: off
])
def test_prefill_is_judged_by_whole_prompt_chunks(ratio, kept, stock):
    """`prefill` from whole prompt chunks of the model with the backend's prefill path on
    ("fused": the per-op losers off) and off ("stock": `prefill` off too), each chunk length a
    fresh cache; here a clock double makes the fused chunks take ratio[length] of stock's time."""
    m, applied = model(), []

    def clock(fusion, variant, run):
        run()
        n = run.__defaults__[0].shape[1]   # the chunk's prompt
        return 1e-3 * (ratio[n] if variant == "fused" else 1.0)

    tuner = Tuner(timer=clock, steps=4, rounds=2, **{**SMALL, "prefill": (16, 64)})
    decisions = {"qkv": _judge("qkv", [Shape("s", [1.0] * 5, [2.0] * 5)]),
                 "lm_head": _judge("lm_head", [Shape("s", [2.0] * 5, [1.0] * 5)])}
    out = _whole_prefill(m, m.args.vocab_size, {"compile"}, decisions, tuner, applied.append, lambda: None)
    assert (out["prefill"].kept, stock_rows(out["prefill"])) == (kept, stock), out["prefill"]
    on, off = {"compile", "lm_head"}, {"compile", "lm_head", "prefill"}
    assert applied == [on, off, off, on]   # rounds alternate which variant goes first


@pytest.mark.parametrize("rows, stock, runs", [
    (1, None, "fn"), (8, None, "fn"), (9, None, "ref"), (4096, None, "ref"),
    (8, (0, 512), "fn"), (9, (0, 512), "ref"), (512, (0, 512), "ref"), (513, (0, 512), "fn"), (2047, (0, 512), "fn"),
    (9, (0, 64), "ref"), (64, (0, 64), "ref"), (65, (0, 64), "fn"),
    (8, (64, 1024), "fn"), (9, (64, 1024), "fn"), (64, (64, 1024), "fn"), (65, (64, 1024), "ref"),
    (1024, (64, 1024), "ref"), (1025, (64, 1024), "fn"), (5, (4, 16), "fn"), (9, (4, 16), "ref"),
])
def test_decode_rows_only_runs_the_backend_op_outside_the_tuned_rows(monkeypatch, rows, stock, runs):
    monkeypatch.setattr(reference, "qkv_proj", lambda x, w: "ref")
    call = ops.decode_rows_only(lambda x, w: "fn", "qkv_proj", stock)
    assert call(mx.zeros((1, rows, 4)), None) == runs


class StubDecodePath(DecodePath):
    """A whole-step decode path on the reference backend that takes no call (the blocks compose
    their ops): what the tuner's whole-step timing needs of a DecodePath, on the CPU."""
    parts = ("qkv", "residual_norm")

    def block(self, fused_block, disabled):
        if set(self.parts) & disabled:
            return None, "parts disabled"
        fast = lambda x, cache: None
        fast.cache_types = (KVCache,)
        return fast, None

    def install(self, model, fasts, disabled):
        return None, [("compile", "skipped" if "compile" in disabled else "fused", "")]


class StepClock(ScriptedClock):
    """ScriptedClock for the ops; whole decode steps take `steps[variant]` ms."""

    def __init__(self, speed, steps):
        super().__init__(speed)
        self.steps = steps

    def __call__(self, fusion, variant, run):
        t = super().__call__(fusion, variant, run)
        return t * self.steps[variant] if variant in self.steps else t


@pytest.mark.parametrize("steps, kept", [
    ({"composed": 1.0, "fast": 0.5, "compiled": 0.4}, {"fast_decode", "compile"}),
    ({"composed": 1.0, "fast": 0.5, "compiled": 0.8}, {"fast_decode"}),
    ({"composed": 1.0, "fast": 1.2, "compiled": 0.5}, {"fast_decode", "compile"}),
    ({"composed": 1.0, "fast": 1.0, "compiled": 1.0}, set()),
    ({"composed": 1.0, "fast": 2.0, "compiled": 2.0}, set()),
])
def test_whole_step_switches_and_the_parts_they_keep_on(monkeypatch, steps, kept):
    monkeypatch.setattr(reference, "DECODE_PATH", StubDecodePath())
    # per op: residual_norm ties (off on its own), qkv wins, lm_head loses
    clock = StepClock({"residual_norm": 1.0, "lm_head": 2.0}, steps)
    report = mlx_fastops.patch(model(), tune=Tuner(timer=clock, steps=3, rounds=2, **SMALL))
    d = report.tuning.decisions
    assert {f for f in ("fast_decode", "compile") if d[f].kept} == kept
    assert d["residual_norm"].kept is ("fast_decode" in kept) and not d["lm_head"].kept and d["qkv"].kept
    if "fast_decode" in kept:
        assert d["residual_norm"].note.startswith("kept: part of fast_decode")
    fused = {e.fusion for e in report.fused}
    assert ("fast_decode" in fused) is ("fast_decode" in kept) and ("compile" in fused) is ("compile" in kept)


def test_a_vision_language_wrapper_tunes(monkeypatch):
    """A VL wrapper (its args have text_config, no vocab_size) is tuned through its text model,
    whole decode steps included (the stub DecodePath)."""
    from mlx_lm.models import qwen3_vl

    from mlx_fastops.synthetic import CONFIGS

    monkeypatch.setattr(reference, "DECODE_PATH", StubDecodePath())
    vl = qwen3_vl.Model(qwen3_vl.ModelArgs.from_dict({"model_type": "qwen3_vl", "text_config": dict(CONFIGS["qwen3-tiny"])}))
    clock = StepClock({}, {"composed": 1.0, "fast": 0.5, "compiled": 0.4})
    report = mlx_fastops.patch(vl, tune=Tuner(timer=clock, steps=3, rounds=2, **SMALL))
    assert report.tuning.decisions["fast_decode"].kept and mlx_fastops.is_patched(vl)
    mlx_fastops.unpatch(vl)


def test_tuning_leaves_the_global_random_state_alone():
    """Sampling after patch() does not depend on whether the tuner measured (its inputs are keyed)."""
    m = model()
    mx.random.seed(3)
    want = mx.random.uniform(shape=(4,))
    mx.random.seed(3)
    mlx_fastops.patch(m, tune=Tuner(timer=ScriptedClock(), **SMALL))
    assert mx.array_equal(mx.random.uniform(shape=(4,)), want)

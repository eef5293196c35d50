"""benchmarks/cuda_ab.py, the one-process A/B of a CUDA backend setting, on a tiny model on any
device: on the CPU the setting changes nothing that runs, so these test the harness itself (each
copy patched and generating under its own value only, the table, the setting restored, bad input)."""

import importlib.util
import re
from pathlib import Path

import pytest

import mlx_fastops
from mlx_fastops import bench
from mlx_fastops.backends.cuda import attention

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--set", "attention.ATTN_TARGET_BLOCKS=264,528", "--models", "qwen3-tiny", "-p", "8", "-g", "4", "-n", "2"]


def cuda_ab():
    spec = importlib.util.spec_from_file_location("cuda_ab", ROOT / "benchmarks" / "cuda_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_copy_runs_under_its_own_value_and_the_table_has_both(tmp_path, monkeypatch):
    default, ab = attention.ATTN_TARGET_BLOCKS, cuda_ab()
    patched, generated = {}, []   # model id -> the value at its patch; (model id, value) per generation
    real_patch, real_generation = mlx_fastops.patch, bench.generation

    def patch(model, **kw):
        patched[id(model)] = attention.ATTN_TARGET_BLOCKS
        return real_patch(model, **kw)

    def generation(model, *args, **kw):
        generated.append((id(model), attention.ATTN_TARGET_BLOCKS))
        return real_generation(model, *args, **kw)

    monkeypatch.setattr(ab.mlx_fastops, "patch", patch)
    monkeypatch.setattr(bench, "generation", generation)
    out = tmp_path / "ab"
    text = ab.main(ARGS + ["--out", str(out)])
    assert attention.ATTN_TARGET_BLOCKS == default
    assert sorted(patched.values()) == [264, 528]
    assert len(generated) == 2 * (1 + 2)   # per copy: the warm-up round, 2 trials
    assert all(patched[m] == v for m, v in generated), generated
    assert (tmp_path / "ab.md").read_text() == text and (tmp_path / "ab.json").exists()
    head = next(line for line in text.splitlines() if line.startswith("| model"))
    assert "| ATTN_TARGET_BLOCKS=264 t/s | ATTN_TARGET_BLOCKS=528 t/s | ratio |" in head
    rows = [line for line in text.splitlines() if line.startswith("| qwen3-tiny")]
    assert [r.split(" | ")[2] for r in rows] == ["pp8", "tg4 @8"]
    cell = re.compile(r"^\d+(\.\d+)? \(\d+(\.\d+)?-\d+(\.\d+)?\)$")   # median (min-max)
    for r in rows:
        cells = r.strip("| ").split(" | ")
        assert cell.match(cells[3]) and cell.match(cells[4]) and re.match(r"^\d+\.\d\dx$", cells[5]), r
        assert cells[-1] == "5/5", r   # greedy agreement with 264's: all 5 tokens (-g 4 after the first)
    assert "ratio of medians to ATTN_TARGET_BLOCKS=264" in text

def test_setting_restored_when_timing_fails(monkeypatch):
    default, ab = attention.ATTN_TARGET_BLOCKS, cuda_ab()

    def broken(*args, **kw):
        raise RuntimeError("timing failed")

    monkeypatch.setattr(bench, "compare", broken)
    with pytest.raises(RuntimeError, match="timing failed"):
        ab.main(["--set", "attention.ATTN_TARGET_BLOCKS=100,200", "--models", "qwen3-tiny", "-p", "8", "-g", "4"])
    assert attention.ATTN_TARGET_BLOCKS == default


@pytest.mark.parametrize("setting,problem", [
    ("attention.NO_SUCH=1,2", "has no NO_SUCH"),
    ("nosuch.X=1,2", "no module 'nosuch'"),
    ("attention.ATTN_WARPS=4,8", r"also a name in \['quantized_kv'\]"),   # imported by name there
    ("attention.ATTN_TARGET_BLOCKS=264", "at least two distinct values"),
    ("attention.ATTN_TARGET_BLOCKS=264,264", "at least two distinct values"),
    ("ATTN_TARGET_BLOCKS", "module.NAME=v1,v2"),
])
def test_bad_setting_is_named_before_any_work(setting, problem):
    with pytest.raises(SystemExit, match=problem):
        cuda_ab().parse_setting(setting)


def test_kv_bits_reach_every_copy_and_name_it(monkeypatch):
    ab, seen = cuda_ab(), []
    real_generation = bench.generation

    def generation(model, *args, **kw):
        seen.append(kw)
        return real_generation(model, *args, **kw)

    monkeypatch.setattr(bench, "generation", generation)
    text = ab.main(ARGS + ["--kv-bits", "8"])
    assert len(seen) == 2 * (1 + 2) and all(kw == {"kv_bits": 8, "kv_group_size": bench.KV_GROUP,
                                                   "quantized_kv_start": 0} for kw in seen), seen
    assert "| ATTN_TARGET_BLOCKS=264 kv8 t/s | ATTN_TARGET_BLOCKS=528 kv8 t/s | ratio |" in text
    with pytest.raises(SystemExit, match="not with --batch"):
        ab.main(ARGS + ["--kv-bits", "8", "--batch", "2"])

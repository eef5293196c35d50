"""benchmarks/cuda_ab.py, the one-process A/B of a CUDA backend setting, on a tiny model on any
device (on the CPU the setting changes nothing that runs: the harness's own logic is tested)."""

import importlib.util
import re
from pathlib import Path

import pytest

from mlx_fastops.backends.cuda import attention

ROOT = Path(__file__).resolve().parents[1]


def cuda_ab():
    spec = importlib.util.spec_from_file_location("cuda_ab", ROOT / "benchmarks" / "cuda_ab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ab_table_has_every_value_and_restores_the_setting(tmp_path):
    default = attention.ATTN_TARGET_BLOCKS
    out = tmp_path / "ab.md"
    text = cuda_ab().main(["--set", "attention.ATTN_TARGET_BLOCKS=264,528", "--models", "qwen3-tiny", "-p", "8",
                           "-g", "4", "-n", "1", "--out", str(out)])
    assert attention.ATTN_TARGET_BLOCKS == default
    assert out.read_text() == text + "\n"
    head = next(line for line in text.splitlines() if line.startswith("| model"))
    assert "ATTN_TARGET_BLOCKS=264 tok/s" in head and "ATTN_TARGET_BLOCKS=528 tok/s" in head
    rows = [line for line in text.splitlines() if line.startswith("| qwen3-tiny")]
    assert [r.split(" | ")[1] for r in rows] == ["pp8", "tg4 @8"]
    cell = re.compile(r"^\d+\.\d \(\d+\.\d-\d+\.\d\) \d+\.\d{3}x$")   # median (min-max) ratio
    for r in rows:
        cells = r.strip("| ").split(" | ")[2:]
        assert len(cells) == 2 and all(cell.match(c) for c in cells) and cells[0].endswith(" 1.000x"), r
    assert "qwen3-tiny: greedy tokens equal to ATTN_TARGET_BLOCKS=264's: ATTN_TARGET_BLOCKS=528: True" in text


@pytest.mark.parametrize("setting,problem", [
    ("attention.NO_SUCH=1,2", "has no NO_SUCH"),
    ("attention.ATTN_TARGET_BLOCKS=264", "at least two values"),
    ("ATTN_TARGET_BLOCKS", "module.NAME=v1,v2"),
])
def test_bad_setting_is_named_before_any_work(setting, problem):
    with pytest.raises(SystemExit, match=problem):
        cuda_ab().parse_setting(setting)

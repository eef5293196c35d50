"""Tensor-parallel models (issue 23): mlx-lm's `model.shard(group)` column-shards q/k/v and gate/up
(AllToShardedLinear and its quantised form) and row-shards o_proj/down_proj (ShardedToAllLinear:
the local matmul, then all_sum). The fusions run on the shards. Two processes over loopback on the
CPU (`mlx.launch --backend ring`), one launch for every case (tests/sharded_worker.py):

- sharded and patched == sharded stock, bit for bit (float32, reference path: the fusion's
  contract), and the fused ops ran; unpatched again, stock's again; nn.value_and_grad through
  the patched model gives the sharded stock model's gradients (up to rounding);
- greedy tokens of the sharded patched model == the unsharded stock model's (sharding changes the
  order of the o_proj/down sums, so logits are not bit-exact there; the synthetic models' margins
  are clear);
- patched first and sharded after: the patch follows, then unpatches to a working stock model;
- mlx-lm's `sharded_load` + `stream_generate`, patched: the unsharded model's tokens;
- the patch report names the sharded fusions on every layer, and nothing is skipped.
In this process: which layers stack into one projection, and the CUDA backend's refusal of sharded
blocks on its one-launch decode layer (through tests/cuda_emu without a GPU)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from decoding import greedy, prompt_of
from loopback import free_ports
from sharded_worker import CASES, GROUP_SIZE

import mlx_fastops
from mlx_fastops.ops.weights import PackedLinear

RANKS = 2
LAYERS = 2   # the tiny models' decoder layers
LAUNCH_TIMEOUT_S = 240
SHARD_NOTES = {"qkv": "column shards of a 2-rank group; o_proj row-sharded, then mlx-lm's all_sum",
               "gate_up": "column shards of a 2-rank group; down_proj row-sharded, then mlx-lm's all_sum"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's results (tests/sharded_worker.py), from one launch of RANKS processes."""
    launcher = shutil.which("mlx.launch", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                              os.environ.get("PATH", "")]))
    if launcher is None:
        pytest.skip("mlx.launch (MLX's distributed launcher) is not installed")
    out = tmp_path_factory.mktemp("sharded")
    model_dir = mlx_fastops.save_synthetic("qwen3-tiny", out / "model", bits=4, group_size=GROUP_SIZE)
    worker = Path(__file__).with_name("sharded_worker.py")
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
               MLX_FASTOPS_BACKEND="reference")
    env.pop("MLX_FASTOPS_DISABLE", None)
    cmd = [launcher, "--backend", "ring", "--hosts", "127.0.0.1", "-n", str(RANKS),
           "--starting-port", str(free_ports(RANKS)), sys.executable, str(worker), str(out), str(model_dir)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    # mlx.launch exits 0 even where a rank failed: a rank's result file is its success.
    missing = [r for r in range(RANKS) if not (out / f"rank{r}.json").exists()]
    assert run.returncode == 0 and not missing, (f"ranks {missing} wrote no result\n"
                                                 + run.stdout[-4000:] + run.stderr[-4000:])
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert [(r["rank"], r["size"]) for r in results] == [(r, RANKS) for r in range(RANKS)]
    return results


def _assert_shard_report(report):
    rows = report["summary"]
    assert not [r for r in rows if r["status"] == "skipped"], rows
    for fusion, note in SHARD_NOTES.items():
        assert [(r["status"], r["reason"], r["count"]) for r in rows if r["fusion"] == fusion] == \
            [("fused", note, LAYERS)], rows


@pytest.mark.parametrize("rank", range(RANKS))
@pytest.mark.parametrize("name,bits", CASES, ids=[f"{n}-b{b}" for n, b in CASES])
def test_sharded_patched_equals_stock(ranks, rank, name, bits):
    case = ranks[rank]["cases"][f"{name}-b{bits}"]
    stock = case["stock"]
    for run in ("patched", "unpatched", "shard_after_patch", "shard_after_patch_unpatched"):
        assert case[run] == stock, run   # tokens and logits, bit for bit
    assert case["patched"]["tokens"] == case["unsharded"]["tokens"]
    assert len(set(case["unsharded"]["tokens"][0])) >= 6   # tokens that vary: the comparison means something
    # The stacked matmul's backward adds up in another order; the input gradient of the column
    # shards is all-summed (AllToShardedLinear's sum_gradients), else it lacks the other ranks' part.
    assert case["gradients"]["max_relative"] <= 1e-5 and case["gradients"]["parameters"] > 0
    for op in ("qkv_proj", "gate_up_silu", "qk_norm_rope", "rms_norm_residual", "flash_attention"):
        assert case["ops_run"].get(op) == LAYERS, (op, case["ops_run"])
    _assert_shard_report(case["report"])
    _assert_shard_report(case["shard_after_patch_report"])


@pytest.mark.parametrize("rank", range(RANKS))
def test_sharded_load_and_generate(ranks, rank):
    gen = ranks[rank]["generate"]
    assert gen["patched"] == gen["stock"] == gen["unsharded"]
    assert len(gen["patched"]) > 1
    _assert_shard_report(gen["report"])


def test_ranks_agree(ranks):
    """Every rank ends with the whole model's output (the all_sums): the same tokens everywhere."""
    first = ranks[0]
    for other in ranks[1:]:
        for key, case in first["cases"].items():
            assert other["cases"][key]["patched"] == case["patched"], key
        assert other["generate"]["patched"] == first["generate"]["patched"]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cuda"], indirect=True)
def test_cuda_decode_path_refuses_sharded_blocks(backend, monkeypatch):
    """On the CUDA backend (the GPU, or tests/cuda_emu), in this one process (a group of 1 rank:
    each shard is its whole layer): the fused ops run on the shards, composed between mlx-lm's
    all_sums, and the one-launch layer refuses every sharded block, named in the report (so no
    compiled step either). The decode equals the unsharded model's through the same composed ops,
    bit for bit (the 8-token prompt keeps the unsharded model's o_proj/down, like the sharded ones,
    on stock quantized_matmul: the prefill path starts at 512 rows)."""
    monkeypatch.setenv("MLX_FASTOPS_BACKEND", "cuda")
    monkeypatch.delenv("MLX_FASTOPS_DISABLE", raising=False)
    group = mx.distributed.init()
    sharded = mlx_fastops.synthetic_model("qwen3-tiny", bits=4, dtype=mx.bfloat16)
    sharded.shard(group)
    report = mlx_fastops.patch(sharded)
    unsharded = mlx_fastops.synthetic_model("qwen3-tiny", bits=4, dtype=mx.bfloat16)
    mlx_fastops.patch(unsharded, disable=["fast_decode"])
    try:
        refused = f"tensor-parallel shards of a {group.size()}-rank group (the one-launch layer has no all-reduce)"
        assert [(e.status, e.reason) for e in report.entries if e.fusion in ("fast_decode", "compile")] \
            == [("skipped", refused)] * LAYERS, str(report)
        assert {e.backend for e in report.entries if e.fusion in ("qkv", "gate_up")} == {"cuda"}
        prompt = prompt_of(sharded, 1, 8)
        (tokens, logits), (want_tokens, want_logits) = greedy(sharded, prompt, 3), greedy(unsharded, prompt, 3)
        assert tokens == want_tokens and mx.array_equal(logits, want_logits)
        assert backend.launches > 0
    finally:
        mlx_fastops.unpatch(sharded)
        mlx_fastops.unpatch(unsharded)


def _column_shard(group, bits=None):
    """A layer as mlx-lm's shard() makes it (shard_linear, "all-to-sharded")."""
    layer = nn.Linear(64, 32, bias=False)
    if bits:
        layer = nn.QuantizedLinear.from_linear(layer, group_size=32, bits=bits)
    return nn.layers.distributed.shard_linear(layer, "all-to-sharded", group=group)


STACKS = [
    # (layers to stack, given the group; why they cannot be, or None)
    (lambda g: [_column_shard(g), _column_shard(g)], None),
    (lambda g: [_column_shard(g, 4), _column_shard(g, 4)], None),
    (lambda g: [_column_shard(g, 3), _column_shard(g, 3)], "bits=3, group_size=32"),
    (lambda g: [_column_shard(g), nn.Linear(64, 32, bias=False)], "mixed layer types"),
    (lambda g: [_column_shard(g), _column_shard(mx.distributed.init())],
     "column shards of different mx.distributed group objects"),
    (lambda g: [nn.layers.distributed.shard_linear(nn.Linear(64, 32), "sharded-to-all", group=g)] * 2,
     "layer type ShardedToAllLinear"),
]


@pytest.mark.parametrize("layers,reason", STACKS)
def test_which_shards_stack(layers, reason):
    group = mx.distributed.init()
    modules = layers(group)
    got = PackedLinear.unsupported(modules)
    assert (got is None) if reason is None else (got or "").startswith(reason), got
    if reason is None:
        assert PackedLinear.concat(modules)[0].group is group

"""One rank of tests/test_sharded.py's tensor-parallel run:

    mlx.launch --backend ring --hosts 127.0.0.1 -n 2 python tests/sharded_worker.py OUT_DIR [MODEL_DIR]

Every rank builds the same synthetic models (same seeds) and, for each case of CASES, decodes
greedily: the unsharded stock model; the model sharded by mlx-lm (`model.shard(group)`), stock;
the same patched (and its gradients against the sharded stock model's); unpatched again; and a
second copy patched first and sharded after (the patch follows mlx-lm's shard: its watch sees
the layers replaced), then unpatched. With MODEL_DIR (a saved synthetic model), also mlx-lm's own
sharded loading and generation: `sharded_load` + `stream_generate`, patched, against the
unsharded `mlx_lm.load`'s. Writes OUT_DIR/rank<r>.json; the test judges.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from decoding import greedy, prompt_of
from mlx.utils import tree_flatten

import mlx_fastops
from mlx_fastops import profiler

CASES = [(name, bits) for name in ("qwen3-tiny", "llama-tiny", "qwen2-tiny") for bits in (None, 4)]
# Row-sharded quantised layers split their input groups between the ranks: the tiny models'
# intermediate sizes (320, 448, 384) halved are multiples of 32, not of 64.
GROUP_SIZE = 32
TOKENS = 16
PROMPT = 20
GENERATE_PROMPT = "sharded over two ranks"


def model_of(name, bits):
    return mlx_fastops.synthetic_model(name, bits=bits, group_size=GROUP_SIZE)


def decoded(model, prompt):
    """(greedy tokens, last logits as a list): what the test compares, bit for bit."""
    tokens, logits = greedy(model, prompt, TOKENS)
    return {"tokens": tokens, "logits": logits[0, -1].tolist()}


def run_case(name, bits, group):
    model = model_of(name, bits)
    prompt = prompt_of(model, 1, PROMPT)
    out = {"unsharded": decoded(model, prompt)}
    model.shard(group)
    out["stock"] = decoded(model, prompt)
    stock_grads = gradients(model, prompt)
    out["report"] = mlx_fastops.patch(model).to_dict()
    out["patched"] = decoded(model, prompt)
    out["gradients"] = gradient_error(gradients(model, prompt), stock_grads)
    out["ops_run"] = ops_run(model, prompt)
    mlx_fastops.unpatch(model)
    out["unpatched"] = decoded(model, prompt)
    late = model_of(name, bits)
    mlx_fastops.patch(late)
    late.shard(group)
    out["shard_after_patch"] = decoded(late, prompt)
    out["shard_after_patch_report"] = mlx_fastops.patch(late).to_dict()
    mlx_fastops.unpatch(late)
    out["shard_after_patch_unpatched"] = decoded(late, prompt)
    return out


def _loss(model, x):
    return nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:]).mean()


def gradients(model, x):
    return dict(tree_flatten(nn.value_and_grad(model, _loss)(model, x)[1]))


def gradient_error(got, want):
    """The largest |got - want| / |want| over the parameters, and how many there are (none of
    whose stock gradients is zero: each one is checked)."""
    assert got.keys() == want.keys() and all(mx.linalg.norm(g).item() > 0 for g in want.values())
    errors = [(mx.linalg.norm(got[k] - g) / mx.linalg.norm(g)).item() for k, g in want.items()]
    return {"max_relative": max(errors), "parameters": len(errors)}


def ops_run(model, prompt):
    """How often each fused op ran in one forward pass (the profiler times the `*_fn` ops)."""
    prof = profiler.Profile()
    prof.recording = True
    with profiler.instrument(model, prof):
        mx.eval(model(prompt))
    return {op: len(t) for op, t in prof.times.items()}


def generated(model, tokenizer):
    from mlx_lm import stream_generate

    return [r.token for r in stream_generate(model, tokenizer, GENERATE_PROMPT, max_tokens=TOKENS)]


def run_generate(path, group):
    from mlx_lm import load
    from mlx_lm.utils import sharded_load

    out = {"unsharded": generated(*load(path))}
    model, tokenizer = sharded_load(path, tensor_group=group)
    out["stock"] = generated(model, tokenizer)
    out["report"] = mlx_fastops.patch(model).to_dict()
    out["patched"] = generated(model, tokenizer)
    return out


def main(out_dir, model_dir=None):
    # The CPU's loopback test on any machine (a GPU's tensor parallelism: benchmarks/sharded_bench.py).
    mx.set_default_device(mx.cpu)
    group = mx.distributed.init()
    result = {"rank": group.rank(), "size": group.size(),
              "cases": {f"{name}-b{bits}": run_case(name, bits, group) for name, bits in CASES}}
    if model_dir:
        result["generate"] = run_generate(model_dir, group)
    Path(out_dir, f"rank{group.rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])

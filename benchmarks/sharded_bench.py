"""Stock vs patched on a tensor-parallel model (issue 23), one process per GPU:

    mlx.launch --backend nccl -n 2 python3 benchmarks/sharded_bench.py [--models qwen3-4b,qwen3-8b]
        [--prompts 512] [--gen 128] [--trials 3] [--out benchmarks/results/cuda_sharded]
    (logic check on CPUs: mlx.launch --backend ring --hosts 127.0.0.1 -n 2 python benchmarks/sharded_bench.py
        --models qwen3-tiny --group-size 32 --prompts 16 --gen 8 --trials 1 --out /tmp/sharded)

Long options only: mlx.launch takes -p and -n after the script as its own.

Every rank builds a synthetic model (4-bit, --group-size: a row-sharded layer's input groups are
split between the ranks, so its input size / ranks must be a multiple of it) and shards it with mlx-lm's `model.shard(group)` over
all ranks (a name that is not synthetic, a local directory or a Hub repo, is loaded with
`mlx_lm.utils.sharded_load`), then runs the benchmark engine (mlx_fastops.bench.run) on it in step
with the other ranks: the same prompts, and every forward pass's all_sums pair the ranks up. Rank
0 prints the table with the patch report and writes OUT.md and OUT.json.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
from mlx_lm.utils import sharded_load

from mlx_fastops import bench, synthetic_model
from mlx_fastops.synthetic import CONFIGS


def sharded(name, group, group_size):
    if name in CONFIGS:
        model = synthetic_model(name, bits=4, group_size=group_size)
        model.shard(group)
        mx.eval(model.parameters())
        return model
    return sharded_load(name, tensor_group=group)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-4b,qwen3-8b")
    ap.add_argument("--group-size", type=int, default=64, help="synthetic models' quantisation group")
    ap.add_argument("--prompts", default="512", help="prompt lengths, comma-separated")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cuda_sharded")
    a = ap.parse_args()
    group = mx.distributed.init()
    lead = group.rank() == 0
    prompts = [int(p) for p in a.prompts.split(",")]
    results = []
    for name in a.models.split(","):
        model = sharded(name, group, a.group_size)
        results.append(bench.run(model, f"{name} over {group.size()} ranks", prompts=prompts, gen=a.gen,
                                 trials=a.trials, progress=lead))
        del model
    if lead:
        doc = bench.document(results, prompts=prompts, gen=a.gen, trials=a.trials, warmup=1, disable="",
                             ranks=group.size())
        print(bench.save(doc, a.out))
        for res in results:
            print(res["model"], res["patch"]["patched"])


if __name__ == "__main__":
    main()

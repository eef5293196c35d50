"""Decode and prefill with LoRA adapters (as `mlx_lm.load(path, adapter_path=...)` or a fine-tuning
run leaves them): stock vs patched through the benchmark engine (mlx_fastops.bench.run).

    python3 benchmarks/cuda_lora.py [--models qwen3-0.6b,qwen3-4b] [--rank 8] [--layers 16]
        [-p 512] [-g 128] [-n 3] [--out benchmarks/results/cuda_lora]

mlx-lm's linear_to_lora_layers puts LoRALinear layers (rank --rank, its default keys: every
projection of the attention and the MLP) on the last --layers decoder layers of a synthetic model;
lora_b is random (mlx-lm initialises it to zero, which would make the adapters no-ops). Patched,
those blocks run the fused projections plus the low-rank terms and leave the CUDA one-launch
layer; the patch report in the output says which blocks. Writes OUT.md and OUT.json.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
from mlx_lm.tuner.utils import linear_to_lora_layers

from mlx_fastops import bench, synthetic_model


def with_lora(model, rank, layers):
    linear_to_lora_layers(model, layers, {"rank": rank, "scale": 20.0, "dropout": 0.0})
    for path, m in model.named_modules():
        if type(m).__name__ == "LoRALinear":
            m.lora_b = 0.02 * mx.random.normal(m.lora_b.shape, key=mx.random.key(len(path)))
    model.eval()
    mx.eval(model.parameters())
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (the last ones) given adapters")
    ap.add_argument("-p", "--prompts", default="512")
    ap.add_argument("-g", "--gen", type=int, default=128)
    ap.add_argument("-n", "--trials", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cuda_lora")
    a = ap.parse_args()
    prompts = [int(p) for p in a.prompts.split(",")]
    results = []
    for name in a.models.split(","):
        model = with_lora(synthetic_model(name, bits=4), a.rank, a.layers)
        res = bench.run(model, f"{name} + LoRA r{a.rank} on {a.layers} layers", prompts=prompts, gen=a.gen,
                        trials=a.trials)
        results.append(res)
        del model
    doc = bench.document(results, prompts=prompts, gen=a.gen, trials=a.trials, warmup=1, disable="",
                         lora={"rank": a.rank, "layers": a.layers})
    print(bench.save(doc, a.out))


if __name__ == "__main__":
    main()

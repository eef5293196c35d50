"""Batched decoding as mlx_lm.server and batch_generate run it (mlx-lm's BatchGenerator, B
sequences at once): stock vs patched aggregate tok/s through the benchmark engine
(mlx_fastops.bench.run with batch=B).

    python3 benchmarks/cuda_batch.py [--models qwen3-0.6b,qwen3-4b] [--batches 1,4,8] [-p 512]
        [-g 128] [-n 3] [--out benchmarks/results/cuda_batch]

Per model and B: ppN xB (B prompts of N tokens / time to every row's first token) and tgG @N xB
(the B x G tokens after the first / their time). Patched, every decode step of up to 8 rows is
the fused CUDA step over StaticBatchKVCaches; steps of 9-64 rows run the composed fused ops with
the tensor-core qmm. Writes OUT.md and OUT.json (after every row).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_fastops import bench, synthetic_model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b")
    ap.add_argument("--batches", default="1,4,8", help="sequences decoded together")
    ap.add_argument("-p", "--prompts", default="512")
    ap.add_argument("-g", "--gen", type=int, default=128)
    ap.add_argument("-n", "--trials", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cuda_batch")
    a = ap.parse_args()
    prompts = [int(p) for p in a.prompts.split(",")]
    batches = [int(b) for b in a.batches.split(",")]
    results, text = [], ""
    for name in a.models.split(","):
        model = synthetic_model(name, bits=4)
        for B in batches:
            results.append(bench.run(model, name, prompts=prompts, gen=a.gen, trials=a.trials, batch=B))
            # Written after every row: a run cut short by a time limit keeps the rows it finished.
            doc = bench.document(results, prompts=prompts, gen=a.gen, trials=a.trials, warmup=1, disable="",
                                 batches=batches)
            text = bench.save(doc, a.out)
        del model
    print(text)


if __name__ == "__main__":
    main()

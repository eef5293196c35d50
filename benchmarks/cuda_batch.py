"""Batched decoding as mlx_lm.server and batch_generate run it (mlx-lm's BatchGenerator, B
sequences at once): stock vs patched aggregate tok/s through the benchmark engine
(mlx_fastops.bench.run with batch=B).

    python3 benchmarks/cuda_batch.py [--models qwen3-0.6b,qwen3-4b] [--batches 1,4,8] [-p 512]
        [-g 128] [-n 3] [--tune] [--out benchmarks/results/cuda_batch]

Per model and B: ppN xB (B prompts of N tokens / time to every row's first token) and tgG @N xB
(the B x G tokens after the first / their time). Patched, every decode step of up to 8 rows is
the fused CUDA step over StaticBatchKVCaches; steps of 9-64 rows run the compiled step's eight
launches a layer with the tensor-core qmm. --tune adds a copy patched with the tuner (tuned on
this device unless its decisions are cached), as `mlx-fastops bench --tune` does. Writes OUT.md
and OUT.json (after every row).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_fastops
from mlx_fastops import bench, synthetic_model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b")
    ap.add_argument("--batches", default="1,4,8", help="sequences decoded together")
    ap.add_argument("-p", "--prompts", default="512")
    ap.add_argument("-g", "--gen", type=int, default=128)
    ap.add_argument("-n", "--trials", type=int, default=3)
    ap.add_argument("--tune", action="store_true", help="also a tuned copy (patch(tune='on'))")
    ap.add_argument("--out", default="benchmarks/results/cuda_batch")
    a = ap.parse_args()
    prompts = [int(p) for p in a.prompts.split(",")]
    batches = [int(b) for b in a.batches.split(",")]
    results, text, reports = [], "", []
    for name in a.models.split(","):
        model = synthetic_model(name, bits=4)
        extra = [("tuned", synthetic_model(name, bits=4), "", "on")] if a.tune else []
        for B in batches:
            results.append(bench.run(model, name, prompts=prompts, gen=a.gen, trials=a.trials, batch=B, extra=extra))
            # Written after every row: a run cut short by a time limit keeps the rows it finished.
            doc = bench.document(results, prompts=prompts, gen=a.gen, trials=a.trials, warmup=1, disable="",
                                 batches=batches, tune=a.tune)
            text = bench.save(doc, a.out)
        if extra:   # the tuned copy's patch report, with the tuner's decisions (to_markdown's note points here)
            reports.append(f"{name} (tuned):\n{mlx_fastops.patch(extra[0][1])}")
            Path(f"{a.out}.md").write_text("\n\n".join([text, *reports]) + "\n")
        del model, extra
    print("\n\n".join([text, *reports]))


if __name__ == "__main__":
    main()

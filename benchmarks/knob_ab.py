"""Branch experiment: decode tok/s with gemv.STAGE_MAX_BYTES at several values, one patched copy
per value (same weights), alternating in one process through bench.compare (--batch: BatchGenerator).

    python3 benchmarks/knob_ab.py --models qwen3-4b,qwen3-8b --values 0,32768 [--batch 4] [-p 512] [-g 128] [-n 3]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    import mlx_fastops
    from mlx_fastops import bench, kernels, synthetic_model
    from mlx_fastops.backends.cuda import gemv as G

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-4b,qwen3-8b")
    ap.add_argument("--knob", default="STAGE_MAX_BYTES", help="a module constant of backends/cuda/gemv.py")
    ap.add_argument("--values", default="0,32768")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-g", type=int, default=128)
    ap.add_argument("-n", type=int, default=3)
    ap.add_argument("--out", default="/tmp/knob_ab.json")
    a = ap.parse_args()
    rings = [int(r) for r in a.values.split(",")]
    results = []
    for name in a.models.split(","):
        def prep(r):
            def f():
                if getattr(G, a.knob) != r:
                    setattr(G, a.knob, r)
                    kernels.clear_builders()
            return f
        variants = []
        for r in rings:
            m = synthetic_model(name, bits=4)
            prep(r)()
            mlx_fastops.patch(m, tune="off")
            variants.append((f"{a.knob}={r}", m, prep(r)))
        rows = bench.compare(variants, [a.p], a.g, a.n, 1, progress=lambda s: print(s, file=sys.stderr), batch=a.batch)
        for row in rows:
            cells = " | ".join(f"{k} {v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f}) x{v['ratio']:.3f}"
                               for k, v in row["variants"].items())
            print(f"| {name} | {row['test']} | {cells} |", flush=True)
        results.append({"model": name, "rows": rows})
        del variants
    Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

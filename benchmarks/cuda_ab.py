"""A setting of the CUDA backend A/B'd in one process: copies of a synthetic model, each patched and
traced under its own value of one module constant of mlx_fastops.backends.cuda, timed side by side
by the benchmark engine (bench.compare: alternating order, medians with min-max).

    python3 benchmarks/cuda_ab.py --set attention.ATTN_TARGET_BLOCKS=264,528 [--models qwen3-4b]
        [-p 8192,512] [-g 128] [-n 3] [--batch B | --kv-bits B] [--out PREFIX]

One copy per value (the first is the baseline of the ratios and of greedy agreement), patched under
its value. Before each of its generations a copy's value is set and the kernel builders' caches are
cleared, so that what its compiled step traces (at its first generation and at each new buffer
length) is built under its own value. A constant that another module of the backend imported by
name is refused. A setting that changes no arithmetic must keep the agreement whole. --batch B: B
rows through mlx-lm's BatchGenerator (bench.batch_generation); --kv-bits B: every copy generates over
mlx-lm's B-bit QuantizedKVCache (generate_step's kv_bits, as bench's kvB variant; the copies' names say
kvB). Prints the engine's table
(bench.to_markdown); --out PREFIX also writes PREFIX.md and PREFIX.json.
"""

import argparse
import ast
import importlib
import pkgutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_fastops
from mlx_fastops import bench, kernels, synthetic_model
from mlx_fastops.models import quant_label
from mlx_fastops.backends import cuda


def parse_setting(text):
    """'module.NAME=v1,v2,...' -> (module object, NAME, [values]); values are Python literals."""
    where, sep, values = text.partition("=")
    mod, _, name = where.rpartition(".")
    if not sep or not mod or not name or not values:
        raise SystemExit(f"cuda_ab: --set takes module.NAME=v1,v2 (e.g. attention.ATTN_TARGET_BLOCKS=264,528), "
                         f"got {text!r}")
    modules = {m.name: importlib.import_module(f"{cuda.__name__}.{m.name}")
               for m in pkgutil.iter_modules(cuda.__path__)}
    if mod not in modules:
        raise SystemExit(f"cuda_ab: no module {mod!r} in mlx_fastops.backends.cuda; there are {sorted(modules)}")
    module = modules[mod]
    if not hasattr(module, name):
        raise SystemExit(f"cuda_ab: mlx_fastops.backends.cuda.{mod} has no {name}")
    # A constant another module imported by name keeps its old value there: the copies would differ
    # in one module only.
    copies = sorted(other for other, m in modules.items() if m is not module and hasattr(m, name))
    if copies:
        raise SystemExit(f"cuda_ab: {name} is also a name in {copies}: setting {mod}.{name} would not reach them")
    vals = [ast.literal_eval(v) for v in values.split(",")]
    if len(vals) < 2 or len(set(map(repr, vals))) < len(vals):
        raise SystemExit(f"cuda_ab: --set needs at least two distinct values to compare, got {vals}")
    return module, name, vals


def setter(module, name, value):
    """A copy's prepare(): its value, and the kernel builders' caches cleared, so that whatever it
    builds from here on (its compiled step's trace, lm_head, prefill kernels) is built under its
    value; cleared at every call, so every value meets the same cache state whatever the order."""
    def prepare():
        setattr(module, name, value)
        kernels.clear_builders()
    return prepare


def ab(model_name, module, name, values, prompts, gen, trials, batch=None, kv_bits=None):
    """One model's result, as bench.run gives it: the rows of bench.compare over a copy per value."""
    default = getattr(module, name)
    try:
        copies = []
        for v in values:   # patched under its value: patch() itself reads constants (rows, groups)
            prepare = setter(module, name, v)
            prepare()
            model = synthetic_model(model_name, bits=4)
            mlx_fastops.patch(model, tune="off")
            if kv_bits:   # as bench.run's patched kvB variant
                copies.append((f"{name}={v!r} kv{kv_bits}", model, prepare, bench.kv_step_args(kv_bits)))
            else:
                copies.append((f"{name}={v!r}", model, prepare))
        rows = bench.compare(copies, prompts, gen, trials=trials, warmup=1, batch=batch)
    finally:
        setter(module, name, default)()
    return {"model": model_name, "quant": quant_label(model), "variants": [c[0] for c in copies], "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", required=True, dest="setting", help="module.NAME=v1,v2,... (module of backends/cuda)")
    ap.add_argument("--models", default="qwen3-4b")
    ap.add_argument("-p", "--prompts", default="512")
    ap.add_argument("-g", "--gen", type=int, default=128)
    ap.add_argument("-n", "--trials", type=int, default=3)
    ap.add_argument("--batch", type=int, default=None, help="rows through BatchGenerator (default: one sequence)")
    ap.add_argument("--kv-bits", type=int, choices=(4, 8), default=None,
                    help="every copy over mlx-lm's QuantizedKVCache of these bits (one sequence only)")
    ap.add_argument("--out", default=None, help="also write OUT.md and OUT.json")
    a = ap.parse_args(argv)
    if a.batch and a.kv_bits:
        raise SystemExit("cuda_ab: --kv-bits is for one sequence (generate_step), not with --batch")
    module, name, values = parse_setting(a.setting)
    prompts = [int(p) for p in a.prompts.split(",")]
    results = [ab(m, module, name, values, prompts, a.gen, a.trials, a.batch, a.kv_bits) for m in a.models.split(",")]
    doc = bench.document(results, prompts=prompts, gen=a.gen, trials=a.trials, warmup=1,
                         batches=[a.batch] if a.batch else None, setting=a.setting, quantized_kv=a.kv_bits)
    text = bench.save(doc, a.out) if a.out else bench.to_markdown(doc)
    print(text)
    return text


if __name__ == "__main__":
    main()

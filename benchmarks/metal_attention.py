"""Benchmarks of the Metal attention / norm / RoPE kernels against stock MLX, for an Apple-silicon Mac.

Not measured yet: there is no Metal device where this was written, so every statement in this
repository about these kernels is emulator-verified only. Run it on a Mac:

    python benchmarks/metal_attention.py                      # kernels + end to end, qwen3-0.6b
    python benchmarks/metal_attention.py --model qwen3-4b --skip-e2e
    python benchmarks/metal_attention.py --emulate            # Linux: plumbing smoke test in the CPU
                                                              # emulator, tiny shapes, timings meaningless

Kernels (median of --trials samples, each `--reps` independent calls in one graph, stock and ours
alternating):
  decode    stock mx.fast.scaled_dot_product_attention on the KVCache slice (what mlx-lm runs) vs our
            GQA decode kernel on the full cache buffers, context 512 / 2048 / 8192;
  prefill   stock SDPA (causal) vs our flash attention, 512 and 2048 tokens;
  norm      stock residual add + mx.fast.rms_norm vs rms_norm_residual (1 and 512 rows);
  qk rope   stock q_norm, k_norm, 2 x rope (4 dispatches) vs qk_norm_rope (1 and 512 tokens).
End to end (mlx_fastops.bench, mlx-lm's definitions): pp512, pp2048, tg128, stock vs patched with
only this family's fusions (MLX_FASTOPS_DISABLE=qkv,gate_up,lm_head) and with every fusion.
Results: benchmarks/results/metal_attention-<time>.{md,json}.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_fastops.backends import reference  # noqa: E402
from mlx_fastops.backends.metal import attention as A  # noqa: E402
from mlx_fastops.backends.metal import norm_rope as NR  # noqa: E402
from mlx_fastops.ops.weights import RopeSpec  # noqa: E402

# heads, kv heads, head_dim, hidden, rope base (real configs)
MODELS = {
    "qwen3-0.6b": dict(H=16, Hk=8, D=128, hidden=1024, base=1e6, qk_norm=True),
    "qwen3-4b": dict(H=32, Hk=8, D=128, hidden=2560, base=1e6, qk_norm=True),
    "llama-3.2-1b": dict(H=32, Hk=8, D=64, hidden=2048, base=5e5, qk_norm=False),
}
TINY = {"tiny": dict(H=4, Hk=2, D=64, hidden=192, base=1e4, qk_norm=True)}


def timeit(fns, trials, reps, warmup=2):
    """{name: [seconds per call]}; candidates alternate order each trial."""
    out = {k: [] for k in fns}
    names = list(fns)
    for t in range(warmup + trials):
        for name in (names if t % 2 == 0 else names[::-1]):
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval([fns[name](i) for i in range(reps)])
            mx.synchronize()
            if t >= warmup:
                out[name].append((time.perf_counter() - t0) / reps)
    return out


def kernel_cases(cfg, dtype, contexts, prompts):
    H, Hk, D = cfg["H"], cfg["Hk"], cfg["D"]
    key = iter(mx.random.split(mx.random.key(0), 64))
    rnd = lambda *s: mx.random.normal(s, key=next(key)).astype(dtype)  # noqa: E731
    cases = []
    for n in contexts:
        alloc = 256 * (-(-(n + 1) // 256))
        k, v = rnd(1, Hk, alloc, D), rnd(1, Hk, alloc, D)
        qs = [rnd(1, H, 1, D) for _ in range(4)]
        mx.eval(k, v, qs)
        cases.append((f"decode ctx{n}", {
            "stock": lambda i, q=qs, k=k, v=v, n=n: mx.fast.scaled_dot_product_attention(
                q[i % 4], k[..., :n, :], v[..., :n, :], scale=D ** -0.5),
            "ours": lambda i, q=qs, k=k, v=v, n=n: A.decode_attention(q[i % 4], k, v, n, D ** -0.5)}))
    for n in prompts:
        q, k, v = rnd(1, H, n, D), rnd(1, Hk, n, D), rnd(1, Hk, n, D)
        mx.eval(q, k, v)
        cases.append((f"prefill {n}", {
            "stock": lambda i, q=q, k=k, v=v: mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5,
                                                                                    mask="causal"),
            "ours": lambda i, q=q, k=k, v=v: A.flash_attention(q, k, v, D ** -0.5, "causal")}))
    w = rnd(cfg["hidden"])
    rope = RopeSpec(D, False, cfg["base"], 1.0)
    qn = rnd(D) if cfg["qk_norm"] else None
    for rows in (1, 512):
        x, r = rnd(1, rows, cfg["hidden"]), rnd(1, rows, cfg["hidden"])
        q, k = rnd(1, rows, H, D), rnd(1, rows, Hk, D)
        mx.eval(x, r, q, k)

        def stock_add_norm(i, x=x, r=r):
            h = r + x
            return h, mx.fast.rms_norm(h, w, 1e-6)

        cases.append((f"add+rmsnorm rows{rows}", {
            "stock": stock_add_norm, "ours": lambda i, x=x, r=r: NR.rms_norm_residual(x, r, w, 1e-6)}))
        cases.append((f"qk norm+rope L{rows}", {
            "stock": lambda i, q=q, k=k: reference.qk_norm_rope(q, k, qn, qn, 1e-6, rope, 100),
            "ours": lambda i, q=q, k=k: NR.qk_norm_rope(q, k, qn, qn, 1e-6, rope, 100)}))
    return cases


def check(cases):
    """Ours vs stock outputs for every case (max abs difference)."""
    res = {}
    for name, fns in cases:
        a, b = fns["stock"](0), fns["ours"](0)
        a = a if isinstance(a, tuple) else (a,)
        b = b if isinstance(b, tuple) else (b,)
        res[name] = max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max().item() for x, y in zip(a, b))
    return res


def end_to_end(model_name, trials):
    from mlx_fastops import bench, synthetic

    out = {}
    for label, disable in (("attention family only", "qkv,gate_up,lm_head"), ("all fusions", "")):
        os.environ["MLX_FASTOPS_DISABLE"] = disable
        model = synthetic.synthetic_model(model_name, bits=4)
        res = bench.run(model, model_name, prompts=(512, 2048), gen=128, trials=trials)
        out[label] = res
        doc = bench.document([res], prompts=[512, 2048], gen=128, trials=trials, warmup=1, disable=disable)
        print(f"\n### {label} (MLX_FASTOPS_DISABLE={disable or '-'})\n\n" + bench.to_markdown(doc))
    os.environ.pop("MLX_FASTOPS_DISABLE", None)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    p.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--emulate", action="store_true", help="Linux smoke test in the CPU emulator")
    args = p.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    if args.emulate:
        sys.path.insert(0, str(ROOT / "tests"))
        import metal_emu

        from mlx_fastops import kernels

        metal_emu.config.schedules = "min"
        with kernels.use_metal_factory(metal_emu.metal_kernel):
            cases = kernel_cases(TINY["tiny"], dtype, (40, 300), (20,))
            for name, err in check(cases).items():
                print(f"{name:24s} max |ours - stock| = {err:.4g}  (emulator; no timing)")
        return
    if not mx.metal.is_available():
        raise SystemExit("needs Metal (an Apple-silicon Mac); use --emulate for a plumbing check")
    from mlx_fastops.bench import machine

    cfg = MODELS[args.model]
    cases = kernel_cases(cfg, dtype, (512, 2048, 8192), (512, 2048))
    errors = check(cases)
    lines = [f"## Metal attention kernels, {args.model} shapes, {args.dtype}", "",
             "| case | stock us | ours us | speed-up | max abs diff |", "|---|---|---|---|---|"]
    rows = []
    for name, fns in cases:
        t = timeit(fns, args.trials, args.reps)
        s, o = statistics.median(t["stock"]) * 1e6, statistics.median(t["ours"]) * 1e6
        rows.append({"case": name, "stock_us": t["stock"], "ours_us": t["ours"], "max_abs_diff": errors[name]})
        lines.append(f"| {name} | {s:.1f} | {o:.1f} | {s / o:.3f} | {errors[name]:.3g} |")
        print(lines[-1])
    result = {"machine": machine(), "model": args.model, "dtype": args.dtype, "kernels": rows}
    if not args.skip_e2e:
        result["end_to_end"] = end_to_end(args.model, args.trials)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = ROOT / "benchmarks" / "results" / f"metal_attention-{stamp}"
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}.md/.json")


if __name__ == "__main__":
    main()

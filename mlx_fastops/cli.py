"""mlx-fastops: bench | generate | verify | profile | tune | serve (flags named like mlx-lm's)."""

import statistics
import sys

import mlx.core as mx

from . import cli_args
from .cli_args import at_least, list_at_least, model_args, output_file, profile_args, some_fusion_names


def _load(args, source=None):
    from .models import load

    return load(source or args.sources[0], bits=4 if args.bits is None else args.bits or None,
                group_size=args.group_size or 64, dtype=args.dtype)


def cmd_bench(args):
    from . import bench
    from .models import on_gpu

    # Without a GPU every model gets the CPU plan (MLX's CPU backend decodes a 0.6B model at ~1 tok/s
    # or less), and the time it will take is measured and said before each model's run.
    cpu = not on_gpu()
    prompts = args.prompt_tokens or ([32] if cpu else [512, 2048])
    gen = args.generation_tokens if args.generation_tokens is not None else 16 if cpu else 128
    trials = args.num_trials if args.num_trials is not None else 3 if cpu else 5
    results, reports = [], []
    for source in args.sources:
        model, _, label, note = _load(args, source)
        # a variant is a copy of its own (patch settings belong to a model object)
        extra = [(f"without {names}", _load(args, source)[0], f"{args.disable},{names}", "off")
                 for names in args.variant]
        if args.tune:   # measured here unless this device's decisions for the model are cached
            extra.append(("tuned", _load(args, source)[0], args.disable, "on"))
        if cpu and not args.quiet:
            _say_estimate(bench, model, label, prompts, gen, args.warmup + trials,
                          2 + bool(args.kv_bits) + len(extra))
        result = bench.run(model, label, prompts, gen, trials=trials, warmup=args.warmup, disable=args.disable,
                           extra=extra, progress=not args.quiet, kv_bits=args.kv_bits)
        result["note"] = note
        results.append(result)
        reports.append(f"{label}:\n{_report_of(model)}")
        reports += [f"{label} ({name}):\n{_report_of(copy)}" for name, copy, _, tune in extra if tune != "off"]
        del model, extra
        mx.clear_cache()
    doc = bench.document(results, prompts=prompts, gen=gen, trials=trials, warmup=args.warmup,
                         disable=args.disable, variants=args.variant, tune=args.tune, kv_bits=args.kv_bits)
    notes = [f"Model note ({r['model']}): {r['note']}" for r in results if r["note"]]
    text = "\n\n".join([bench.to_markdown(doc), *notes, *reports])
    print(text)
    if args.json:
        bench.save_json(doc, args.json)
    if args.markdown:
        args.markdown.write_text(f"# mlx-fastops bench\n\n{text}\n")
    if args.plot:
        bench.plot(doc, args.plot)
    return 0


def cmd_tune(args):
    import json
    import time

    from . import Tuner, bench, patch, tune_cache

    model, _, label, _ = _load(args)
    tuner = Tuner("force", rows=args.rows, prefill=args.prefill, context=args.context, samples=args.samples)
    t0 = time.perf_counter()
    report = patch(model, disable=args.disable, tune=tuner)
    wall = time.perf_counter() - t0
    print(f"model: {label}\n{report}\n\nfirst tuning: {wall:.1f} s wall (patch included), "
          f"{report.tuning.seconds:.1f} s measuring; decisions cached in {tune_cache.path()}")
    if args.json:
        doc = {"machine": bench.machine(), "model": label, "settings": {**tuner.shapes(), "samples": tuner.samples},
               "wall_s": wall, "cache": str(tune_cache.path()), "patch": report.to_dict()}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


def _say_estimate(bench, model, label, prompts, gen, rounds, n_variants):
    e = bench.estimate(model, prompts, gen, rounds, n_variants)
    took = f"{e['seconds'] / 60:.0f} min" if e["seconds"] >= 90 else f"{e['seconds']:.0f} s"
    hint = "; smaller -p/-g/-n make it shorter" if e["seconds"] >= 300 else ""
    print(f"[bench] {label}: about {took} on {mx.default_device()} for -p {','.join(map(str, prompts))} -g {gen}, "
          f"{rounds} rounds of {n_variants} variants (a {e['prefill_tokens']}-token prefill took "
          f"{e['prefill_s']:.2f} s and a decode step {e['step_s']:.2f} s just now){hint}", file=sys.stderr, flush=True)


def _report_of(model):
    from . import patch

    return str(patch(model))


def _prompt_tokens(tokenizer, model, text):
    if tokenizer is not None:
        return mx.array(tokenizer.encode(text))
    # Synthetic models have no tokenizer: words "t<id>" are token ids, other words hash into the vocab.
    vocab = model.args.vocab_size
    ids = []
    for word in text.split():
        ids.append(int(word[1:]) % vocab if word[:1] == "t" and word[1:].isdigit()
                   else sum(map(ord, word)) * 2654435761 % vocab)
    return mx.array(ids or [0])


def cmd_generate(args):
    from mlx_lm.generate import generate_step

    from . import patch

    model, tokenizer, label, _ = _load(args)
    print(patch(model, disable=args.disable), file=sys.stderr)
    if tokenizer is not None:
        import mlx_lm

        mlx_lm.generate(model, tokenizer, args.prompt, max_tokens=args.max_tokens, verbose=True)
        return 0
    import time

    prompt = _prompt_tokens(None, model, args.prompt)
    t0 = time.perf_counter()
    out = []
    for (tok, _), _ in zip(generate_step(prompt, model, max_tokens=args.max_tokens), range(args.max_tokens)):
        out.append(tok)
        print(f"t{tok}", end=" ", flush=True)
    dt = time.perf_counter() - t0
    print(f"\n==========\nModel: {label}\nGeneration: {len(out)} tokens, {len(out) / dt:.2f} tokens-per-sec "
          f"(prefill included)\nPeak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    return 0


def cmd_verify(args):
    """Exit 1 only where the standard fails: bit-exact tokens and log-probs in float32 on the
    reference path; elsewhere (half precision, GPU kernels) fidelity.judge against float32."""
    from mlx_lm.generate import generate_step

    from . import fidelity, patch, unpatch

    model, tokenizer, label, _ = _load(args)
    n = args.num_tokens
    prompt = (_prompt_tokens(tokenizer, model, args.prompt) if args.prompt
              else mx.random.randint(0, model.args.vocab_size, (args.prompt_len,), key=mx.random.key(args.seed)))

    def greedy():
        steps = list(zip(generate_step(prompt, model, max_tokens=n), range(n)))
        return [int(tok) for (tok, _), _ in steps], mx.stack([lp for (_, lp), _ in steps])

    unpatch(model)
    stock, stock_lp = greedy()
    report = patch(model, disable=args.disable)
    fused, fused_lp = greedy()
    print(report)
    backends = sorted({e.backend for e in report.entries if e.status == "fused"}) or ["none (nothing fused)"]
    exact = stock_lp.dtype == mx.float32 and set(backends) <= {"reference", "none (nothing fused)"}
    first = next((i for i, (a, b) in enumerate(zip(stock, fused)) if a != b), None)
    same_input = n if first is None else first + 1   # steps whose logits had the same tokens before them
    lp_diff = mx.max(mx.abs(stock_lp[:same_input].astype(mx.float32) - fused_lp[:same_input])).item()
    top2 = mx.topk(stock_lp.astype(mx.float32), 2, axis=-1)
    margins = (mx.max(top2, axis=-1) - mx.min(top2, axis=-1)).tolist()
    dtype = str(stock_lp.dtype).replace("mlx.core.", "")
    print(f"model: {label}; prompt {prompt.size} tokens; {n} greedy tokens; {dtype} logits; "
          f"fused ops on {', '.join(backends)}")
    print(f"stock top-1/top-2 margin: median {statistics.median(margins):.3f}, min {min(margins):.3f}; "
          f"distinct tokens: {len(set(stock))}")
    print(f"log-probs while the tokens agree ({same_input} steps): max abs diff {lp_diff:.3e}")
    diverged = (f"tokens differ from token {first} on: stock {stock[first]} vs patched {fused[first]} "
                f"(stock's margin there {margins[first]:.3f})\nstock:   {stock[max(0, first - 4): first + 4]}\n"
                f"patched: {fused[max(0, first - 4): first + 4]}") if first is not None else None
    if exact:
        print("standard: float32 on the reference path is bit-exact (tokens and log-probs identical to stock)")
        if args.oracle:
            _print_against(fidelity.judge(*_forced_along(args, model, prompt, stock)))
        if first is None and lp_diff == 0:
            print(f"OK: {n}/{n} greedy tokens identical, log-probs bit-identical")
            return 0
        print(f"FAILED: {diverged}" if diverged else
              f"FAILED: {n}/{n} greedy tokens identical, but the log-probs differ by up to {lp_diff:.3e}")
        return 1
    print("standard: judged by the same model in float32: patched no further from it than stock, and "
          "stock's token wherever stock's margin is clear")
    stock_f, fused_f, oracle = _forced_along(args, model, prompt, stock)
    verdict = fidelity.judge(stock_f, fused_f, oracle)
    _print_against(verdict)
    if first is None:
        print(f"tokens: {n}/{n} greedy tokens identical")
    else:
        margin, error = verdict["margin"][first], verdict["error"][first]
        if first in verdict["changed"]:
            kind = "a clear decision, which patched changes"
        elif margin <= 2 * error:
            kind = (f"within twice stock's own largest logit error against float32 there ({error:.3f}): a "
                    "near-tie, where either half-precision path may pick either token")
        else:
            kind = "clear, and patched keeps it when fed the same tokens"
        print(f"{diverged}\nat token {first}, stock's teacher-forced margin {margin:.3f} is {kind}")
    if verdict["problems"]:
        print("FAILED: " + "; ".join(verdict["problems"]))
        return 1
    differ = "" if first is None else f"; the tokens differ from token {first} on (above)"
    print(f"OK: patched is no further from float32 than stock (mean |logit diff| {verdict['patched']['mean_abs']:.4f}"
          f" <= {verdict['stock']['mean_abs']:.4f}) and keeps every clear decision{differ}")
    return 0


def _forced_along(args, model, prompt, tokens):
    """Teacher-forced logits along `tokens` of stock, patched and a float32 copy of the model."""
    from . import fidelity, patch, unpatch

    oracle = fidelity.forced_logits(fidelity.fp32_oracle(_load(args)[0]), prompt, tokens)
    unpatch(model)
    stock = fidelity.forced_logits(model, prompt, tokens)
    patch(model, disable=args.disable)
    return stock, fidelity.forced_logits(model, prompt, tokens), oracle


def _print_against(verdict):
    print("against the same model in float32 (dequantised weights, float32 activations), fed stock's tokens:")
    print("| path | max abs logit diff | mean abs logit diff | top-1 = float32 |\n|---|---|---|---|")
    for name in ("stock", "patched"):
        r = verdict[name]
        print(f"| {name} | {r['max_abs']:.4f} | {r['mean_abs']:.5f} | {100 * r['top1_agree']:.1f}% |")
    steps = len(verdict["margin"])
    kept = f"changes {len(verdict['changed'])}" if verdict["changed"] else "keeps all"
    print(f"clear decisions (stock's top-1/top-2 margin over twice its largest logit error against float32): "
          f"{verdict['clear']} of {steps}; patched {kept}")


def cmd_profile(args):
    from . import patch, profiler

    model, _, label, _ = _load(args)
    prefill = args.prefill is not None
    if not args.stock:
        # Per-op timing evaluates each op on its own, which a compiled decode step (CUDA) cannot do;
        # prefill chunks never take that step.
        print(patch(model, disable=args.disable if prefill else f"{args.disable},compile"))
        if not prefill:
            print("(profiled without the compiled decode step: each op is evaluated on its own)")
    if args.capture:   # cli_args.check has made sure this machine can
        profiler.capture(model, args.capture)
        print(f"wrote {args.capture}")
    given = {k: v for k, v in (("context", args.prompt_tokens), ("recorded", args.num_tokens),
                               ("warmup", args.warmup)) if v is not None}   # else each profile's defaults
    result = (profiler.profile_prefill(model, args.prefill, **given) if prefill
              else profiler.profile(model, **given))
    print(f"model: {label} ({'stock' if args.stock else 'patched'}), device {mx.default_device()}")
    print(profiler.to_markdown(result))
    if args.trace:
        profiler.write_trace(result, args.trace)
        print(f"wrote {args.trace}")
    return 0


def cmd_serve(args):
    from . import serve

    return serve.serve(args.sources[0], args.server_argv, disable=args.disable,
                       bits=4 if args.bits is None else args.bits or None, group_size=args.group_size or 64,
                       dtype=args.dtype, warm_up_rows=args.warm_up_rows)


def build_parser():
    p = cli_args.Parser(prog="mlx-fastops", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="stock vs patched tokens/s, alternating in one process",
                       description="Stock vs patched in one process: per prompt length, prompt tok/s (ppN) "
                                   "and decode tok/s after it (tgG @N), alternating after warm-up, "
                                   "median (min-max) of the trials. --model takes several, comma-separated. "
                                   "Without a GPU, the time a model's run will take is measured and said first.")
    model_args(b)
    b.add_argument("-p", "--prompt-tokens", type=list_at_least(1), default=None,
                   help="prompt lengths, comma-separated (default: 512,2048 on a GPU, 32 without one)")
    b.add_argument("-g", "--generation-tokens", type=at_least(0), default=None,
                   help="tokens timed after the first; 0: prompt rows only (default: 128 on a GPU, 16 without)")
    b.add_argument("-n", "--num-trials", type=at_least(1), default=None,
                   help="timed trials per prompt length (default: 5 on a GPU, 3 without)")
    b.add_argument("--warmup", type=at_least(0), default=1, help="untimed rounds per prompt length (default: 1)")
    b.add_argument("--variant", type=some_fusion_names, action="append", default=[], metavar="NAMES",
                   help="also time a copy patched with these fusions off (comma-separated; repeatable) "
                        "(default: none)")
    b.add_argument("--tune", action="store_true",
                   help="also time a copy patched with tune (each fusion timed against stock on this device, "
                        "kept only where it wins; cached decisions where there are) (default: off)")
    b.add_argument("--kv-bits", type=int, choices=(4, 8), default=None,
                   help="also time the patched model generating over mlx-lm's quantised KV cache "
                        "(generate_step's kv_bits, group size 64, from the first token) (default: off)")
    b.add_argument("--json", type=output_file, help="write the results as JSON (default: not written)")
    b.add_argument("--markdown", type=output_file, help="write the table as a Markdown file (default: not written)")
    b.add_argument("--plot", type=output_file, help="write a bar chart of every row, PNG; needs matplotlib "
                                                    "(default: not drawn)")
    b.add_argument("-q", "--quiet", action="store_true",
                   help="no progress line nor time estimate on stderr (default: off)")
    b.set_defaults(func=cmd_bench)

    g = sub.add_parser("generate", help="generate text with the patched model")
    model_args(g)
    g.add_argument("--prompt", "-p", default="hello",
                   help="text; for synthetic models words t<id> are token ids (default: %(default)s)")
    g.add_argument("--max-tokens", "-m", type=at_least(1), default=64, help="tokens to generate (default: %(default)s)")
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("verify", help="greedy tokens and logits, stock vs patched",
                       description="Stock vs patched greedy tokens and log-probs. In float32 on the reference "
                                   "path they must be bit-identical; otherwise both are judged against the same "
                                   "model evaluated in float32, fed stock's tokens: patched must be no further "
                                   "from it than stock and keep stock's token wherever stock's margin is clear. "
                                   "Exits 1 only where that standard fails.")
    model_args(v)
    v.add_argument("-n", "--num-tokens", type=at_least(1), default=32,
                   help="greedy tokens to compare (default: %(default)s)")
    v.add_argument("--prompt", default=None, help="text prompt (default: --prompt-len random tokens)")
    v.add_argument("--prompt-len", type=at_least(1), default=16,
                   help="length of the random prompt (default: %(default)s)")
    v.add_argument("--seed", type=at_least(0), default=0, help="seed of the random prompt (default: %(default)s)")
    v.add_argument("--oracle", action="store_true",
                   help="in float32 on the reference path, also compare with the float32 evaluation "
                        "(always done otherwise) (default: off)")
    v.set_defaults(func=cmd_verify)

    f = sub.add_parser("profile", help="per-op time table of decode steps or (--prefill N) prefill chunks",
                       description="Every op of a decode step, or with --prefill N of an N-token prefill chunk, "
                                   "evaluated on its own and timed: per op the median time per step/chunk over the "
                                   "recorded ones (after warm-up) and its share, beside the unsynchronised "
                                   "step/chunk time and the host time to build its graph.")
    model_args(f)
    profile_args(f)
    f.set_defaults(func=cmd_profile)

    t = sub.add_parser("tune", help="time each fusion against stock on this device, print the decisions",
                       description="Patches the model with every fusion on, times each fusion's op against the "
                                   "stock ops it replaces on the model's shapes (interleaved, after warm-up), and "
                                   "keeps a fusion only where it is faster beyond the spread (a GPU's prefill path by "
                                   "whole prompt chunks; CUDA's fast_decode and compile by whole decode steps). Always measures; the decisions replace this "
                                   "device's cached ones, which patch() then uses.")
    model_args(t)
    t.add_argument("--rows", type=list_at_least(1), default=[1, 4],
                   help="decode batch sizes, comma-separated (default: 1,4)")
    t.add_argument("--prefill", type=list_at_least(1), default=None,
                   help="prefill chunk lengths, comma-separated (default: 64,1024,2048 on a GPU, 512 without one)")
    t.add_argument("--context", type=at_least(1), default=512,
                   help="KV length of decode attention and of the prompt before timed decode steps (default: 512)")
    t.add_argument("--samples", type=at_least(4), default=15,
                   help="timed samples per side and shape (default: 15)")
    t.add_argument("--json", type=output_file, help="write the decisions as JSON (default: not written)")
    t.set_defaults(func=cmd_tune)

    s = sub.add_parser("serve", help="mlx-lm's server (mlx_lm.server) on the patched model", allow_abbrev=False,
                       description="mlx-lm's OpenAI-compatible server, mlx_lm.server, with the model patched "
                                   "once it is loaded (the patch report goes to stderr): the same endpoints "
                                   "(/v1/chat/completions, /v1/completions, streaming or not, /v1/models, "
                                   "/health) and every other flag of mlx_lm.server (--host, --port, --max-tokens, "
                                   "...: see mlx_lm.server --help), passed to it as given. --model also takes "
                                   "a synthetic name. SIGINT or SIGTERM stops it (exit status 0).")
    model_args(s)
    s.add_argument("--warm-up-rows", type=at_least(0), default=None, metavar="N",
                   help="before serving, decode once at every batch size 1..N and prefill one prompt of "
                        "each chunk length 2-64, so that kernels built on first use (CUDA's, by NVRTC) are "
                        "built before serving; 0: off (default: on the CUDA "
                        "backend the server's --decode-concurrency, or --prompt-concurrency if larger; "
                        "on the others 0)")
    s.set_defaults(func=cmd_serve)
    return p


def main(argv=None):
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
        if rest and args.command != "serve":   # serve passes the flags it does not know to mlx_lm.server
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as e:   # --help, or a bad flag (its one-line error already printed)
        return e.code or 0
    args.server_argv = rest
    try:
        cli_args.check(args)
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"mlx-fastops {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

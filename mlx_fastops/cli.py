"""mlx-fastops: bench | generate | verify | profile (flags named like mlx-lm's)."""

import argparse
import statistics
import sys
from pathlib import Path

import mlx.core as mx


def _ints(text):
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _model_args(p):
    p.add_argument("--model", "-M", default=None,
                   help="synthetic model name, local mlx-lm directory or Hugging Face repo "
                        "(default: synthetic qwen3-0.6b 4-bit on a GPU, qwen3-cpu without one)")
    p.add_argument("--bits", type=int, default=4, help="synthetic models: 4 or 8, 0 for float")
    p.add_argument("--group-size", type=int, default=64, help="synthetic models: 32, 64 or 128")
    p.add_argument("--disable", default="", help="comma-separated fusions to leave stock")


def _load(args):
    from .models import load

    model, tokenizer, label, note = load(args.model, bits=args.bits or None,
                                         group_size=args.group_size)
    return model, tokenizer, label, note


def cmd_bench(args):
    from . import bench
    from .models import load, on_gpu

    cpu = not on_gpu() and args.model is None
    prompts = args.prompt_tokens or ([32] if cpu else [512, 2048])
    gen = args.generation_tokens if args.generation_tokens is not None else 16 if cpu else 128
    trials = args.num_trials if args.num_trials is not None else 3 if cpu else 5
    if any(p < 1 for p in prompts) or gen < 0 or trials < 1 or args.warmup < 0:
        raise ValueError("-p takes prompt lengths >= 1, -g >= 0, -n >= 1, --warmup >= 0")
    specs = args.model.split(",") if args.model else [None]
    quant = dict(bits=args.bits or None, group_size=args.group_size)
    results, reports = [], []
    for spec in specs:
        model, _, label, note = load(spec, **quant)
        # a variant is a copy of its own (patch settings belong to a model object)
        extra = [(f"without {names}", load(spec, **quant)[0], f"{args.disable},{names}") for names in args.variant]
        result = bench.run(model, label, prompts, gen, trials=trials, warmup=args.warmup, disable=args.disable,
                           extra=extra, progress=not args.quiet)
        result["note"] = note
        results.append(result)
        reports.append(f"{label}:\n{_report_of(model)}")
        del model, extra
        mx.clear_cache()
    doc = bench.document(results, prompts=prompts, gen=gen, trials=trials, warmup=args.warmup,
                         disable=args.disable, variants=args.variant)
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
    from mlx_lm.generate import generate_step

    from . import patch, unpatch

    model, tokenizer, label, _ = _load(args)
    vocab = model.args.vocab_size
    prompt = (_prompt_tokens(tokenizer, model, args.prompt) if args.prompt
              else mx.random.randint(0, vocab, (args.prompt_len,), key=mx.random.key(args.seed)))

    def greedy():
        toks, margins, last = [], [], None
        for (tok, logprobs), _ in zip(generate_step(prompt, model, max_tokens=args.num_tokens),
                                      range(args.num_tokens)):
            toks.append(tok)
            top2 = mx.sort(logprobs)[-2:]
            margins.append((top2[1] - top2[0]).item())
            last = logprobs
        return toks, margins, last

    unpatch(model)
    stock, margins, stock_last = greedy()
    report = patch(model, disable=args.disable)
    fused, _, fused_last = greedy()
    print(report)
    diff = mx.abs(stock_last.astype(mx.float32) - fused_last.astype(mx.float32))
    rel = (mx.max(diff) / mx.maximum(mx.max(mx.abs(stock_last.astype(mx.float32))), 1e-9)).item()
    print(f"model: {label}; prompt {prompt.size} tokens; {args.num_tokens} greedy tokens")
    print(f"stock top-1/top-2 margin: median {statistics.median(margins):.3f}, min {min(margins):.3f}; "
          f"distinct tokens: {len(set(stock))}")
    print(f"last-token log-probs: max abs diff {mx.max(diff).item():.3e}, relative {rel:.3e}")
    if args.oracle:
        _oracle_table(args, model, prompt, stock)
    first = next((i for i, (a, b) in enumerate(zip(stock, fused)) if a != b), None)
    if first is None:
        print(f"OK: {len(stock)}/{len(stock)} greedy tokens identical")
        return 0
    print(f"DIVERGED at token {first}: stock {stock[first]} vs patched {fused[first]} "
          f"(stock margin there {margins[first]:.3f})")
    print(f"stock:   {stock[max(0, first - 4): first + 4]}\npatched: {fused[max(0, first - 4): first + 4]}")
    return 1


def _oracle_table(args, model, prompt, tokens):
    """Stock and patched logits along stock's tokens, each against the float32 oracle."""
    from . import fidelity, patch, unpatch

    oracle_model, _, _, _ = _load(args)
    oracle = fidelity.forced_logits(fidelity.fp32_oracle(oracle_model), prompt, tokens)
    rows = []
    unpatch(model)
    rows.append(("stock", fidelity.against(fidelity.forced_logits(model, prompt, tokens), oracle)))
    patch(model, disable=args.disable)
    rows.append(("patched", fidelity.against(fidelity.forced_logits(model, prompt, tokens), oracle)))
    print("against the same model in float32 (dequantised weights), fed stock's tokens:")
    print("| path | max abs logit diff | mean abs logit diff | top-1 = float32 |\n|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['max_abs']:.4f} | {r['mean_abs']:.5f} | {100 * r['top1_agree']:.1f}% |")


def cmd_profile(args):
    from . import patch, profiler

    model, _, label, _ = _load(args)
    if not args.stock:
        # Per-op timing evaluates each op on its own, which a compiled decode step (CUDA) cannot do.
        print(patch(model, disable=f"{args.disable},compile"))
        print("(profiled without the compiled decode step: each op is evaluated on its own)")
    if args.capture:
        try:
            profiler.capture(model, args.capture)
            print(f"wrote {args.capture}")
        except RuntimeError as e:
            print(f"--capture: {e}", file=sys.stderr)
            return 2
    result = profiler.profile(model, prompt_len=args.prompt_tokens, tokens=args.num_tokens,
                              warmup=args.warmup)
    print(f"model: {label} ({'stock' if args.stock else 'patched'}), device {mx.default_device()}")
    print(profiler.to_markdown(result))
    if args.trace:
        profiler.write_trace(result, args.trace)
        print(f"wrote {args.trace}")
    return 0


def build_parser():
    p = argparse.ArgumentParser(prog="mlx-fastops", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="stock vs patched tokens/s, alternating in one process",
                       description="Stock vs patched in one process: per prompt length, prompt tok/s (ppN) "
                                   "and decode tok/s after it (tgG @N), alternating after warm-up, "
                                   "median (min-max) of the trials. --model takes several, comma-separated.")
    _model_args(b)
    b.add_argument("-p", "--prompt-tokens", type=_ints, default=None,
                   help="prompt lengths, comma-separated (default: 512,2048 on a GPU, 32 without one)")
    b.add_argument("-g", "--generation-tokens", type=int, default=None,
                   help="tokens timed after the first; 0: prompt rows only (default: 128 on a GPU, 16 without)")
    b.add_argument("-n", "--num-trials", type=int, default=None,
                   help="timed trials per prompt length (default: 5 on a GPU, 3 without)")
    b.add_argument("--warmup", type=int, default=1, help="untimed rounds per prompt length (default: 1)")
    b.add_argument("--variant", action="append", default=[], metavar="NAMES",
                   help="also time a copy patched with these fusions off (comma-separated; repeatable)")
    b.add_argument("--json", type=Path, help="write the results as JSON")
    b.add_argument("--markdown", type=Path, help="write the table as a Markdown file")
    b.add_argument("--plot", type=Path, help="write a bar chart of every row (PNG)")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    b.set_defaults(func=cmd_bench)

    g = sub.add_parser("generate", help="generate text with the patched model")
    _model_args(g)
    g.add_argument("--prompt", "-p", default="hello")
    g.add_argument("--max-tokens", "-m", type=int, default=64)
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("verify", help="greedy tokens and logits, stock vs patched")
    _model_args(v)
    v.add_argument("-n", "--num-tokens", type=int, default=32)
    v.add_argument("--prompt", default=None, help="text prompt (default: random tokens)")
    v.add_argument("--prompt-len", type=int, default=16)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--oracle", action="store_true",
                   help="also compare stock and patched with the model evaluated in float32")
    v.set_defaults(func=cmd_verify)

    f = sub.add_parser("profile", help="per-op decode time table")
    _model_args(f)
    f.add_argument("-n", "--num-tokens", type=int, default=16)
    f.add_argument("--prompt-tokens", type=int, default=32)
    f.add_argument("--warmup", type=int, default=4, help="decode steps not recorded")
    f.add_argument("--stock", action="store_true", help="profile the unpatched model")
    f.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace JSON")
    f.add_argument("--capture", type=Path, help="Metal GPU capture (FILE.gputrace)")
    f.set_defaults(func=cmd_profile)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"mlx-fastops {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

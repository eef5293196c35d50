"""Stock vs patched (and variants) in one process, alternating after warm-up, with mlx-lm's timing.

One case is one greedy generation of gen + 1 tokens after a random N-token prompt, through
mlx_lm's own decode loop (generate_step: greedy, async pipelining). It gives two rows:
  ppN       N prompt tokens / time to the first generated token (prefill plus the first token's
            forward pass and sampling, as mlx_lm.generate reports prompt tok/s)
  tgG @N    the G tokens after the first / the time after the first
Each trial runs every variant once on the same prompt, in an order that rotates between trials
(stock and patched: alternating), after `warmup` untimed rounds per prompt length (kernel builds,
compile traces, cache growth). A row is the median (min-max) over trials; the ratio is of medians
against the first variant (stock); peak memory is mx.get_peak_memory over each generation (the
process's arrays, so every loaded variant's weights count); greedy agreement is, per trial, how many
generated tokens equal stock's from the first on, the fewest over the trials. Python's garbage
collector is paused while a generation runs: a collection takes milliseconds, a GPU decode step
a few hundred microseconds.
"""

import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

from . import __version__, patch, unpatch
from .config import backend_name
from .models import quant_label


@contextmanager
def _measuring():
    """Around a timed generation: the device idle and peak memory reset before it, Python's
    garbage collector paused during it."""
    mx.synchronize()
    mx.reset_peak_memory()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def generation(model, prompt, n, tick=None, every=1.0, **step_args):
    """One greedy generation of n tokens: (seconds to the first token, seconds for the other n - 1,
    tokens, peak memory in bytes). tick(tokens so far), when given, is called at most every `every`
    seconds (a clock read per token: well under a microsecond, against a decode step of ~1 ms).
    step_args go to generate_step (kv_bits, ...)."""
    with _measuring():
        tokens = []
        t0 = time.perf_counter()
        next_tick = t0 + every
        for tok, _ in generate_step(prompt, model, max_tokens=n, **step_args):
            tokens.append(int(tok))
            if len(tokens) == 1:
                t_first = time.perf_counter()
            if tick is not None and (now := time.perf_counter()) >= next_tick:
                tick(len(tokens))
                next_tick = now + every
        t_end = time.perf_counter()
    return t_first - t0, t_end - t_first, tokens, mx.get_peak_memory()


def batch_generation(rows):
    """generation() for `rows` sequences decoded together through mlx-lm's BatchGenerator (what
    mlx_lm.server and batch_generate run): row i's prompt is the prompt rotated by i (distinct
    rows), all inserted at once, greedy, n tokens each. The first time is to every row's first
    token, the second for the other n - 1 tokens of every row; the tokens are row 0's."""

    def run(model, prompt, n, tick=None, every=1.0):
        from mlx_lm.generate import BatchGenerator

        prompts = [mx.roll(prompt, i).tolist() for i in range(rows)]
        with _measuring():
            gen = BatchGenerator(model, max_tokens=n, completion_batch_size=rows, prefill_batch_size=rows)
            t0 = time.perf_counter()
            uids = gen.insert(prompts)
            tokens = {uid: [] for uid in uids}
            t_first, next_tick = None, t0 + every
            while responses := gen.next_generated():
                for r in responses:
                    tokens[r.uid].append(r.token)
                if t_first is None and all(tokens.values()):
                    t_first = time.perf_counter()
                if tick is not None and (now := time.perf_counter()) >= next_tick:
                    tick(len(tokens[uids[0]]))
                    next_tick = now + every
            t_end = time.perf_counter()
            gen.close()
        return t_first - t0, t_end - t_first, tokens[uids[0]], mx.get_peak_memory()

    return run


class Progress:
    """bench's progress on stderr: on a terminal one line, rewritten; in a log a line per event.
    `line` always prints (a generation's result); `tick` (where a generation is) prints at most
    every `every` seconds, so a long step still moves and a log stays short."""

    def __init__(self, label, every=None, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.label = label
        self.every = every if every is not None else 1.0 if self.tty else 10.0
        self.last = -float("inf")

    def line(self, text):
        end = "" if self.tty else "\n"
        print(f"\r\033[K[bench] {self.label} {text}" if self.tty else f"[bench] {self.label} {text}",
              end=end, file=self.stream, flush=True)
        self.last = time.perf_counter()

    def tick(self, text):
        if time.perf_counter() - self.last >= self.every:
            self.line(text)

    def done(self):
        if self.tty:
            print("", file=self.stream)


def _first_difference(base, tokens):
    return next((i for i, (a, b) in enumerate(zip(base, tokens)) if a != b), min(len(base), len(tokens)))


def _stats(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def compare(variants, prompts, gen, trials=5, warmup=1, seed=0, progress=None, tick=None, tick_every=1.0,
            batch=None):
    """Time `variants`, a list of (name, model, prepare[, step_args]): prepare() (or None) puts the
    model in that variant's state before each of its generations, step_args (a dict) go to
    generate_step; the first variant is the baseline of ratios and agreement. progress(text), when given, gets each generation's result; tick(text) where a
    generation is (its prompt, then the tokens so far, at most every tick_every seconds). batch:
    that many rows at once through mlx-lm's BatchGenerator (batch_generation; rates are of every
    row's tokens), else one sequence through generate_step. Returns the rows: per prompt length, pp
    and (where gen > 0) tg."""
    if not prompts or min(prompts) < 1 or gen < 0 or trials < 1 or warmup < 0 or (batch is not None and batch < 1):
        raise ValueError(f"bench needs prompt lengths >= 1, gen >= 0, trials >= 1, warmup >= 0, batch >= 1; got "
                         f"{list(prompts)}, {gen}, {trials}, {warmup}, {batch}")
    if batch is not None and any(len(v) > 3 for v in variants):
        raise ValueError("bench's batched generations take no generate_step arguments (kv_bits)")
    generate = generation if batch is None else batch_generation(batch)
    names = [v[0] for v in variants]
    vocab = variants[0][1].args.vocab_size
    rounds = warmup + trials
    rows = []
    for n_prompt in prompts:
        runs = {name: [] for name in names}
        for r in range(rounds):
            prompt = mx.random.randint(0, vocab, (n_prompt,), key=mx.random.key(seed + 7919 * n_prompt + r))
            k = r % len(variants)
            stage = "warm-up" if r < warmup else f"trial {r + 1 - warmup}/{trials}"
            for name, model, prepare, *opt in variants[k:] + variants[:k]:
                if prepare is not None:
                    prepare()
                where = f"p={n_prompt} {stage} {name}:"
                tokens_so_far = None
                if tick:
                    tick(f"{where} prompt of {n_prompt} tokens")
                    tokens_so_far = lambda done, where=where: tick(f"{where} {done}/{gen + 1} tokens")
                step_args = opt[0] if opt else {}
                run = generate(model, prompt, gen + 1, tokens_so_far, tick_every, **step_args)
                if r >= warmup:
                    runs[name].append(run)
                if progress:
                    tg = f" tg {(batch or 1) * gen / run[1]:8.2f}" if gen else ""
                    progress(f"{where} pp {(batch or 1) * n_prompt / run[0]:8.2f}{tg} tok/s")
        rows += _rows(n_prompt, gen, runs, names, batch)
    return rows


def estimate(model, prompts, gen, rounds, n_variants):
    """How long a plan will take on this machine, from a forward pass timed now: a prefill of up to
    32 tokens and one decode step after it, the prefill taken as linear in the prompt length (on a
    CPU the matmuls dominate; attention's growth with the prompt is left out). Returns {"seconds",
    "prefill_tokens", "prefill_s", "step_s"}."""
    from mlx_lm.models.cache import make_prompt_cache

    n = min(min(prompts), 32)
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    mx.eval(model(mx.zeros((1, n), mx.int32), cache=cache))
    t1 = time.perf_counter()
    mx.eval(model(mx.zeros((1, 1), mx.int32), cache=cache))
    t2 = time.perf_counter()
    per_round = sum(p * (t1 - t0) / n + gen * (t2 - t1) for p in prompts)
    return {"seconds": n_variants * rounds * per_round, "prefill_tokens": n, "prefill_s": t1 - t0, "step_s": t2 - t1}


def _rows(n_prompt, gen, runs, names, batch=None):
    base = names[0]
    agree = {name: [_first_difference(b[2], v[2]) for b, v in zip(runs[base], runs[name])] for name in names[1:]}
    rows_of, label = (1, "") if batch is None else (batch, f" x{batch}")   # rates of every row's tokens
    kinds = [("pp", f"pp{n_prompt}{label}", lambda run: rows_of * n_prompt / run[0])]
    if gen:
        kinds.append(("tg", f"tg{gen} @{n_prompt}{label}", lambda run: rows_of * gen / run[1]))
    rows = []
    for kind, test, rate in kinds:
        tok_s = {name: [rate(run) for run in runs[name]] for name in names}
        variants = {}
        for name in names:
            v = _stats(tok_s[name])
            v["ratio"] = v["median"] / statistics.median(tok_s[base])
            v["peak_memory_gb"] = max(run[3] for run in runs[name]) / 1e9
            if name != base:
                v["agreement"] = {"matching": min(agree[name]), "tokens": gen + 1, "per_trial": agree[name]}
            variants[name] = v
        rows.append({"test": test, "kind": kind, "prompt": n_prompt, "gen": gen, "batch": batch, "variants": variants})
    return rows


KV_VARIANT = "patched kv{bits}"
KV_GROUP = 64   # mlx-lm's default kv_group_size


def kv_step_args(bits):
    """generate_step's arguments of the kvB variant: mlx-lm's QuantizedKVCache from the first token."""
    return {"kv_bits": bits, "kv_group_size": KV_GROUP, "quantized_kv_start": 0}


def run(model, label, prompts=(512, 2048), gen=128, trials=5, warmup=1, disable=(), extra=(), seed=0,
        progress=True, batch=None, kv_bits=None):
    """Stock and patched (every fusion but `disable`, untuned) on one model object, unpatch/patch
    between generations (patch reuses the parked fused modules and compiled step). extra: [(name,
    model, disable, tune)], more variants, each a separate copy patched once with its `disable` and
    `tune` (patch settings belong to a model object; a tuned copy's patch report holds the tuner's
    decisions and how long they took). batch: see compare. kv_bits: also the patched model
    generating over mlx-lm's QuantizedKVCache (KV_VARIANT: generate_step's kv_bits,
    quantized_kv_start=0), beside it on the float cache (stock cannot run it everywhere: MLX's CUDA
    quantized_matmul lacks these shapes); one sequence only. Leaves `model` patched. Returns the
    model's result."""
    if batch is not None and kv_bits:
        raise ValueError("bench takes kv_bits for one sequence only, not with batch")
    report = patch(model, disable=disable, tune="off")
    variants = [("stock", model, lambda: unpatch(model)),
                ("patched", model, lambda: patch(model, disable=disable, tune="off"))]
    if kv_bits:
        variants.append((KV_VARIANT.format(bits=kv_bits), model, lambda: patch(model, disable=disable, tune="off"),
                         kv_step_args(kv_bits)))
    reports = {"patched": report.to_dict()}
    for name, copy, copy_disable, tune in extra:
        reports[name] = patch(copy, disable=copy_disable, tune=tune).to_dict()
        variants.append((name, copy, None))
    if progress:
        say = Progress(label)
        rows = compare(variants, prompts, gen, trials, warmup, seed, say.line, say.tick, say.every, batch)
        say.done()
    else:
        rows = compare(variants, prompts, gen, trials, warmup, seed, batch=batch)
    patch(model, disable=disable, tune="off")
    return {"model": label, "quant": quant_label(model), "variants": [v[0] for v in variants], "rows": rows,
            "patch": reports}


def document(results, **settings):
    """The JSON document of a bench run: machine, settings and every model's result."""
    return {"machine": machine(), "settings": settings, "models": results}


def commit():
    """The checkout's short commit (+uncommitted where tracked files differ), or None outside one."""
    root = Path(__file__).resolve().parents[1]
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=20)
    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode or Path(top.stdout.strip()).resolve() != root:
            return None
        head = git("rev-parse", "--short", "HEAD").stdout.strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+uncommitted" if dirty else "")


def source_digest():
    """sha1 (12 hex) of the package's Python files, kernel sources and recipes: names the code that
    ran wherever the git state says otherwise (a device copy of a working tree)."""
    from .kernels import data_dir

    pkg = Path(__file__).resolve().parent
    files = [(f"mlx_fastops/{f.relative_to(pkg).as_posix()}", f) for f in pkg.rglob("*.py")]
    for kind in ("metal", "cuda", "patches"):
        try:
            base = data_dir(kind)
        except FileNotFoundError:
            continue
        files += [(f"{kind}/{f.relative_to(base).as_posix()}", f) for f in base.rglob("*") if f.is_file()]
    h = hashlib.sha1()
    for name, f in sorted(files):
        h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def _gpu_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def machine():
    info = {"platform": platform.platform(), "python": platform.python_version(), "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__, "mlx_fastops": __version__, "device": str(mx.default_device()),
            "backend": backend_name(), "commit": commit(), "sources": source_digest(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "MLX_FASTOPS_DISABLE": os.environ.get("MLX_FASTOPS_DISABLE", ""),
            "MLX_FASTOPS_TUNE": os.environ.get("MLX_FASTOPS_TUNE", "")}
    try:
        info["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    except Exception:  # an MLX without device_info
        pass
    if mx.cuda.is_available():
        info["gpu"] = _gpu_name()
    return info


def _cell(v):
    digits = 0 if v["median"] >= 1000 else 2
    return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}-{v['max']:.{digits}f})"


def to_markdown(doc):
    """llama-bench-style table of every model's rows, then how it was measured and where."""
    settings, m = doc["settings"], doc["machine"]
    names = doc["models"][0]["variants"] if doc["models"] else ["stock", "patched"]
    base = names[0]   # the baseline of ratios and agreement: stock, or the first value of an A/B
    head = f"| model | quant | test | {base} t/s |" + "".join(f" {n} t/s | ratio |" for n in names[1:])
    lines = [head + " peak memory GB (" + " / ".join(names) + ") | greedy agreement |",
             "|---|---|---|---|" + "---|---|" * (len(names) - 1) + "---|---|"]
    for res in doc["models"]:
        for row in res["rows"]:
            v = row["variants"]
            cells = "".join(f" {_cell(v[n])} | {v[n]['ratio']:.2f}x |" for n in names[1:])
            mem = " / ".join(f"{v[n]['peak_memory_gb']:.2f}" for n in names)
            agree = ", ".join(f"{v[n]['agreement']['matching']}/{v[n]['agreement']['tokens']}" for n in names[1:])
            lines.append(f"| {res['model']} | {res['quant']} | {row['test']} | {_cell(v[names[0]])} |{cells} "
                         f"{mem} | {agree} |")
    disable = settings.get("disable") or m.get("MLX_FASTOPS_DISABLE")
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    lines += ["", f"ppN: N prompt tokens / time to the first token; tgG @N: the G tokens after the first / "
                  f"their time, after an N-token prompt"
                  + ("; xB: B sequences at once through mlx-lm's BatchGenerator, the tokens of all of them / the "
                     "time" if settings.get("batches") else "")
                  + f". Median (min-max) of {settings['trials']} trials after "
                  f"{settings['warmup']} warm-up round(s), variants in rotating order; ratio of medians to {base}. "
                  f"Greedy agreement: generated tokens equal to {base}'s from the first on (fewest over the trials)."
              + (f" Patched with {disable} left stock." if disable else "")
              + (" tuned: patched with tune, each fusion timed against stock on this device and kept only "
                 "where it wins (the decisions are below)." if "tuned" in names else "")
              + (f" {KV_VARIANT.format(bits=settings['kv_bits'])}: the patched model generating with mlx-lm's "
                 f"kv_bits={settings['kv_bits']} (QuantizedKVCache, group size {KV_GROUP}, quantized_kv_start=0)."
                 if settings.get("kv_bits") else ""),
              f"{m['backend']} backend, {m['device']}{gpu}; mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, "
              f"mlx_fastops {m['mlx_fastops']}, commit {m['commit'] or '-'} (sources {m['sources']}), {m['date']}; "
              f"{m['platform']}, Python {m['python']}."]
    return "\n".join(lines)


def plot(doc, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib (pip install 'mlx-fastops[plot]'): {e}")
    rows = [(res["model"].split(" ")[0], row) for res in doc["models"] for row in res["rows"]]
    names = doc["models"][0]["variants"]
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 3.5))
    for i, name in enumerate(names):
        vs = [row["variants"][name] for _, row in rows]
        med = [v["median"] for v in vs]
        err = [[v["median"] - v["min"] for v in vs], [v["max"] - v["median"] for v in vs]]
        ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(rows))], med, width=width, yerr=err,
               label=name)
    ax.set_xticks(range(len(rows)), [f"{model}\n{row['test']}" for model, row in rows])
    ax.set_ylabel("tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"mlx-fastops bench ({doc['machine']['backend']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def save_json(doc, path):
    Path(path).write_text(json.dumps(doc, indent=1))


def save(doc, prefix):
    """A benchmark script's result: prefix.json and prefix.md (folders made); returns the Markdown."""
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    save_json(doc, f"{prefix}.json")
    text = to_markdown(doc)
    Path(f"{prefix}.md").write_text(text)
    return text

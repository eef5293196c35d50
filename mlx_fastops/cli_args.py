"""Command-line flags of mlx-fastops shared or long enough to live apart from cli.py, and their
checks: every flag is validated before any model work, and a bad one gets a one-line error and
exit status 2.

Flag values are checked by the argparse types below (argparse's message names the flag); what
needs several flags, the environment or the file system is checked by `check` after parsing.
"""

import argparse
import importlib.util
import os
from pathlib import Path

from . import config, models, profiler


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the problem and where to read more, no usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int(text):
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def at_least(low):
    """An argparse type: an integer >= low."""

    def parse(text):
        value = _int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def list_at_least(low):
    """An argparse type: comma-separated integers, each >= low, at least one."""

    def parse(text):
        values = [at_least(low)(v) for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        return values

    return parse


def fusion_names(text):
    """An argparse type: comma-separated names from mlx_fastops.FUSIONS (may be empty)."""
    try:
        config.parse_names(text, repr(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def some_fusion_names(text):
    """fusion_names, at least one (a --variant that leaves nothing stock would be patched again)."""
    if not text.replace(",", "").strip():
        raise argparse.ArgumentTypeError("names no fusion")
    return fusion_names(text)


def output_file(text):
    """An argparse type: a file to write, in a folder that exists and is writable."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist (create it first)")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"folder {folder} is not writable")
    return path


def model_args(p):
    """The model flags every command takes."""
    from .synthetic import CONFIGS

    p.add_argument("--model", "-M", default=None,
                   help=f"synthetic model name ({', '.join(CONFIGS)}), local mlx-lm directory or Hugging Face "
                        "repo (owner/name) (default: synthetic qwen3-0.6b 4-bit on a GPU, qwen3-cpu without one)")
    p.add_argument("--bits", type=int, choices=[0, 2, 3, 4, 5, 6, 8], default=None,
                   help="synthetic models: quantisation bits, 0 for float; 4 and 8 are fused, the others stay "
                        "stock (default: 4)")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=None,
                   help="synthetic models: quantisation group size (default: 64)")
    p.add_argument("--dtype", choices=list(models.DTYPES), default=None,
                   help="synthetic models: activation dtype (default: bfloat16; float32 for the *-cpu and "
                        "*-tiny models)")
    p.add_argument("--disable", type=fusion_names, default="",
                   help="comma-separated fusions to leave stock, from: " + ", ".join(config.FUSIONS)
                        + " (default: none)")


def profile_args(p):
    """profile's own flags."""
    p.add_argument("--prefill", type=at_least(1), default=None, metavar="N",
                   help="profile prefill chunks of N tokens instead of decode steps (default: decode steps)")
    p.add_argument("-n", "--num-tokens", type=at_least(1), default=None,
                   help="decode steps, or prefill chunks, recorded (default: 16 steps, 5 chunks)")
    p.add_argument("--prompt-tokens", type=at_least(0), default=None,
                   help="random prompt tokens in the KV cache before each decode step (at least 1), or before "
                        "each prefill chunk (prefilled untimed, in chunks of N) (default: 32 before steps, 0 "
                        "before chunks)")
    p.add_argument("--warmup", type=at_least(0), default=None,
                   help="decode steps, or prefill chunks, not recorded (default: 4 steps, 2 chunks)")
    p.add_argument("--stock", action="store_true", help="profile the unpatched model (default: off, patched)")
    p.add_argument("--trace", type=output_file,
                   help="write a Chrome/Perfetto trace JSON (default: not written)")
    p.add_argument("--capture", type=output_file,
                   help="Metal GPU capture of decode steps, FILE.gputrace; Metal only (default: none)")


def check(args):
    """What parse_args cannot see: the models (resolved, a Hub repo downloaded when not cached),
    the flags that shape synthetic models only, the environment's switches, optional dependencies.
    Sets args.sources (models.Source, one per model). Raises ValueError, one line."""
    specs = args.model.split(",") if args.model is not None else [None]
    if "" in specs:
        raise ValueError(f"--model {args.model!r}: an empty model name")
    if len(specs) > 1 and args.command != "bench":
        raise ValueError(f"--model takes one model here (bench takes several), got {len(specs)}: {args.model}")
    config.disabled(args.disable)   # MLX_FASTOPS_DISABLE, which patch() reads too
    config.backend_name()           # MLX_FASTOPS_BACKEND
    config.tune_mode()              # MLX_FASTOPS_TUNE
    if args.command == "bench" and args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'mlx-fastops[plot]'")
    if args.command == "profile":
        _check_profile(args)
    if args.command in ("generate", "verify") and args.prompt is not None and not args.prompt.strip():
        raise ValueError("--prompt is empty")
    if args.command == "serve":   # mlx_lm.server's own flags, by its own parser
        from . import serve

        server = serve.server_args(args.server_argv)
        if problem := serve.port_problem(server.host, server.port):
            raise ValueError(problem)
    sources = [models.resolve(spec) for spec in specs]
    shaping = [f"--{flag.replace('_', '-')}" for flag in ("bits", "group_size", "dtype")
               if getattr(args, flag) is not None]
    loaded = [s.spec for s in sources if not s.synthetic]
    if shaping and loaded:
        raise ValueError(f"{'/'.join(shaping)}: for synthetic models only; {loaded[0]} loads as it was saved")
    args.sources = sources


def _check_profile(args):
    if args.prefill is None and args.prompt_tokens == 0:
        raise ValueError("--prompt-tokens: a decode profile needs at least 1 token before its steps, got 0")
    if args.prefill is not None and args.capture:
        raise ValueError("--capture records decode steps; it does not take --prefill")
    if args.capture and (problem := profiler.capture_problem(args.capture)):
        raise ValueError(problem)

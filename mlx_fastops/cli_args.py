"""Command-line checks for mlx-fastops: every flag is validated before any model work, and a bad
one gets a one-line error and exit status 2.

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
    if args.command == "profile" and args.capture and (problem := profiler.capture_problem(args.capture)):
        raise ValueError(problem)
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

"""The tuner's decisions on disk, so that only the first patch of a model's shape class on a
device pays for the timing.

One JSON file, `tune.json`, in MLX_FASTOPS_TUNE_CACHE, else $XDG_CACHE_HOME/mlx_fastops, else
~/.cache/mlx_fastops: {"schema": SCHEMA, "entries": [{"key": {...}, "tuning": {...}}]}. A key
names the device, the MLX and mlx_fastops versions, the backend, the fusions the user switched
off, the tuning shapes and the model's shape class (tuner.shape_class). A file that cannot be
read, is not this schema, or holds an entry that does not parse is ignored with a warning (and
replaced at the next write), never trusted. Writes go to a temporary file in the same folder,
then os.replace: a reader sees the old file or the new one, never half of one.
"""

import json
import os
import tempfile
import warnings
from pathlib import Path

import mlx.core as mx

SCHEMA = 2   # 2: a prefill decision may carry `upto` (entries of 1 would keep too many rows stock)
ENV = "MLX_FASTOPS_TUNE_CACHE"


def directory():
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mlx_fastops"


def path():
    return directory() / "tune.json"


def device_name(backend):
    """The device as MLX names it (Apple M2 Max, NVIDIA H200, AMD EPYC), with its backend."""
    try:
        info = mx.device_info()
    except Exception:  # an MLX without device_info
        info = {}
    name = info.get("device_name") or info.get("name") or str(mx.default_device())
    return f"{backend}: {name}" + (f" ({info['architecture']})" if info.get("architecture") else "")


def key(backend, disabled, shapes, shape_class):
    from . import __version__

    return {"device": device_name(backend), "mlx": mx.__version__, "mlx_fastops": __version__,
            "backend": backend, "disabled": sorted(disabled), "shapes": shapes, "model": shape_class}


def _entries(file):
    """The file's entries ([] where it is missing); a warning and [] where it cannot be trusted."""
    if not file.exists():
        return []
    try:
        doc = json.loads(file.read_text())
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ValueError(f"not schema {SCHEMA} (schema {doc.get('schema') if isinstance(doc, dict) else None!r})")
        entries = doc["entries"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) and {"key", "tuning"} <= e.keys()
                                                    for e in entries):
            raise ValueError("entries are not a list of {key, tuning}")
        return entries
    except (OSError, UnicodeDecodeError, ValueError, KeyError) as e:
        warnings.warn(f"mlx_fastops: ignoring the tuning cache {file} ({e}); fusions are measured again",
                      RuntimeWarning, stacklevel=3)
        return []


def load(k, parse):
    """parse(tuning dict) of the entry under key `k`, or None: no such entry, or one that does
    not parse (parse raises ValueError/KeyError/TypeError: warned, ignored)."""
    file = path()
    for entry in _entries(file):
        if entry["key"] == k:
            try:
                return parse(entry["tuning"])
            except (ValueError, KeyError, TypeError) as e:
                warnings.warn(f"mlx_fastops: ignoring a corrupt entry of the tuning cache {file} ({e}); "
                              "fusions are measured again", RuntimeWarning, stacklevel=2)
                return None
    return None


def store(k, tuning):
    """Write `tuning` (a dict) under key `k`; entries of other MLX / mlx_fastops versions are
    dropped (stale), the others kept. Returns the file's path."""
    file = path()
    file.parent.mkdir(parents=True, exist_ok=True)
    kept = [e for e in _entries(file) if e["key"] != k and
            (e["key"].get("mlx"), e["key"].get("mlx_fastops")) == (k["mlx"], k["mlx_fastops"])]
    text = json.dumps({"schema": SCHEMA, "entries": kept + [{"key": k, "tuning": tuning}]}, indent=1)
    fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=file.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, file)
    except BaseException:
        os.unlink(tmp)
        raise
    return file

"""pytest plugin (`-p mlx_lm_patched`, tests/ on PYTHONPATH): every mlx-lm model that mlx_fastops
supports is patched as it is built. tests/test_mlx_lm_models.py runs mlx-lm's own
tests/test_models.py with it.

Wrapped: the `Model` class of each module a recipe names (mlx_lm.models.<family> and its
aliases), and of each mlx-lm module that builds its `language_model` from one of those (the
vision-language wrappers). The outermost constructor patches; a wrapper whose text model is of
another family (mistral3's ministral3 branch) gets the documented ValueError and stays stock.
Every patch is logged as a JSON line (test id, model class, family) to $MLX_FASTOPS_PATCH_LOG.
"""

import importlib
import json
import os
import re
from pathlib import Path

import mlx_lm.models

import mlx_fastops
from mlx_fastops.families import recipes

_current = {"test": None, "depth": 0}


def _modules():
    own = {m for r in recipes().values() for m in r["modules"] if m.startswith("mlx_lm.models.")}
    families = {m.rsplit(".", 1)[1] for m in own}
    wrapper = re.compile(r"language_model = (\w+)\.Model\(")
    for path in sorted(Path(mlx_lm.models.__file__).parent.glob("*.py")):
        name = f"mlx_lm.models.{path.stem}"
        if name in own or families & set(wrapper.findall(path.read_text())):
            yield name


def _wrap(cls):
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        _current["depth"] += 1
        try:
            init(self, *args, **kwargs)
        finally:
            _current["depth"] -= 1
        if _current["depth"] == 0 and type(self) is cls:
            try:
                report = mlx_fastops.patch(self)
            except ValueError as e:
                if "unsupported model family" not in str(e):
                    raise
                return
            with open(os.environ["MLX_FASTOPS_PATCH_LOG"], "a") as log:
                log.write(json.dumps({"test": _current["test"], "model": f"{cls.__module__}.{cls.__name__}",
                                      "family": report.family}) + "\n")

    cls.__init__ = __init__


def pytest_configure(config):
    for name in _modules():
        _wrap(importlib.import_module(name).Model)


def pytest_runtest_setup(item):
    _current["test"] = item.nodeid

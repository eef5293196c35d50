"""mlx-lm's own model tests with every model mlx_fastops supports patched as it is built.

The tests are mlx-lm's tests/test_models.py from the source package of the installed mlx-lm
version, downloaded from PyPI (pip) into pytest's cache at test time, never copied into this
project; without network the test skips, saying so. They run in a subprocess with the plugin
tests/mlx_lm_patched.py, which patches each model whose family has a recipe as its constructor
returns (mlx-lm's tests then change its dtype through `model.update`, decode with a cache, batch,
deepcopy it, ...). Every test that fails patched must fail stock too (mlx-lm's Metal-only kernel
tests fail on a CPU either way), and every built-in family must have been patched.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mlx_fastops.kernels import data_dir

FAMILIES = sorted(p.stem for p in data_dir("patches").glob("*.json"))
HERE = Path(__file__).resolve().parent


def _mlx_lm_tests(cache):
    version = importlib.metadata.version("mlx-lm")
    path = Path(cache.mkdir(f"mlx-lm-{version}-tests")) / "test_models.py"
    if not path.exists():
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                                f"mlx-lm=={version}", "-d", tmp], capture_output=True, text=True, timeout=600)
            sdists = list(Path(tmp).glob("mlx_lm-*.tar.gz"))
            if r.returncode or not sdists:
                last = (r.stderr.strip().splitlines() or ["no source package"])[-1]
                pytest.skip(f"mlx-lm {version}'s source package could not be downloaded from PyPI: {last}")
            with tarfile.open(sdists[0]) as tar:
                member = next(m for m in tar.getmembers() if m.name.endswith("/tests/test_models.py"))
                path.write_bytes(tar.extractfile(member).read())
    return path


def _run(test_file, workdir, plugin, ids=()):
    """Run mlx-lm's tests (all, or the ids given) in a subprocess; returns the failed ids."""
    xml, log = workdir / f"{plugin or 'stock'}.xml", workdir / "patched.jsonl"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    cmd += ["-p", plugin] if plugin else []
    cmd += [f"{test_file.name}::{i}" for i in ids] or [test_file.name]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               MLX_FASTOPS_PATCH_LOG=str(log))
    r = subprocess.run(cmd, cwd=test_file.parent, env=env, capture_output=True, text=True, timeout=1200)
    assert xml.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    failed = {f"{c.get('classname').rsplit('.', 1)[-1]}::{c.get('name')}"
              for c in ET.parse(xml).iter("testcase") if c.find("failure") is not None or c.find("error") is not None}
    return failed, r.stdout


def test_mlx_lm_model_tests_pass_patched(request, tmp_path):
    tests = _mlx_lm_tests(request.config.cache)
    work = tmp_path / "run"
    work.mkdir()
    test_file = work / tests.name
    test_file.write_bytes(tests.read_bytes())   # alone in its folder: pytest finds no conftest of ours
    failed, out = _run(test_file, work, "mlx_lm_patched")
    patched = [json.loads(line) for line in (work / "patched.jsonl").read_text().splitlines()]
    families = {p["family"] for p in patched}
    assert families == set(FAMILIES), f"patched families {sorted(families)}, expected {FAMILIES}"
    wrappers = {p["model"] for p in patched if not p["model"].endswith(tuple(f".{f}.Model" for f in FAMILIES))}
    assert wrappers, "no vision-language wrapper was patched"
    print(f"{len(patched)} models patched in {len({p['test'] for p in patched})} tests; wrappers {sorted(wrappers)}")
    if failed:
        stock_failed, _ = _run(test_file, work, None, sorted(failed))
        assert failed <= stock_failed, f"fail patched, pass stock: {sorted(failed - stock_failed)}\n{out[-6000:]}"

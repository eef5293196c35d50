"""The wheel carries the kernel sources and recipes, and the package finds them the same way
from a source checkout and from an installed wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return next(out.glob("mlx_fastops-*.whl"))


def test_wheel_contains_kernel_sources_and_recipes(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for kind, pattern in (("metal", "*.metal"), ("cuda", "*.cu"), ("patches", "*.json")):
        files = sorted(p.name for p in (ROOT / kind).glob(pattern))
        assert files, f"no {pattern} in {kind}/"
        for f in files:
            assert f"mlx_fastops/{kind}/{f}" in names, f"{kind}/{f} missing from the wheel"
    assert "mlx_fastops/cli.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)


def test_installed_wheel_finds_its_data(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    code = ("import mlx_fastops, mlx_fastops.kernels as k, mlx_fastops.patcher as p;"
            "assert k.data_dir('metal').parent.name == 'mlx_fastops', k.data_dir('metal');"
            "print(sorted(p.recipes()), k.read_source('metal', 'gemv.metal')[:10])")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert str(sorted(p.stem for p in (ROOT / "patches").glob("*.json"))) in r.stdout


def test_checkout_finds_its_data():
    from mlx_fastops import kernels

    assert kernels.data_dir("patches") in (ROOT / "patches", ROOT / "mlx_fastops" / "patches")

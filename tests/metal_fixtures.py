"""pytest plugin for Metal kernel tests (imported by tests/conftest.py).

- marker `metal`: the test runs a Metal kernel. Where Metal exists (`mx.metal.is_available()`) it runs
  on the GPU with mx.fast.metal_kernel; elsewhere on the CPU emulator (tests/metal_emu), with the same
  assertions. In both cases every mlx_fastops Metal wrapper builds its kernels through the selected
  factory (`mlx_fastops.kernels.use_metal_factory`) for the duration of the test.
- fixture `metal_kernel_factory`: that factory (same signature as mx.fast.metal_kernel), for tests that
  build kernels themselves. Using it implies the `metal` marker's behaviour.
- fixture `metal_backend`: "metal" or "emulator".
- `metal_factory()`: (factory, "metal" or "emulator"), or a skip; `strict_factory(emu)`: a factory
  whose kernels only strict-compile each instantiation they are called with.
- results are labelled: the terminal summary counts tests that were "emulator-verified" and tests that
  ran on the real Metal GPU; each test's report carries a `metal_backend` user property.

Set METAL_EMU_DISABLE=1 to skip `metal` tests on machines without Metal instead of emulating them.
"""

import os
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["metal_backend", "metal_kernel_factory", "_metal_marker", "metal_available",
           "pytest_collection_modifyitems", "pytest_terminal_summary"]

EMULATOR_LABEL = "emulator-verified"
GPU_LABEL = "Metal-verified"


def metal_available():
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


def metal_factory():
    """(mx.fast.metal_kernel, "metal") where Metal exists, else (metal_emu.metal_kernel, "emulator")."""
    if metal_available():
        return mx.fast.metal_kernel, "metal"
    if os.environ.get("METAL_EMU_DISABLE") == "1":
        pytest.skip("no Metal device and METAL_EMU_DISABLE=1")
    if shutil.which(os.environ.get("METAL_EMU_CXX", "g++")) is None:
        pytest.skip("no Metal device and no C++ compiler for the Metal emulator")
    import metal_emu

    return metal_emu.metal_kernel, "emulator"


def _use_package_factory(factory):
    try:
        from mlx_fastops import kernels
    except ImportError:
        return None
    return kernels.use_metal_factory(factory)


@pytest.fixture
def metal_backend(request):
    _, backend = metal_factory()
    return backend


@pytest.fixture
def metal_kernel_factory(request):
    factory, backend = metal_factory()
    request.node.user_properties.append(("metal_backend", EMULATOR_LABEL if backend == "emulator" else GPU_LABEL))
    ctx = _use_package_factory(factory)
    if ctx is None:
        yield factory
        return
    with ctx:
        yield factory


def strict_factory(emu):
    """A metal_kernel factory whose kernels strict-compile each call's instantiation and return zeros."""

    def factory(**spec):
        def call(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None, **_):
            emu.compile_strict(**spec, inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                               template=template, grid=grid, threadgroup=threadgroup, init_value=init_value)
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return call

    return factory


@pytest.fixture(autouse=True)
def _metal_marker(request):
    """Tests marked `metal` get the factory installed even if they do not ask for the fixture (the
    `backend` fixture of conftest.py installs its own)."""
    if (request.node.get_closest_marker("metal") is None
            or {"metal_kernel_factory", "backend"} & set(request.fixturenames)):
        yield
        return
    request.getfixturevalue("metal_kernel_factory")
    yield


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "metal_kernel_factory" in getattr(item, "fixturenames", ()) and item.get_closest_marker("metal") is None:
            item.add_marker(pytest.mark.metal)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = {}
    for outcome in ("passed", "failed"):
        for rep in terminalreporter.stats.get(outcome, []):
            if getattr(rep, "when", "call") != "call":
                continue
            for k, v in getattr(rep, "user_properties", []):
                if k == "metal_backend":
                    counts[(v, outcome)] = counts.get((v, outcome), 0) + 1
    if not counts:
        return
    terminalreporter.section("Metal kernels")
    for label in (EMULATOR_LABEL, GPU_LABEL):
        p, f = counts.get((label, "passed"), 0), counts.get((label, "failed"), 0)
        if p or f:
            terminalreporter.write_line(f"{label}: {p} passed, {f} failed")
    if any(k[0] == EMULATOR_LABEL for k in counts):
        terminalreporter.write_line(
            "emulator-verified means: run by tests/metal_emu on the CPU, not compiled by Apple's compiler nor "
            "run on a GPU (docs/metal-emulator.md); run `pytest -m metal` on a Mac before a release.")

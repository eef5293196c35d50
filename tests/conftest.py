# --- Metal kernels: emulator on Linux, GPU where Metal exists (tests/metal_fixtures.py, issue 3) ---
# Provides the `metal` marker behaviour and the fixtures `metal_kernel_factory` and `metal_backend`,
# plus the "emulator-verified" summary. Keep this import; add other fixtures/hooks below it (if you
# need pytest_collection_modifyitems or pytest_terminal_summary here, call metal_fixtures' versions).
import os
import shutil
import sys
import tempfile

# Tests never tune by accident (on a GPU, patch()'s default would time every fusion first) and
# never touch the user's cache: the tuner's tests ask for it explicitly, with their own folder.
os.environ["MLX_FASTOPS_TUNE"] = "off"
os.environ["MLX_FASTOPS_TUNE_CACHE"] = tempfile.mkdtemp(prefix="mlx_fastops_tune_")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from metal_fixtures import *  # noqa: E402,F401,F403
from metal_fixtures import EMULATOR_LABEL, GPU_LABEL, metal_factory  # noqa: E402

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402

# --- `backend`: every backend through one fixture (tests/test_ops.py) ---


class Backend:
    """The backend a test runs on: its name (as ops.select takes it) and how many kernels it launched."""

    def __init__(self, name):
        self.name = name
        self.launches = 0

    def counting(self, factory, poison):
        """`factory` with every launch counted; `poison`: outputs start as NaN (on a GPU: the
        emulators poison every output already, with two patterns)."""

        def make(**spec):
            kernel = factory(**spec)

            def launch(**call):
                self.launches += 1
                if poison and call.get("init_value") is None:
                    call["init_value"] = float("nan")
                return kernel(**call)

            return launch

        return make


def cuda_factory():
    """(factory, on a GPU): mx.fast.cuda_kernel where MLX sees a CUDA device, else tests/cuda_emu."""
    if mx.cuda.is_available():
        return mx.fast.cuda_kernel, True
    if shutil.which("g++") is None:
        pytest.skip("no CUDA device and no g++ for the CUDA emulator")
    import cuda_emu

    return cuda_emu.cuda_kernel, False


@pytest.fixture
def on_gpu():
    """Whether CUDA kernels run on a GPU; else they run through the CPU emulator for the test's
    duration (kernels called directly, outside any mx.compile)."""
    from mlx_fastops import kernels

    factory, gpu = cuda_factory()
    if gpu:
        yield True
        return
    with kernels.use_cuda_factory(factory):
        yield False


@pytest.fixture(params=["reference", pytest.param("metal", marks=pytest.mark.metal),
                        pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request):
    """The reference path; the Metal kernels (GPU, or the CPU emulator: `metal`); the CUDA kernels
    (GPU, or the CPU emulator: `cuda`). Kernels are built through the backend's factory for the
    duration of the test."""
    from mlx_fastops import kernels

    b = Backend(request.param)
    if b.name == "reference":
        yield b
    elif b.name == "metal":
        factory, where = metal_factory()
        request.node.user_properties.append(("metal_backend", GPU_LABEL if where == "metal" else EMULATOR_LABEL))
        with kernels.use_metal_factory(b.counting(factory, poison=where == "metal")):
            yield b
    else:
        factory, gpu = cuda_factory()
        with kernels.use_cuda_factory(b.counting(factory, poison=gpu)):
            yield b

"""The CUDA kernel source as MLX receives it: conditionals decided by the kernel's defines are cut
to the branch taken (kernels.resolve_conditionals), comments and indentation go
(kernels.compact_source). MLX hashes a CUDA kernel's whole source at every launch: on the H200's
host ~0.2 us per KB (benchmarks/results/cuda_host.md)."""

import mlx.core as mx
import pytest

from mlx_fastops import kernels
from mlx_fastops.backends import cuda as C

SRC = """a
#if EPI == 0
e0
#elif EPI == 1
e1
#elif OTHER
other
#else
rest
#endif
#ifdef __CUDA_ARCH__
device
#if XK
xk
#else
no_xk
#endif
#endif
#if XK  // a comment
#if EPI == 1
inner
#endif
#endif
#ifndef WAIT
no_wait
#endif
z
"""

# (defines, the lines kept)
RESOLVE_CASES = [
    (dict(EPI=0, XK=0), ["a", "e0", "#ifdef __CUDA_ARCH__", "device", "no_xk", "#endif", "#ifndef WAIT", "no_wait",
                         "#endif", "z"]),
    (dict(EPI=1, XK=True, WAIT="layer_wait()"), ["a", "e1", "#ifdef __CUDA_ARCH__", "device", "xk", "#endif",
                                                 "inner", "z"]),
    # an undecided #elif after decided-false branches becomes an #if
    (dict(EPI=2, XK=1), ["a", "#if OTHER", "other", "#else", "rest", "#endif", "#ifdef __CUDA_ARCH__", "device", "xk",
                         "#endif", "#ifndef WAIT", "no_wait", "#endif", "z"]),
    # values that are not integers decide nothing
    (dict(EPI="blk", XK="1e-6f"), [line for line in SRC.splitlines()]),
]


@pytest.mark.parametrize("defines,kept", RESOLVE_CASES)
def test_resolve_conditionals(defines, kept):
    assert kernels.resolve_conditionals(SRC, defines).splitlines() == kept


def test_resolve_conditionals_rejects_unterminated_if():
    with pytest.raises(ValueError, match="unterminated"):
        kernels.resolve_conditionals("#if A\nx\n", {"A": 1})


@pytest.mark.parametrize("src,compact", [
    ("  int a = 1;  // one\n\n\t/* two\n lines */ b();\n", "int a = 1;\nb();\n"),
    ('asm("mov %0; // kept");\nchar c = \'"\'; // gone\n', 'asm("mov %0; // kept");\nchar c = \'"\';\n'),
    ("#define A \\\n  2\n", "#define A \\\n2\n"),
])
def test_compact_source(src, compact):
    assert kernels.compact_source(src) == compact


def test_layer_source_size():
    """The Qwen3-8B one-launch layer as MLX receives it (compacted; 91 KB before these steps)."""
    head = dict(D=128, H=32, HKV=8, L=1, freqs=False, qknorm=True, trad=False, qeps=1e-6, keps=1e-6,
                log2_base=20.0, scale=1.0)
    shapes = ((4, 64, 6144, 4096), (4, 64, 4096, 4096), (4, 64, 24576, 4096), (4, 64, 4096, 12288))
    got = {}

    def capture(**kw):
        got.update(kw)
        return kw

    with kernels.use_cuda_factory(capture):   # receives what mx.fast.cuda_kernel would
        C._layer_build(mx.bfloat16, 1, shapes, 1e-6, 1e-6, False, tuple(sorted(head.items())), 17, 0.088, 2,
                       True, True, one_wave=True, stream=True)
    size = len(got["header"]) + len(got["source"])
    assert "//" not in got["header"] and "#if EPI" not in got["header"]
    assert size < 40_000, size

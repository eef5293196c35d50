"""The CUDA kernel source as MLX receives it: conditionals decided by the kernel's defines are cut
to the branch taken (kernels.resolve_conditionals), comments and indentation go
(kernels.compact_source). MLX hashes a CUDA kernel's whole source at every launch: on the H200's
host ~0.2 us per KB (benchmarks/results/cuda_host.md)."""

import os
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_fastops import kernels
from mlx_fastops.backends.cuda import layer

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
# (defines, names known to be undefined, the lines kept)
RESOLVE_CASES = [(d, (), kept) for d, kept in RESOLVE_CASES] + [
    (dict(EPI=0, XK=0), ("WAIT", "__CUDA_ARCH__"), ["a", "e0", "no_wait", "z"]),
]


@pytest.mark.parametrize("defines,undefined,kept", RESOLVE_CASES)
def test_resolve_conditionals(defines, undefined, kept):
    assert kernels.resolve_conditionals(SRC, defines, undefined).splitlines() == kept


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


QWEN3_8B = dict(head=dict(D=128, H=32, HKV=8, L=1, freqs=False, qknorm=True, trad=False, qeps=1e-6, keps=1e-6,
                          log2_base=20.0, scale=1.0),
                shapes=((4, 64, 6144, 4096), (4, 64, 4096, 4096), (4, 64, 24576, 4096), (4, 64, 4096, 12288)))
# Small layers (Qwen3-tiny-like: D 64, GQA 2, a qkv bias, llama3 RoPE freqs) for the golden files
TINY = dict(head=dict(D=64, H=4, HKV=2, L=1, freqs=True, qknorm=True, trad=False, qeps=1e-6, keps=1e-5,
                      log2_base=0.0, scale=1.0),
            shapes=((4, 64, 512, 192), (8, 32, 192, 256), (4, 64, 640, 192), (4, 128, 192, 320)))
GOLDEN = Path(__file__).resolve().parent / "golden"


def captured_layer(case, M=1, nlayers=1, nsplit=17, bias=False, lpad=False):
    """What mx.fast.cuda_kernel would receive for layer.layer_build (compacted source and header);
    lpad: over a batch cache (left padding per row)."""
    got = {}

    def capture(**kw):
        got.update(kw)
        return kw

    head = {**case["head"], **({"lpad": True} if lpad else {})}
    with kernels.use_cuda_factory(capture):
        layer.layer_build(mx.bfloat16, M, case["shapes"], 1e-6, 1e-6, bias, tuple(sorted(head.items())),
                          nsplit, 0.088, 2, nlayers)
    return got


def test_layer_source_size():
    """The Qwen3-8B one-launch layer as MLX receives it (compacted; 91 KB before these steps; at one
    row its o_proj, gate/up and down phases on gemv_mma.cu: 46 KB, 49.6 KB since its staging loads two
    items a thread, 50.1 KB with gate/up's tile queue; QKV, which takes it in a layer of its own, stays
    on gemv.cu here: captured_layer builds with large=False)."""
    got = captured_layer(QWEN3_8B)
    size = len(got["header"]) + len(got["source"])
    assert "//" not in got["header"] and "#if EPI" not in got["header"]
    assert "#define TILE_QUEUE " in got["header"]   # its one-row gate/up takes the tile queue
    assert size < 51_000, size


def generated_part(kw):
    """The generated text of a layer launch: its inputs, outputs, dispatch body, and the phase
    signatures and defines in the header (the phase bodies are cuda/*.cu, checked by their tests)."""
    made = ("__device__ void layer_", "#define", "#undef", "using T", "namespace")
    header = [line for line in kw["header"].splitlines() if line.startswith(made)]
    return "\n".join([f"inputs: {' '.join(kw['input_names'])}", f"outputs: {' '.join(kw['output_names'])}",
                      f"shared_memory: {kw['shared_memory']}", "---- header (generated lines)", *header,
                      "---- source", kw["source"]])


@pytest.mark.parametrize("name,layers,M,bias,lpad", [("layer_x1", 1, 1, True, False), ("layer_x3", 3, 2, False, False),
                                                     ("layer_x3_batch", 3, 3, False, True)])
def test_generated_layer_source_matches_golden(name, layers, M, bias, lpad):
    """The generated dispatch of the one-launch layer, for one layer, a 3-layer launch and one over
    batch caches, against a reviewed copy in tests/golden/ (UPDATE_GOLDEN=1 rewrites it after a
    deliberate change)."""
    text = generated_part(captured_layer(TINY, M, layers, bias=bias, lpad=lpad))
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"generated source of {name} changed (diff against {path})"

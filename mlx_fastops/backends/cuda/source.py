"""What every CUDA wrapper shares: a kernel's source from its cuda/ file, its name, and the small
int32 buffers (tickets, cache offsets) the kernels take.

A kernel's source is its #defines (the static shape class and model constants), the T alias, then
the file's body (its `#include "x.cuh"` lines replaced by cuda/x.cuh's code) with the conditionals
those defines decide cut down (kernels.resolve_conditionals): MLX hashes the whole source at every
launch, so what reaches it is as short as it can be.
"""

import hashlib
import re

import mlx.core as mx

from ...kernels import read_source, resolve_conditionals

CTYPE = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}
HALF = (mx.float16, mx.bfloat16)
MAX_ROWS = 8   # activation rows of the decode kernels (B * L); more rows go to the reference
PAD_WORDS = 4  # a batch cache's left padding, int32[max(B, PAD_WORDS)]: over 8 bytes (see OFF_WORDS)

# A kernel in a launch of its own finds its block through blockIdx/gridDim.
STANDALONE = dict(BLOCK_X="blockIdx.x", BLOCK_Y="blockIdx.y", BLOCK_Z="blockIdx.z", GRID_X="gridDim.x")
# Features a kernel has where the wrapper defines them, and lacks otherwise: an `#ifdef` on one that
# is not defined is cut here, so a kernel without the feature has the source it had before it.
FLAGS = ("LEFT_PAD", "KV_BITS", "AT_OFFSET", "PHASE_MARKS", "NO_EARLY_PREFETCH", "TILE_QUEUE")
_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)


def source(filename, defines, dtype):
    """Kernel body: #defines for the static shape class, the T alias, then the file's body."""
    defines = {**STANDALONE, **defines}
    lines = [f"#define {k} {int(v) if isinstance(v, bool) else v}" for k, v in defines.items()]
    lines.append(f"using T = {CTYPE[dtype]};")
    undefined = [f for f in FLAGS if f not in defines]
    body = _INCLUDE.sub(lambda m: _included(m.group(1)), read_source("cuda", filename))
    return "\n".join(lines) + "\n" + resolve_conditionals(body, defines, undefined)


def _included(filename):
    """cuda/filename without its comment lines (MLX hashes every launch's source), its own
    includes expanded."""
    text = "".join(l for l in read_source("cuda", filename).splitlines(keepends=True)
                   if not l.lstrip().startswith("//"))
    return _INCLUDE.sub(lambda m: _included(m.group(1)), text)


def kernel_name(kind, src):
    """Kernel names unique per source: MLX may key its JIT module cache on the name."""
    return f"fastops_{kind}_{hashlib.sha1(src.encode()).hexdigest()[:12]}"


def flt(v):
    """A float define, as the kernels' float literals."""
    return f"{float(v)!r}f"


def tickets(n):
    """Zeroed int32 tickets for a kernel's last-block merge; every launch leaves them zero again.
    One buffer per user, whose launches must be ordered by their data (a FastBlock's kernels
    are). At least 16 bytes: out of MLX's small managed pool (see OFF_WORDS)."""
    t = mx.zeros((max(n, 4),), dtype=mx.int32)
    mx.eval(t)
    return t


# Offsets are int32[OFF_WORDS] (value in [0]): 16 bytes keeps them out of MLX's small pool of
# managed memory (arrays of <= 8 bytes), where host writes to neighbouring arrays make every
# kernel that reads one fault. Host-made offsets still fault once on first use; the compiled
# decode step therefore computes the next offset on the GPU.
OFF_WORDS = 4
_off_cache = {}


def offset_array(offset):
    a = _off_cache.get(offset)
    if a is None:
        if len(_off_cache) > 256:
            _off_cache.clear()
        a = _off_cache[offset] = mx.array([offset] + [0] * (OFF_WORDS - 1), dtype=mx.int32)
    return a


def rows(x):
    """Activation rows of x [..., K]: the product of its leading dimensions."""
    n = 1
    for s in x.shape[:-1]:
        n *= s
    return n

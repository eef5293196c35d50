"""Resolving --model: a synthetic name, a local mlx-lm directory, or a Hugging Face repo.

`resolve` finds where a model is (downloading a Hub repo that is not cached) and raises a one-line
ValueError for anything that cannot load, so the CLI can refuse a bad --model before any model work;
`load` then builds or reads it.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .synthetic import CONFIGS, synthetic_model

# MLX's CPU backend is slow with half precision (synthetic Qwen3-0.6B 4-bit: 0.19 tok/s with bf16
# activations, 1.75 tok/s with fp32, 2 cores), so without a GPU the default is a smaller,
# Qwen3-shaped fp32 model.
GPU_DEFAULT = ("qwen3-0.6b", "Qwen3-0.6B architecture, 4-bit g64, bf16")
CPU_DEFAULT = ("qwen3-cpu", "no GPU: Qwen3-shaped (hidden 1024, 8 layers, vocab 32k), 4-bit g64, fp32 "
                            "activations, because MLX's CPU backend is slow with half precision")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass(frozen=True)
class Source:
    """Where a model comes from: `spec` as the user named it; `path` its local directory (None for
    a synthetic model); `note` why it was chosen when the user named none."""
    spec: str
    path: Path = None
    note: str = ""

    @property
    def synthetic(self):
        return self.path is None


def on_gpu():
    return mx.metal.is_available() or mx.cuda.is_available()


def default_model():
    return GPU_DEFAULT if on_gpu() else CPU_DEFAULT


def resolve(spec=None):
    """The Source of --model `spec` (None: this machine's default). Raises ValueError, one line."""
    if spec is None:
        name, note = default_model()
        return Source(name, note=note)
    if spec in CONFIGS:
        return Source(spec)
    path = Path(spec).expanduser()
    if path.exists():
        return Source(spec, _checked_dir(spec, path))
    if spec.startswith(("/", ".", "~")) or spec.count("/") != 1 or "\\" in spec:
        raise ValueError(f"--model {spec!r}: no such directory, and not a synthetic model ({', '.join(CONFIGS)}) "
                         "nor a Hugging Face repo (owner/name)")
    return Source(spec, _checked_dir(spec, _download(spec)))


def _checked_dir(spec, path):
    """`path` if mlx-lm can load a model from it."""
    if not path.is_dir():
        raise ValueError(f"--model {spec!r} is a file; it takes a model directory (config.json and "
                         "model*.safetensors), a synthetic model name or a Hugging Face repo")
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"--model {spec!r}: {path} has no config.json, so it is not an mlx-lm model directory")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"--model {spec!r}: {config} is not a JSON object ({e})") from None
    if not model_type:
        raise ValueError(f"--model {spec!r}: {config} names no model_type")
    if not any(path.glob("model*.safetensors")):
        raise ValueError(f"--model {spec!r}: {path} has no model*.safetensors weights")
    return path


def _download(repo):
    """The local snapshot of Hub repo `repo` (mlx-lm's files only), fetched when not cached."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError)
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except HFValidationError as e:
        raise ValueError(f"--model {repo!r}: not a Hugging Face repo id ({e})") from None
    except LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            raise ValueError(f"--model {repo!r}: no such local directory, not in the local Hugging Face cache "
                             f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set, so it cannot be "
                             "downloaded") from None
        cause = f": {type(e.__cause__).__name__}: {e.__cause__}" if e.__cause__ else ""
        raise ValueError(f"--model {repo!r}: no such local directory, the Hugging Face Hub cannot be reached"
                         f"{cause}, and the repo is not in the local cache ({constants.HF_HUB_CACHE})") from None
    except GatedRepoError:
        raise ValueError(f"--model {repo!r}: a gated repo; accept its terms on huggingface.co and log in "
                         "(hf auth login)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"--model {repo!r}: no such local directory, nor a model on the Hugging Face Hub "
                         "(a private one needs hf auth login)") from None
    except HfHubHTTPError as e:
        raise ValueError(f"--model {repo!r}: the Hugging Face Hub answered {str(e).splitlines()[0]}") from None


def load(source, bits=4, group_size=64, dtype=None, seed=0):
    """Returns (model, tokenizer or None, label, note) of a resolved Source. bits, group_size and
    dtype (a DTYPES name, None: synthetic_model's default) shape synthetic models only."""
    if source.synthetic:
        model = synthetic_model(source.spec, bits=bits, group_size=group_size, seed=seed,
                                dtype=DTYPES[dtype] if dtype else None)
        return model, None, f"{source.spec} (synthetic, {quant_label(model)})", source.note
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(source.path))
    return model, tokenizer, source.spec, source.note


def quant_label(model):
    """'4-bit g64', '8-bit g32', 'float32' from the first decoder layer's q projection."""
    q = model.layers[0].self_attn.q_proj
    if hasattr(q, "bits"):
        return f"{q.bits}-bit g{q.group_size}" + ("" if q.mode == "affine" else f" {q.mode}")
    return str(q.weight.dtype).replace("mlx.core.", "")

"""Model-family recipes: one JSON file per family, found by file name.

`patches/<family>.json` (shipped with the package) is the recipe of the mlx-lm model family whose
layer classes live in the module `mlx_lm.models.<family>`, as mlx-lm finds a model's module by its
model_type. mlx-lm loads some model types with another type's module (mistral with llama's), and
those models are patched by that module's recipe. MLX_FASTOPS_RECIPES names more directories of
recipes (os.pathsep-separated), searched besides the package's: a family is added without
editing the package. A family defined twice, or two recipes claiming one module, is an error.

A recipe is a JSON object:

    "attention"  role -> attribute of the attention module: q, k, v, o, rope (required),
                 q_norm, k_norm (per-head q/k RMSNorms, as Qwen3 has; both or neither)
    "mlp"        gate, up, down
    "block"      attention, mlp (the decoder block's children), input_norm, post_norm
    "aliases"    optional: more module names whose layer classes have this layout (a fork's copy
                 of a family, a model package outside mlx-lm)
    "fusions"    optional: the fusions that apply (names from mlx_fastops.FUSIONS); default all
    "comment"    optional, free text
"""

import json
import os
from pathlib import Path

from . import config
from .kernels import data_dir

RECIPES_ENV = "MLX_FASTOPS_RECIPES"

# section -> {role: required}
_ROLES = {
    "attention": {"q": True, "k": True, "v": True, "o": True, "rope": True,
                  "q_norm": False, "k_norm": False},
    "mlp": {"gate": True, "up": True, "down": True},
    "block": {"attention": True, "mlp": True, "input_norm": True, "post_norm": True},
}
_OPTIONAL = ("aliases", "fusions", "comment")


def recipe_dirs():
    """The directories searched for recipes: the package's patches/, then MLX_FASTOPS_RECIPES's."""
    dirs = [data_dir("patches")]
    for entry in os.environ.get(RECIPES_ENV, "").split(os.pathsep):
        if not entry:
            continue
        path = Path(entry).expanduser()
        if not path.is_dir():
            raise ValueError(f"{RECIPES_ENV}: {entry!r} is not a directory")
        dirs.append(path)
    return dirs


def recipes():
    """Every family's recipe, keyed by family name. A recipe is the file's content, checked, with
    "family" (the file's stem), "modules" (mlx_lm.models.<family> and the aliases), "fusions"
    (the default filled in) and "path"."""
    out, owners = {}, {}
    for directory in recipe_dirs():
        for path in sorted(directory.glob("*.json")):
            recipe = load(path)
            family = recipe["family"]
            if family in out:
                raise ValueError(f"recipe {path}: family {family!r} is already defined by {out[family]['path']}")
            for module in recipe["modules"]:
                if module in owners:
                    raise ValueError(f"recipe {path}: module {module} is already patched by the recipe "
                                     f"{owners[module]}")
                owners[module] = path
            out[family] = recipe
    return out


def load(path):
    """The recipe in the file `path`, checked; ValueError naming the file and the problem."""
    path = Path(path)

    def bad(problem):
        return ValueError(f"recipe {path}: {problem}")

    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise bad(f"expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_ROLES) - set(_OPTIONAL))
    if unknown:
        raise bad(f"unknown key(s) {unknown}; a recipe has {sorted(_ROLES)}, optionally {list(_OPTIONAL)}")
    recipe = {"family": path.stem, "path": path}
    for section, roles in _ROLES.items():
        names = raw.get(section)
        if not isinstance(names, dict):
            raise bad(f"missing {section!r}: an object mapping each role {sorted(roles)} to an attribute name")
        missing = [r for r, required in roles.items() if required and r not in names]
        extra = sorted(set(names) - set(roles))
        if missing or extra:
            raise bad(f"{section!r}: " + "; ".join(
                ([f"missing role(s) {missing}"] if missing else []) +
                ([f"unknown role(s) {extra} (roles: {sorted(roles)})"] if extra else [])))
        not_names = sorted(r for r, attr in names.items() if not isinstance(attr, str) or not attr)
        if not_names:
            raise bad(f"{section!r}: role(s) {not_names} must name an attribute (a non-empty string)")
        recipe[section] = dict(names)
    if ("q_norm" in recipe["attention"]) != ("k_norm" in recipe["attention"]):
        raise bad("'attention': q_norm and k_norm go together (both or neither)")
    aliases = _names(raw.get("aliases", []), "aliases", bad)
    recipe["modules"] = [f"mlx_lm.models.{path.stem}", *aliases]
    fusions = _names(raw.get("fusions", list(config.FUSIONS)), "fusions", bad)
    unknown = [f for f in fusions if f not in config.FUSIONS]
    if unknown:
        raise bad(f"'fusions': unknown name(s) {unknown}; valid names: {list(config.FUSIONS)}")
    recipe["fusions"] = fusions
    return recipe


def _names(value, key, bad):
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise bad(f"{key!r} must be a list of non-empty strings, got {value!r}")
    return list(value)

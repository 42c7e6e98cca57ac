"""Models by Hugging Face name: `org/name` resolves to a local snapshot through huggingface_hub.

The local cache is tried first (no network); only when the snapshot is missing, or lacks
the weights the load format needs, is anything downloaded, and never with HF_HUB_OFFLINE
set. Only the files the load format reads are fetched: safetensors by default, so a repo
that also ships PyTorch `.bin` or GGUF weights costs one copy.
"""

from __future__ import annotations

import fnmatch
import os
import re

from xlm import envs
from xlm.logger import init_logger

logger = init_logger(__name__)

# Config, tokenizer and generation defaults: read whatever the load format.
_META_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# load_format -> weight files to fetch (dummy weights need none).
_WEIGHT_PATTERNS = {
    "auto": ["*.safetensors"],
    "safetensors": ["*.safetensors"],
    "gguf": ["*.gguf"],
    "dummy": [],
}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(name: str) -> bool:
    """Whether `name` has the shape of a hub repo id ("org/name"), not of a file path."""
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "/", "~"))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, also when set after its import."""
    from huggingface_hub import constants

    offline = envs.hf_hub_offline()
    if offline is not None:
        return offline
    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir(download_dir: str | None = None) -> str:
    """The hub cache directory used: --download-dir, else HF_HUB_CACHE / HF_HOME/hub."""
    if download_dir:
        return os.path.abspath(os.path.expanduser(download_dir))
    cache = envs.hf_hub_cache()
    if cache:
        return cache
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _weight_patterns(load_format: str) -> list[str]:
    if load_format not in _WEIGHT_PATTERNS:
        raise ValueError(
            f"load_format={load_format!r} cannot be fetched from the hub; allowed: "
            f"{sorted(_WEIGHT_PATTERNS)}"
        )
    return _WEIGHT_PATTERNS[load_format]


def _has_weights(snapshot: str, load_format: str) -> bool:
    patterns = _weight_patterns(load_format)
    if not os.path.isfile(os.path.join(snapshot, "config.json")) and load_format != "gguf":
        return False
    if not patterns:
        return True
    names = os.listdir(snapshot)
    return any(fnmatch.fnmatch(n, p) for n in names for p in patterns)


def _gguf_file(snapshot: str, repo_id: str) -> str:
    """The one .gguf file of a snapshot (several: the user must name the file)."""
    files = sorted(f for f in os.listdir(snapshot) if f.endswith(".gguf"))
    if len(files) != 1:
        raise ValueError(
            f"Model {repo_id!r} holds {len(files)} GGUF files ({files}); pass the path of "
            f"one of them in {snapshot} as --model"
        )
    return os.path.join(snapshot, files[0])


def resolve_hub_model(
    repo_id: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    load_format: str = "auto",
) -> str:
    """The local path serving `repo_id` (a snapshot directory, or its .gguf file).

    Raises FileNotFoundError naming the model and the cache path checked when the model is
    not cached and cannot be downloaded (offline, or the hub refuses).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = _META_PATTERNS + _weight_patterns(load_format)
    cache_dir = hub_cache_dir(download_dir)
    repo_dir = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    fmt = "safetensors" if load_format == "auto" else load_format
    snapshot = None
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=patterns,
            local_files_only=True,
        )
    except LocalEntryNotFoundError:
        pass
    if snapshot is None or not _has_weights(snapshot, load_format):
        what = "is not" if snapshot is None else f"has no {fmt} weights"
        if hub_offline():
            raise FileNotFoundError(
                f"Model {repo_id!r} (revision {rev}) {what} in the Hugging Face cache "
                f"(checked {repo_dir}) and HF_HUB_OFFLINE is set, so it cannot be "
                "downloaded. Download it first, point --download-dir / HF_HOME at the cache "
                "holding it, or pass a local directory."
            )
        logger.info("Downloading %s (revision %s) into %s.", repo_id, rev, cache_dir)
        try:
            snapshot = snapshot_download(
                repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns
            )
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
            raise FileNotFoundError(
                f"Model {repo_id!r} (revision {rev}) is not in the Hugging Face cache "
                f"(checked {repo_dir}) and downloading it failed: {e}"
            ) from e
        if not _has_weights(snapshot, load_format):
            raise FileNotFoundError(
                f"Model {repo_id!r} (revision {rev}) has no {fmt} weights "
                f"(looked for {_weight_patterns(load_format)} in {snapshot}); choose another "
                "--load-format"
            )
    logger.info("Model %s (revision %s) resolved to %s.", repo_id, rev, snapshot)
    if load_format == "gguf":
        return _gguf_file(snapshot, repo_id)
    return snapshot

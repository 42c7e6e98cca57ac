"""One helper for xlm's on-disk caches (compiled programs, dequantized GGUF weights).

Every cache entry:
- is keyed by xlm's version and a fingerprint of the code that made it (the converter's or
  the engine's source), besides what the entry is derived from, so an upgraded or edited
  xlm never reads an entry an older one wrote;
- is written atomically: into a temporary name in the same directory, fsynced, then
  renamed into place; the temporary file or directory is removed on any error, so a crash
  or a full disk never leaves a partial entry under the final name nor litter beside it;
- lives in directories created private to the user (0700): a compiled program is code
  xlm will run, and nobody else may plant one;
- is validated when read (a length and checksum header for files, a manifest of sizes for
  directories): a truncated or corrupt entry is deleted and rebuilt, never fatal.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from xlm.logger import init_logger

logger = init_logger(__name__)

TMP_PREFIX = ".tmp-"
_MAGIC = b"XLMC\x01"
_HEADER = struct.Struct(f"<{len(_MAGIC)}sQ32s")  # magic, payload length, sha256
MANIFEST = "xlm-manifest.json"


def xlm_version() -> str:
    import xlm

    return xlm.__version__


def cache_key(*parts: object, length: int = 24) -> str:
    """A hex key over xlm's version and the given parts (fingerprints, paths, shapes)."""
    text = "|".join(map(str, (xlm_version(), *parts)))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def source_fingerprint(*roots: str | Path) -> str:
    """Hash of the Python source files under each root (a directory or a single file)."""
    digest = hashlib.sha256()
    for root in map(Path, roots):
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for path in files:
            digest.update(
                path.name.encode() if root.is_file() else str(path.relative_to(root)).encode()
            )
            digest.update(path.read_bytes())
    return digest.hexdigest()


def make_private_dir(path: str | Path) -> Path:
    """Create `path` and its missing parents with mode 0700 (the umask cannot widen it)."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            p.mkdir(mode=0o700)
        os.chmod(p, 0o700)
    return path


def _fsync_dir(path: str | Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_entry(path: str | Path, payload: bytes) -> None:
    """Atomically write `payload` with a length and checksum header (see read_entry)."""
    path = Path(path)
    make_private_dir(path.parent)
    header = _HEADER.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest())
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def read_entry(path: str | Path) -> bytes | None:
    """The payload write_entry stored, or None when absent; a bad entry is deleted."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if len(data) >= _HEADER.size:
        magic, length, digest = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if (
            magic == _MAGIC
            and length == len(payload)
            and hashlib.sha256(payload).digest() == digest
        ):
            return payload
    logger.warning("Discarding the corrupt or truncated cache entry %s.", path)
    discard(path)
    return None


def discard(path: str | Path) -> None:
    """Remove a cache entry (file or directory); a missing one is fine."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes `path` with a manifest.

    The manifest records each file's size; check_directory() compares them on load. On
    any error the temporary directory is removed and `path` is left as it was.
    """
    path = Path(path)
    make_private_dir(path.parent)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=TMP_PREFIX))
    try:
        yield tmp
        sizes = {}
        for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
            with open(file, "rb+") as f:
                os.fsync(f.fileno())
            sizes[str(file.relative_to(tmp))] = file.stat().st_size
        manifest = json.dumps({"xlm_version": xlm_version(), "files": sizes}).encode()
        with open(tmp / MANIFEST, "wb") as f:
            f.write(manifest)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if check_directory(path):
            # Another process (a data-parallel rank, a second server) finished the same
            # entry while this one was writing: keep theirs, it is equal.
            shutil.rmtree(tmp, ignore_errors=True)
            return
        try:
            os.replace(tmp, path)  # check_directory discarded any incomplete entry
        except OSError:
            if not check_directory(path):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # theirs landed between check and rename
            return
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_directory(path: str | Path) -> bool:
    """Whether an atomic_directory entry is complete; an incomplete one is deleted."""
    path = Path(path)
    if not path.exists():
        return False
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        ok = all((path / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        logger.warning("Discarding the incomplete cache directory %s.", path)
        discard(path)
    return ok


def evict(directory: str | Path, keep_prefix: str, max_bytes: int) -> list[Path]:
    """Delete files not named `keep_prefix*`, oldest first, while the directory exceeds
    `max_bytes`; entries of the current version (`keep_prefix`) are never evicted.

    Temporary files older than an hour (left by a killed process) go first. Returns what
    was deleted.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    entries = []
    for p in directory.iterdir():
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            if p.is_file():
                entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    removed = []
    stale_tmp = time.time() - 3600
    for mtime, size, p in sorted(entries, key=lambda e: e[0]):
        if p.name.startswith(TMP_PREFIX) and mtime < stale_tmp:
            discard(p)
            total -= size
            removed.append(p)
    for _, size, p in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        if p.name.startswith((keep_prefix, TMP_PREFIX)):
            continue
        discard(p)
        total -= size
        removed.append(p)
    return removed

"""xlm.disk_cache: versioned keys, atomic checksummed writes, 0700 directories, eviction."""

import os
import stat
import time
from pathlib import Path

import pytest

import xlm
from xlm import disk_cache


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_test_suite_uses_a_temporary_cache_root():
    import tempfile

    from tests.conftest import TEST_CACHE_ROOT
    from xlm import envs

    assert envs.XLM_CACHE_ROOT == TEST_CACHE_ROOT
    assert TEST_CACHE_ROOT.startswith(tempfile.gettempdir())
    assert envs.XLM_COMPILATION_CACHE_DIR.startswith(TEST_CACHE_ROOT)


def test_entry_round_trip_in_private_directories(tmp_path):
    path = tmp_path / "a" / "b" / "entry.bin"
    disk_cache.write_entry(path, b"payload" * 100)
    assert disk_cache.read_entry(path) == b"payload" * 100
    assert _mode(tmp_path / "a") == 0o700 and _mode(tmp_path / "a" / "b") == 0o700
    assert os.listdir(path.parent) == ["entry.bin"]  # no temporary file beside it


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_damaged_entry_is_discarded_not_fatal(tmp_path, damage):
    path = tmp_path / "entry.bin"
    disk_cache.write_entry(path, bytes(range(256)) * 10)
    data = path.read_bytes()
    if damage == "truncate":
        data = data[: len(data) - 7]
    elif damage == "flip":
        data = data[:-1] + bytes([data[-1] ^ 1])
    else:
        data = b""
    path.write_bytes(data)
    assert disk_cache.read_entry(path) is None
    assert not path.exists()  # deleted, so the next store rebuilds it
    disk_cache.write_entry(path, b"rebuilt")
    assert disk_cache.read_entry(path) == b"rebuilt"


def test_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "entry.bin"
    disk_cache.write_entry(path, b"old")

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        disk_cache.write_entry(path, b"new")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["entry.bin"]
    assert disk_cache.read_entry(path) == b"old"  # the old entry is untouched


def test_atomic_directory_removes_its_temporary_on_error(tmp_path):
    target = tmp_path / "weights"
    with pytest.raises(RuntimeError):
        with disk_cache.atomic_directory(target) as tmp:
            (tmp / "model.bin").write_bytes(b"x" * 10)
            raise RuntimeError("conversion failed")
    assert os.listdir(tmp_path) == []
    with disk_cache.atomic_directory(target) as tmp:
        (tmp / "model.bin").write_bytes(b"x" * 10)
    assert disk_cache.check_directory(target)
    (target / "model.bin").write_bytes(b"x" * 4)  # truncated
    assert not disk_cache.check_directory(target) and not target.exists()


def test_key_includes_xlm_version(monkeypatch):
    before = disk_cache.cache_key("model.gguf", 123)
    assert disk_cache.cache_key("model.gguf", 123) == before
    monkeypatch.setattr(xlm, "__version__", xlm.__version__ + ".post1")
    assert disk_cache.cache_key("model.gguf", 123) != before


def test_evict_other_versions_beyond_cap(tmp_path):
    def make(name, size, age):
        p = tmp_path / name
        p.write_bytes(b"x" * size)
        t = time.time() - age
        os.utime(p, (t, t))
        return p

    old1 = make("v0-model-a.xla", 400, 30)
    old2 = make("v0-model-b.xla", 400, 20)
    cur = make("v1-model-a.xla", 400, 40)  # oldest, but of the current version
    assert disk_cache.evict(tmp_path, "v1", 2000) == []  # under the cap: nothing goes
    removed = disk_cache.evict(tmp_path, "v1", 900)
    assert removed == [old1]  # the oldest of another version, until under the cap
    assert cur.exists() and old2.exists()
    disk_cache.evict(tmp_path, "v1", 0)
    assert sorted(os.listdir(tmp_path)) == ["v1-model-a.xla"]


def test_two_processes_writing_one_directory_entry_both_succeed(tmp_path, monkeypatch):
    """Two processes converting the same checkpoint at once (data-parallel ranks, or two
    servers on a cold cache): whichever lands second keeps the first's equal entry."""
    target = tmp_path / "weights"

    def write(payload: bytes) -> None:
        with disk_cache.atomic_directory(target) as tmp:
            (tmp / "model.bin").write_bytes(payload)

    with disk_cache.atomic_directory(target) as tmp:
        (tmp / "model.bin").write_bytes(b"a" * 10)
        write(b"b" * 10)  # the other process finishes first
    assert (target / "model.bin").read_bytes() == b"b" * 10
    assert os.listdir(tmp_path) == ["weights"]

    # The other lands between this one's check and its rename: the rename fails (the
    # target is a non-empty directory) and the complete entry is kept.
    disk_cache.discard(target)
    replace = os.replace

    raced = []

    def racing_replace(src, dst):
        if Path(dst) == target and not raced:
            raced.append(dst)
            write(b"c" * 10)
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", racing_replace)
    write(b"d" * 10)
    monkeypatch.undo()
    assert (target / "model.bin").read_bytes() == b"c" * 10
    assert os.listdir(tmp_path) == ["weights"]

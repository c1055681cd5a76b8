import os

import pytest

from data_loading.atomic import TEMP_SUFFIX, atomic_write


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"old")

    def broken(handle):
        handle.write(b"half")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of a checkpoint

    with pytest.raises(KeyboardInterrupt):
        atomic_write(str(path), broken)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_successful_write_replaces(tmp_path):
    path = tmp_path / "a.npy"
    atomic_write(str(path), lambda h: h.write(b"new"))
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["a.npy"]


def test_temporary_is_a_new_file_never_one_already_there(tmp_path, monkeypatch):
    """The temporary name is unpredictable and opened with O_EXCL: a file or a symbolic link
    someone put at a guessable name (the old ``.<name>.<pid>.tmp``) is neither followed nor
    truncated, and the output gets the usual permissions (0666 less the umask, not 0600)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = tmp_path / "out.npy"
    os.symlink(victim, tmp_path / f".out.npy.{os.getpid()}{TEMP_SUFFIX}")
    seen = []
    real_open = os.open

    def spy(name, flags, *args, **kwargs):
        seen.append((os.path.basename(name), flags))
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    old = os.umask(0o027)
    try:
        atomic_write(str(path), lambda h: h.write(b"new"))
    finally:
        os.umask(old)
    assert victim.read_bytes() == b"keep" and path.read_bytes() == b"new"
    assert len(seen) == 1 and seen[0][1] & os.O_EXCL and seen[0][0] != f".out.npy.{os.getpid()}{TEMP_SUFFIX}"
    assert (path.stat().st_mode & 0o777) == 0o640

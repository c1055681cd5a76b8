import os

import pytest

from data_loading.atomic import atomic_write, temp_path_for


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
    assert path.read_bytes() == b"new" and not os.path.exists(temp_path_for(str(path)))

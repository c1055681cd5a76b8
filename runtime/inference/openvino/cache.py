"""The cache of converted networks: keyed, checked, written atomically, in the user's cache folder.

Layout: ``<cache_dir>/openvino/<checkpoint name>-<hash of its path>/<key>/`` (``--cache_dir``,
else ``$XDG_CACHE_HOME/unet3d-kits19``, else ``~/.cache/unet3d-kits19``: never beside the
checkpoint or an input, a folder the user did not name for output) holding ``model.xml``, ``model.bin`` (OpenVINO's IR)
and ``key.json`` (the fields the key hashes, readable). The key is a hash of
:func:`cache_fields`: a digest of the weights themselves (every tensor of the state dict,
with its name, dtype and shape: a checkpoint rewritten with other weights changes it even with
the same size and time stamp), the architecture flags, the window shape, the precision and
calibration set, the versions of OpenVINO, NNCF, PyTorch, and a digest of the network's source
files (a change to the model code changes the traced graph). An entry is used only when its
``key.json`` equals the fields; a new entry is built in a hidden temporary folder and renamed
into place, so a reader never sees half of one; entries of other weights are then removed.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from runtime.checkpoint import weights_digest

FORMAT = 2  # bump when the conversion itself changes (trace shape, options)
CODE_FILES = ("model/unet3d.py", "model/layers.py", "runtime/levers/cpu/blocks.py",
              "runtime/inference/openvino/compiled.py", "runtime/inference/openvino/calibration.py",
              "runtime/inference/openvino/decoder_split.py")
ROOT = Path(__file__).resolve().parents[3]
LEFTOVER_SECONDS = 24 * 3600  # a hidden build folder older than this was left by a killed process


def code_digest() -> str:
    digest = hashlib.sha256()
    for name in CODE_FILES:
        digest.update(name.encode() + (ROOT / name).read_bytes())
    return digest.hexdigest()[:16]


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def cache_fields(model: torch.nn.Module, architecture: dict, window, calibration=None) -> dict:
    """What the converted network depends on (JSON-serialisable): ``model``'s weights, its
    ``architecture`` (the network flags: ``filters``, ``normalization``, ``activation``), the
    ``window`` and the int8 ``calibration`` set, the versions and the code."""
    return {
        "format": FORMAT,
        "weights_sha256": weights_digest(model.state_dict()),
        "architecture": {"filters": list(architecture["filters"]), "normalization": architecture["normalization"],
                         "activation": architecture["activation"], "module": type(model).__name__},
        "window": list(window),
        "precision": "int8" if calibration is not None else "fp32",
        "calibration": calibration.fields() if calibration is not None else None,
        "openvino": _version("openvino"),
        "nncf": _version("nncf") if calibration is not None else None,
        "torch": torch.__version__,
        "code_sha256": code_digest(),
    }


def cache_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


CACHE_NAME = "unet3d-kits19"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/unet3d-kits19`` (an absolute ``XDG_CACHE_HOME``, as the XDG base
    directory rules ask), else ``~/.cache/unet3d-kits19``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, CACHE_NAME)


def cache_folder(checkpoint_path: str, cache_dir: str) -> str:
    """The folder of ``checkpoint_path``'s converted networks under ``cache_dir`` (the plan's:
    ``runtime.resolve.decide_cache_dir``, ``--cache_dir`` or :func:`default_cache_dir`):
    ``openvino/<name>-<sha256 of its absolute path, 16 hex digits>``, one per checkpoint file
    (its entries of other weights are removed)."""
    if not cache_dir:
        raise ValueError("the OpenVINO cache needs the plan's cache_dir (runtime.resolve.decide_cache_dir)")
    path = os.path.abspath(checkpoint_path)
    tag = hashlib.sha256(path.encode()).hexdigest()[:16]
    return os.path.join(cache_dir, "openvino", f"{os.path.basename(path)}-{tag}")


class CacheEntry:
    """One converted network in ``folder``: ``load`` it if its fields match, else ``store`` it."""

    def __init__(self, folder: str, fields: dict):
        self.folder = folder
        self.fields = fields
        self.path = os.path.join(folder, cache_key(fields))

    def load(self, core, say: Callable[[str], None]):
        """The stored ``openvino.Model``, or None when absent, of other fields, or unreadable
        (then it is rebuilt: one line says so)."""
        try:
            with open(os.path.join(self.path, "key.json"), encoding="utf-8") as handle:
                stored = json.load(handle)
        except (OSError, ValueError):
            return None
        if stored != self.fields:  # a hash collision or an edited entry: never trust it
            say(f"openvino: cache entry {self.path} does not match this network; converting again")
            return None
        try:
            return core.read_model(os.path.join(self.path, "model.xml"))
        except Exception as err:  # noqa: BLE001 - OpenVINO raises RuntimeError subclasses of its own
            say(f"openvino: cannot read {self.path} ({str(err).splitlines()[0][:200]}); converting again")
            return None

    def store(self, ov_model, say: Callable[[str], None]) -> bool:
        """Write ``ov_model`` as this entry (temporary folder, then rename); remove entries of
        other weights. False (and one line) when the folder cannot be written."""
        import openvino as ov

        temp = None
        try:
            os.makedirs(self.folder, exist_ok=True)
            temp = _new_folder(self.folder, ".building-")
            ov.save_model(ov_model, os.path.join(temp, "model.xml"), compress_to_fp16=False)
            with open(os.path.join(temp, "key.json"), "w", encoding="utf-8") as handle:
                json.dump(self.fields, handle, indent=1, sort_keys=True)
            _replace_folder(temp, self.path)
            temp = None
        except OSError as err:
            say(f"openvino: cannot cache the converted network in {self.folder} "
                f"({err.strerror or type(err).__name__}); it is used for this run only")
            return False
        finally:
            if temp is not None:
                shutil.rmtree(temp, ignore_errors=True)
        self.remove_stale()
        return True

    def remove_stale(self) -> None:
        """Remove entries converted from other weights (they can never match this checkpoint
        again unless it is rewritten with those weights, which converts again)."""
        for name in os.listdir(self.folder):
            path = os.path.join(self.folder, name)
            if name.startswith("."):  # a build in progress, or left by a killed process
                if time.time() - os.path.getmtime(path) > LEFTOVER_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)
                continue
            if path == self.path:
                continue
            try:
                with open(os.path.join(path, "key.json"), encoding="utf-8") as handle:
                    stale = json.load(handle).get("weights_sha256") != self.fields["weights_sha256"]
            except (OSError, ValueError):
                stale = True
            if stale:
                shutil.rmtree(path, ignore_errors=True)


def _new_folder(parent: str, prefix: str) -> str:
    """A new folder with an unused random name in ``parent``, created with the permissions
    ``mkdir`` gives (0777 less the umask: the cache entry is shared like any other folder),
    unlike ``mkdtemp``'s 0700, and without touching the process's umask."""
    for _ in range(100):
        path = os.path.join(parent, prefix + secrets.token_hex(6))
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused folder name", os.path.join(parent, prefix + "*"))


def _replace_folder(temp: str, final: str) -> None:
    """Rename ``temp`` to ``final``; an existing ``final`` (a stale or concurrent copy) is moved
    aside first, so ``final`` is always a complete entry or absent."""
    if os.path.exists(final):
        aside = tempfile.mkdtemp(prefix=".old-", dir=os.path.dirname(final))
        os.rename(final, os.path.join(aside, "entry"))
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(temp, final)
    except OSError:
        if not os.path.isfile(os.path.join(final, "key.json")):
            raise
        shutil.rmtree(temp, ignore_errors=True)  # another process stored the same entry first

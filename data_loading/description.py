"""A dataset description: what a raw labelled CT set holds and how preprocessing reads it.

The file is JSON in the shape of nnU-Net v2's ``dataset.json`` where it fits (an nnU-Net
``dataset.json`` is read as it is; keys this project does not use are ignored)::

    {"name": "KiTS23",
     "labels": {"background": 0, "kidney": 1, "tumor": 2, "cyst": 3},
     "file_ending": ".nii.gz",
     "layout": "case_folders",              # or "imagesTr" (nnU-Net's flat layout)
     "image_file": "imaging.nii.gz",        # case_folders only: the files in each case folder
     "label_file": "segmentation.nii.gz",
     "target_spacing": [1.6, 1.2, 1.2]}     # or "median": the data's median spacing

* ``case_folders`` (KiTS19, KiTS21, KiTS23): ``DATA/<case>/imaging.nii.gz`` and
  ``segmentation.nii.gz``; a case without its label file is skipped and counted.
* ``imagesTr`` (nnU-Net): ``DATA/imagesTr/<case>_0000<file_ending>`` and
  ``DATA/labelsTr/<case><file_ending>``; one channel (``_0000``) only. Checked as nnU-Net's
  ``verify_dataset_integrity`` does (every image with its label and back, the file names,
  ``numTraining``): ``data_loading.preprocessing.images_tr_cases``.

Every case is read in KiTS19's axes (:data:`CANONICAL_AXES`) whatever its files' orientation,
and ``target_spacing`` is in that order: slices, height, width.

A case's number is the last run of digits of its folder or file name (``case_00588`` -> 588,
``kidney_012`` -> 12); its preprocessed files are ``case_XXXXX_{x,y}.npy`` (five digits at
least), the names the data loader and the evaluation split use.

No description means KiTS19 (:data:`KITS19`): the benchmark's labels, layout, ids below 210 and
target spacing, and preprocessing exactly as the reference's. A described dataset's
preprocessed folder carries the description as it was used (:data:`DESCRIPTION_FILE`, with the
target spacing resolved and the evaluation split), so that what reads the folder later needs
nothing else. Standard library only: ``preprocess_dataset.py`` starts without torch.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Sequence

DESCRIPTION_FILE = "dataset.json"
FINGERPRINT_FILE = "dataset_fingerprint.json"
WRITTEN_BY = "preprocess_dataset.py"  # marks a description this project wrote (never overwrite another)
IGNORE = "ignore"  # nnU-Net's ignore label: no class (no output, no loss, no Dice in its voxels)
LAYOUTS = ("case_folders", "imagesTr")
CHANNEL_SUFFIX = "_0000"
# The axes of every preprocessed array of a described dataset, whatever the files' own: axis 0 the
# slices running Inferior, axis 1 Posterior, axis 2 Left (nibabel's axis codes; KiTS19's layout,
# the one predict reads every scan into: data_loading.scan_io.read_case). A description's
# target_spacing and the fingerprint's spacings are in this order. Saved in the folder's record; a
# record without it is of a folder preprocessed in each file's stored order (an earlier version).
CANONICAL_AXES = "I-P-L"
# Where a target spacing came from: the record's token, and the words a line says it in.
SPACING_SOURCES = {"description": "the description", "median": "the median of the cases",
                   "--target_spacing": "--target_spacing",
                   "kits19": "KiTS19's default (the description names none)"}
BENCHMARK_SPACING = "KiTS19's, the benchmark's (no description)"  # "kits19" for KiTS19 without a description
_TRAILING_DIGITS = re.compile(r"(\d+)$")


class DescriptionError(ValueError):
    """A description (or evaluation split) that cannot be used: one line naming the file."""


@dataclass(frozen=True)
class IntensityWindow:
    """The CT intensity normalisation of preprocessing: clip to [``low``, ``high``] HU, then
    ``(x - mean) / std`` in float32."""

    low: int
    high: int
    mean: float
    std: float


@dataclass(frozen=True)
class DatasetDescription:
    """What preprocessing needs to know of a dataset. ``labels``: name -> value, values 0..N-1
    with 0 the background; ``target_spacing``: mm per axis of the canonical array (slices,
    height, width), or ``"median"``; ``spacing_from``: where it came from (``description``, or
    ``kits19`` when the description names none); ``num_training``: nnU-Net's ``numTraining``,
    the count of labelled cases the data must hold (None: not given); ``intensity``: the
    normalisation (KiTS19's for every dataset); ``first_unlabelled_id``: KiTS19's ids from here
    on have no labels (None for a described dataset); ``evaluation_cases``: case ids
    (``"00003"``) of the evaluation split, empty for KiTS19's default list; ``ignore``: the value
    of nnU-Net's ``ignore`` label (not among ``labels``: no class), None without one; ``path``:
    the file it was read from ("" for KiTS19)."""

    name: str
    labels: tuple[tuple[str, int], ...]
    target_spacing: tuple[float, ...] | str
    intensity: IntensityWindow
    spacing_from: str = "description"
    first_unlabelled_id: int | None = None
    file_ending: str = ".nii.gz"
    layout: str = "case_folders"
    image_file: str = "imaging.nii.gz"
    label_file: str = "segmentation.nii.gz"
    evaluation_cases: tuple[str, ...] = ()
    ignore: int | None = None
    num_training: int | None = None
    path: str = field(default="", compare=False)

    @property
    def label_values(self) -> tuple[int, ...]:
        """The values a label file may hold: the classes' and the ignore label's."""
        return tuple(value for _, value in self.labels) + (() if self.ignore is None else (self.ignore,))

    def labels_text(self) -> str:
        """``background 0, kidney 1, tumor 2`` (for one-line messages)."""
        return ", ".join(f"{name} {value}" for name, value in self.labels) + (
            f", {IGNORE} {self.ignore}" if self.ignore is not None else "")

    def record(self, target_spacing: Sequence[float], target_from: str) -> dict:
        """The description as saved into the preprocessed folder (plain JSON types), the target
        spacing resolved to numbers and where they came from (a token of :data:`SPACING_SOURCES`),
        and the arrays' axes (:data:`CANONICAL_AXES`)."""
        labels = dict(self.labels) | ({IGNORE: self.ignore} if self.ignore is not None else {})
        return {"name": self.name, "labels": labels, "file_ending": self.file_ending,
                "layout": self.layout, "image_file": self.image_file, "label_file": self.label_file,
                "axes": CANONICAL_AXES,
                "target_spacing": [float(s) for s in target_spacing], "target_spacing_from": target_from,
                "evaluation_cases": list(self.evaluation_cases), "source": self.path, "written_by": WRITTEN_BY}


# The benchmark's dataset: every fact of KiTS19 the code uses, in this one place (labels 0-2,
# target spacing in mm per axis (slices, height, width), the reference's intensity window, and
# the first id of the unlabelled test cases). Everything that needs one of them reads it here.
KITS19 = DatasetDescription(name="KiTS19", labels=(("background", 0), ("kidney", 1), ("tumor", 2)),
                            target_spacing=(1.6, 1.2, 1.2), intensity=IntensityWindow(-79, 304, 101.0, 76.9),
                            spacing_from="kits19", first_unlabelled_id=210)


def spacing_source_text(token: str, described: bool = True) -> str:
    """The words for where a target spacing came from (:data:`SPACING_SOURCES`' token);
    ``described`` False: KiTS19 preprocessed without a description (the benchmark's)."""
    if token == "kits19" and not described:
        return BENCHMARK_SPACING
    return SPACING_SOURCES.get(token, token)


def kits19_labels(values: Sequence[int]) -> bool:
    """Whether ``values`` are KiTS19's label values, those the model, loss and metric handle today."""
    return tuple(values) == KITS19.label_values


def _fail(path: str, text: str) -> DescriptionError:
    return DescriptionError(f"{path}: {text}")


def parse_description(record, path: str) -> DatasetDescription:
    """A :class:`DatasetDescription` from a parsed JSON ``record`` (``path`` names it in errors)."""
    if not isinstance(record, dict):
        raise _fail(path, "expected a JSON object with \"labels\"")
    labels = record.get("labels")
    if not isinstance(labels, dict) or not labels:
        raise _fail(path, "\"labels\" must be an object of label name -> value, e.g. {\"background\": 0, \"kidney\": 1}")
    for name, value in labels.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(path, f"label {name!r}: value {json.dumps(value)} is not one integer "
                              "(nnU-Net's region labels, lists of values, are not supported)")
    ordered = tuple(sorted(labels.items(), key=lambda item: item[1]))
    values = [value for _, value in ordered]
    if values != list(range(len(values))):
        raise _fail(path, f"label values {values} must be 0, 1, ... {len(values) - 1} without gaps, 0 the background")
    ignore = labels.get(IGNORE)
    if ignore is not None and ignore != values[-1]:
        raise _fail(path, f"label {IGNORE!r} is {ignore}: nnU-Net's ignore label must have the largest value ({values[-1]})")
    ordered = tuple(pair for pair in ordered if pair[0] != IGNORE)
    if len(ordered) < 2 or len(values) > 255:
        raise _fail(path, f"{len(ordered)} labels besides {IGNORE!r}: expected the background and 1 to 253 "
                          "foreground labels")
    channels = record.get("channel_names", record.get("modality"))
    if isinstance(channels, dict) and len(channels) != 1:
        raise _fail(path, f"{len(channels)} input channels: one channel (CT) only is supported")
    layout = record.get("layout", "imagesTr" if "numTraining" in record or "channel_names" in record else "case_folders")
    if layout not in LAYOUTS:
        raise _fail(path, f"\"layout\" {json.dumps(layout)}: expected one of {', '.join(LAYOUTS)}")
    strings = {}
    for key in ("name", "file_ending", "image_file", "label_file"):
        value = record.get(key, "dataset" if key == "name" else getattr(KITS19, key))
        if not isinstance(value, str) or not value or (key != "name" and ("/" in value or "\\" in value)):
            raise _fail(path, f"\"{key}\" must be a file name (a non-empty string), got {json.dumps(value)}")
        strings[key] = value
    given = "target_spacing" in record
    target = parse_target_spacing(record["target_spacing"], f"{path}: \"target_spacing\"") if given \
        else KITS19.target_spacing
    count = record.get("numTraining")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise _fail(path, f"\"numTraining\" must be a count of cases (a whole number), got {json.dumps(count)}")
    return DatasetDescription(labels=ordered, layout=layout, target_spacing=target, intensity=KITS19.intensity,
                              spacing_from="description" if given else "kits19", num_training=count, ignore=ignore,
                              path=path, **strings)


def parse_target_spacing(value, where: str) -> tuple[float, ...] | str:
    """``"median"`` or three positive numbers (a list, or ``"D,H,W"`` text from a flag)."""
    if value == "median":
        return "median"
    if isinstance(value, str):
        value = value.replace(",", " ").split()
        try:
            value = [float(v) for v in value]
        except ValueError:
            value = None
    if (not isinstance(value, (list, tuple)) or len(value) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 100 for v in value)):
        raise DescriptionError(f"{where}: expected \"median\" or three spacings in mm (0 < s < 100), "
                               f"got {json.dumps(value)}")
    return tuple(float(v) for v in value)


def load_description(path: str) -> DatasetDescription:
    """The description in the JSON file ``path``; :class:`DescriptionError` (one line) when it
    cannot be read or used."""
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except OSError as exc:
        raise _fail(path, f"cannot read ({exc.strerror or type(exc).__name__})") from None
    except ValueError as exc:
        raise _fail(path, f"not valid JSON ({str(exc).splitlines()[0]})") from None
    return parse_description(record, path)


def case_number(name: str) -> int | None:
    """The case's number: the last run of digits of a folder or file stem (``case_00588`` -> 588)."""
    match = _TRAILING_DIGITS.search(name)
    return int(match.group(1)) if match else None


def normalise_case_id(text: str) -> str | None:
    """An evaluation split's line as the data loader's id (``"00003"``): ``3``, ``00003`` and
    ``case_00003`` are one case; None when the line holds no number."""
    number = case_number(text.strip())
    return None if number is None else f"{number:05d}"


def read_split(path: str) -> tuple[str, ...]:
    """The evaluation case ids listed in ``path`` (one per line, ``#`` comments and blank lines
    ignored), normalised (:func:`normalise_case_id`); one-line errors naming the file and line."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise DescriptionError(f"--evaluation_cases {path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    except UnicodeDecodeError:
        raise DescriptionError(f"--evaluation_cases {path}: not a text file of case ids") from None
    ids = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        case_id = normalise_case_id(text)
        if case_id is None:
            raise DescriptionError(f"--evaluation_cases {path}: line {number} {text!r} names no case id")
        if case_id not in ids:
            ids.append(case_id)
    if not ids:
        raise DescriptionError(f"--evaluation_cases {path}: no case id in it")
    return tuple(ids)


def read_written_description(folder: str) -> dict | None:
    """The description preprocessing saved in the preprocessed ``folder`` (its record), or None
    when the folder has none (KiTS19 preprocessed without a description). A file that is not
    one this project wrote, or does not parse, is an error naming it."""
    path = os.path.join(str(folder), DESCRIPTION_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError) as exc:
        raise DescriptionError(f"{path}: cannot read the dataset description ({str(exc).splitlines()[0]})") from None
    if not isinstance(record, dict) or record.get("written_by") != WRITTEN_BY or not isinstance(record.get("labels"), dict):
        raise DescriptionError(f"{path}: not a description written by {WRITTEN_BY} (a preprocessed folder holds "
                               "the one preprocessing saved)")
    return record


def record_labels(record: dict) -> tuple[tuple[str, int], ...]:
    """A saved record's labels as (name, value) pairs, ordered by value."""
    return tuple(sorted(((str(k), int(v)) for k, v in record["labels"].items()), key=lambda item: item[1]))


def record_spacing(record: dict, where: str = DESCRIPTION_FILE) -> tuple[float, ...]:
    """The target spacing (mm per axis) a saved record says its folder was resampled to
    (KiTS19's when it names none); :class:`DescriptionError` naming ``where`` if it is no spacing."""
    spacing = parse_target_spacing(record.get("target_spacing", list(KITS19.target_spacing)),
                                   f"{where}: \"target_spacing\"")
    if spacing == "median":
        raise _fail(where, "\"target_spacing\" is \"median\": a preprocessed folder records the spacing in mm")
    return tuple(spacing)


def folder_description(folder) -> DatasetDescription | None:
    """The description preprocessing saved in the preprocessed ``folder``, as it was used: labels
    (and nnU-Net's ignore label), the target spacing in mm (canonical axes), the evaluation
    split; ``path`` its file. None for KiTS19 preprocessed without one. One read of one small
    file (no case): what a run knows of its data before the MLPerf clock starts. A file that is
    not one this project wrote, does not parse, or comes from a folder preprocessed in the files'
    stored axis order (no ``axes``) is a :class:`DescriptionError` naming it."""
    record = read_written_description(str(folder))
    if record is None:
        return None
    path = os.path.join(str(folder), DESCRIPTION_FILE)
    if record.get("axes") != CANONICAL_AXES:
        raise _fail(path, "preprocessed by an earlier version, in each file's stored axis order, which predict does "
                          f"not read ({CANONICAL_AXES} now): preprocess the raw data again into a new --results_dir")
    parsed = parse_description({**record, "layout": record.get("layout", "case_folders")}, path)
    cases = record.get("evaluation_cases") or []
    if not isinstance(cases, list) or not all(isinstance(c, str) for c in cases):
        raise _fail(path, "\"evaluation_cases\" must be a list of case ids")
    spacing = record_spacing(record, path)
    return DatasetDescription(name=parsed.name, labels=parsed.labels, target_spacing=spacing, intensity=parsed.intensity,
                              spacing_from=str(record.get("target_spacing_from", "description")),
                              file_ending=parsed.file_ending, layout=parsed.layout, image_file=parsed.image_file,
                              label_file=parsed.label_file, evaluation_cases=tuple(cases), ignore=parsed.ignore,
                              path=path)

"""Predict in any orientation: every scan is brought to the KiTS19 layout the network was trained
in (array axis 0 the slices, axis codes I-P-L) from its affine, and the segmentation goes back
to the file's own axes, shape and header.

The oracles are nibabel's own orientation handling (``as_reoriented`` makes the variants and
maps the outputs back) and SimpleITK's ``DICOMOrient`` (an independent maker of variants); the
network is a tiny random one (or a fixed random convolution, which is neither flip- nor
permutation-symmetric), so any axis mix-up changes the labels.
"""
import itertools
import json
import os

import nibabel
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from nibabel.orientations import axcodes2ornt, io_orientation, ornt_transform

from checkpoints import architecture, write_checkpoint
from data_loading import synthetic
from data_loading.preprocessing import load_image, preprocess_arrays
from data_loading.scans import (Scan, ScanError, labels_in_original_grid, preprocess_scan, read_scan, scan_geometry,
                                write_segmentation)
from runtime.predict.scan import segment_scan
from segmenters import segmenter
from main_runs import predict_runner
from test_predict import blob_label

SPACING = (2.5, 0.75, 1.25)  # exact in float32 and in decimal: every variant reads the same numbers
SHAPE = (14, 30, 23)        # resampled to (21, 18, 23): every axis changes, none alike
ORIGIN = (12.5, -40.0, 7.25)
TINY = (4, 8, 16, 32, 32)


def kits_image(shape=SHAPE, spacing=SPACING, seed=0, label=False):
    """A KiTS19-layout NIfTI image (affine like KiTS19's, I-P-L, with an origin): CT-like int16
    values over a kidney/tumour blob, or the blob itself as labels."""
    truth = blob_label(shape)
    if label:
        data = truth
    else:
        noise = np.random.default_rng(seed).normal(0, 40, shape)
        data = (np.choose(truth, [30, 180, 105]) + noise).astype(np.int16)
    affine = synthetic.kits_affine(spacing)
    affine[:3, 3] = ORIGIN
    image = nibabel.Nifti1Image(data, affine)
    image.header.set_zooms(spacing)
    image.header.set_qform(affine, code=1)
    image.header.set_sform(affine, code=1)
    return image


def all_orientations():
    """Every axis permutation with every flip: 48 nibabel orientation transforms."""
    for perm in itertools.permutations(range(3)):
        for flips in itertools.product((1, -1), repeat=3):
            yield np.array([[axis, flip] for axis, flip in zip(perm, flips)])


def to_codes(image, codes):
    """``image`` (nibabel) reoriented by nibabel to the axis ``codes``."""
    return image.as_reoriented(ornt_transform(io_orientation(image.affine), axcodes2ornt(codes)))


def kits_labels(path):
    """A written segmentation mapped back to the KiTS19 layout by nibabel."""
    return np.asarray(to_codes(nibabel.load(path), ("I", "P", "L")).dataobj)


def random_conv_infer(seed=0):
    """``infer``: a fixed random 3x3x3 convolution 1 -> 3 classes, softmax (no symmetry)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(3, 1, 3, 3, 3, generator=generator)
    bias = torch.tensor([0.0, -0.3, -0.6])

    def infer(image):
        with torch.no_grad():
            logits = F.conv3d(torch.from_numpy(image)[None], weight, bias, padding=1)[0]
        return torch.softmax(logits, 0)

    return infer


def case_variant(root, name, codes, label=True):
    """A KiTS19 case folder whose image (and segmentation) nibabel reoriented to ``codes``."""
    folder = os.path.join(str(root), name)
    os.makedirs(folder, exist_ok=True)
    nibabel.save(to_codes(kits_image(), codes), os.path.join(folder, "imaging.nii.gz"))
    if label:
        nibabel.save(to_codes(kits_image(label=True), codes), os.path.join(folder, "segmentation.nii.gz"))
    return Scan(name, os.path.join(folder, "imaging.nii.gz"),
                os.path.join(folder, "segmentation.nii.gz") if label else None)


# ----------------------------------------------------------------------------- reading


def test_kits_layout_is_read_exactly_as_before(tmp_path):
    """A KiTS19-layout file is not moved: the very arrays and spacing list preprocessing's
    ``load_image`` gives, an identity orientation, labels handed back as the same object, and a
    written segmentation byte for byte the one the pre-orientation steps wrote."""
    path = str(tmp_path / "kits.nii.gz")
    nibabel.save(kits_image(), path)
    raw = read_scan(path)
    image, spacing, _ = load_image(path)
    assert raw.orientation.identity and raw.orientation.codes == ("I", "P", "L")
    assert np.array_equal(raw.image, image) and raw.image.dtype == image.dtype
    assert raw.spacing == spacing and type(raw.spacing) is list and raw.file_spacing == spacing
    labels = np.zeros(SHAPE, np.uint8)
    assert raw.to_file(labels) is labels and raw.to_kits(labels) is labels
    # the steps as they ran before orientations were read, composed from the unchanged functions
    infer = random_conv_infer()
    x, _ = preprocess_arrays(image, None, spacing)
    before = str(tmp_path / "before.nii.gz")
    write_segmentation(before, labels_in_original_grid(infer(x), scan_geometry(SHAPE, spacing)), nibabel.load(path))
    segment_scan(Scan("kits", path), segmenter(infer), str(tmp_path))
    assert open(tmp_path / "kits.nii.gz", "rb").read() == open(before, "rb").read()


def test_synthetic_kits19_files_are_in_the_kits_layout(tmp_path):
    """The synthetic KiTS19 cases of the test fixtures and the demo (and KiTS19's own affine
    form) read with no reorientation."""
    synthetic.generate(str(tmp_path), cases=1, seed=0)
    raw = read_scan(str(tmp_path / "case_00000" / "imaging.nii.gz"))
    assert raw.orientation.identity


def test_every_orientation_reads_as_the_kits_layout(tmp_path):
    """All 48 axis permutations and flips (made by nibabel's ``as_reoriented``): the image the
    network is given and its spacing are exactly those of the KiTS19-layout file, and the way
    back gives the variant's own array."""
    nibabel.save(kits_image(), str(tmp_path / "kits.nii.gz"))
    reference = read_scan(str(tmp_path / "kits.nii.gz"))
    moved = 0
    for i, ornt in enumerate(all_orientations()):
        variant = kits_image().as_reoriented(ornt)
        path = str(tmp_path / f"v{i}.nii.gz")
        nibabel.save(variant, path)
        raw = read_scan(path)
        assert np.array_equal(raw.image, reference.image), ornt.tolist()
        assert raw.spacing == reference.spacing, (ornt.tolist(), raw.spacing)
        assert raw.file_spacing == [float(s) for s in variant.header.get_zooms()]
        stored = np.asarray(variant.dataobj)
        assert np.array_equal(raw.to_file(raw.image[0]), stored) and raw.to_file(raw.image[0]).shape == stored.shape
        moved += not raw.orientation.identity
    assert moved == 47


# ----------------------------------------------------------------------------- segmentations


VARIANTS = [("I", "P", "L"), ("R", "A", "S"), ("L", "P", "S"), ("S", "L", "A"), ("P", "I", "R"), ("A", "R", "I")]


def test_the_same_segmentation_in_every_orientation(tmp_path):
    """One scan (and its ground truth) in KiTS19, RAS, LPS and other orientations: each
    segmentation is written with its variant's own shape, affine and header, and mapped back by
    nibabel it is the KiTS19 one voxel for voxel; the Dice against the ground truth agrees."""
    infer = random_conv_infer()
    os.makedirs(tmp_path / "out")
    outputs, results = {}, {}
    for codes in VARIANTS:
        name = "".join(codes)
        scan = case_variant(tmp_path / "raw", name, codes)
        results[name] = segment_scan(scan, segmenter(infer), str(tmp_path / "out"))
        written, source = nibabel.load(str(tmp_path / "out" / f"{name}.nii.gz")), nibabel.load(scan.image_path)
        assert written.shape == source.shape and np.array_equal(written.affine, source.affine)
        assert nibabel.aff2axcodes(written.affine) == codes
        assert results[name].shape == source.shape
        outputs[name] = kits_labels(str(tmp_path / "out" / f"{name}.nii.gz"))
    kits = outputs["IPL"]
    assert len(np.unique(kits)) == 3  # a segmentation with every class: a mix-up would show
    for name, labels in outputs.items():
        assert np.array_equal(labels, kits), (name, float(np.mean(labels == kits)))
        dice = {k: v for k, v in vars(results[name]).items() if "dice" in k}
        assert dice and dice == {k: v for k, v in vars(results["IPL"]).items() if "dice" in k}, name


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "tiny.pt")
    write_checkpoint(path, architecture(TINY), seed=1)
    return path


predict = predict_runner("--val_input_shape", "128", "128", "128")


def test_predict_command_line_with_a_tiny_network(tmp_path, tiny_checkpoint, capsys):
    """``main.py --exec_mode predict`` with a tiny random U-Net over a folder of the same scan in
    KiTS19, RAS (dcm2niix's, nnU-Net's) and LPS layouts: the same labels everywhere once
    nibabel maps them back, and each summary row has its file's own shape and spacing."""
    folder = tmp_path / "in"
    folder.mkdir()
    variants = VARIANTS[:3]
    for codes in variants:
        nibabel.save(to_codes(kits_image(), codes), str(folder / f"{''.join(codes)}.nii.gz"))
    code, stdout, stderr = predict(capsys, folder, tmp_path / "out", tiny_checkpoint)
    assert code == 0, stderr
    labels = {c: kits_labels(str(tmp_path / "out" / f"{''.join(c)}.nii.gz")) for c in variants}
    kits = labels[variants[0]]
    assert len(np.unique(kits)) >= 2
    for codes, got in labels.items():
        assert np.array_equal(got, kits), (codes, float(np.mean(got == kits)))
    rows = {r["case"]: r for r in map(json.loads, open(tmp_path / "out" / "summary.jsonl"))}
    for codes in variants:
        source = nibabel.load(str(folder / f"{''.join(codes)}.nii.gz"))
        assert rows["".join(codes)]["shape"] == list(source.shape)
        assert rows["".join(codes)]["spacing"] == pytest.approx([float(z) for z in source.header.get_zooms()])


def test_simpleitk_dicomorient_variants(tmp_path):
    """Variants made by SimpleITK (``DICOMOrient``, written by ITK's NIfTI writer): each
    segmentation has its variant's shape and affine and is the KiTS19-layout one once nibabel
    maps it back."""
    sitk = pytest.importorskip("SimpleITK")
    infer = random_conv_infer()
    nibabel.save(kits_image(), str(tmp_path / "kits.nii.gz"))
    os.makedirs(tmp_path / "out")
    source = sitk.ReadImage(str(tmp_path / "kits.nii.gz"))
    segment_scan(Scan("kits", str(tmp_path / "kits.nii.gz")), segmenter(infer), str(tmp_path / "out"))
    kits = kits_labels(str(tmp_path / "out" / "kits.nii.gz"))
    for itk_codes in ("LPS", "RAS", "AIL", "SRP"):  # ITK's codes name where each axis comes from
        path = str(tmp_path / "in" / f"itk_{itk_codes}.nii.gz")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        sitk.WriteImage(sitk.DICOMOrient(source, itk_codes), path)
        segment_scan(Scan(f"itk_{itk_codes}", path), segmenter(infer), str(tmp_path / "out"))
        variant, written = nibabel.load(path), nibabel.load(str(tmp_path / "out" / f"itk_{itk_codes}.nii.gz"))
        assert written.shape == variant.shape and np.allclose(written.affine, variant.affine)
        got = kits_labels(str(tmp_path / "out" / f"itk_{itk_codes}.nii.gz"))
        assert np.array_equal(got, kits), (itk_codes, float(np.mean(got == kits)))


# ----------------------------------------------------------------------------- unreadable affines


def unusable(kind):
    image = kits_image()
    header = image.header
    if kind == "no_form":
        header.set_sform(None, code=0)
        header.set_qform(None, code=0)
    elif kind == "sheared_sform":
        sheared = image.affine.copy()
        sheared[:3, 0] += 0.2 * sheared[:3, 1]  # slices tilted against the rows
        header.set_sform(sheared, code=1)
    elif kind == "singular_sform_no_qform":
        header.set_sform(np.zeros((4, 4)), code=1)
        header.set_qform(None, code=0)
    elif kind == "nan_sform_no_qform":
        nan = image.affine.copy()
        nan[0, 0] = np.nan
        header.set_sform(nan, code=1)
        header.set_qform(None, code=0)
    return nibabel.Nifti1Image(np.asarray(image.dataobj), None, header)


@pytest.mark.parametrize("kind", ["sheared_sform", "singular_sform_no_qform", "nan_sform_no_qform"])
def test_an_affine_that_cannot_be_read_is_one_line(tmp_path, tiny_checkpoint, capsys, monkeypatch, kind):
    """No usable sform or qform (a code that is not 0 over a broken matrix), or a sheared sform:
    one line naming the file, exit code 1, refused with the header check before any voxel is
    read. (Both codes 0 is read as nibabel reads it: tests/test_predict_entries.py.)"""
    import runtime.predict.folder as folder_module

    monkeypatch.setattr(folder_module, "segment_scan", lambda *a, **k: pytest.fail("voxels read"))
    path = str(tmp_path / "bad.nii.gz")
    nibabel.save(unusable(kind), path)
    code, stdout, stderr = predict(capsys, path, tmp_path / "out", tiny_checkpoint)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert path in lines[0] and "orientation cannot be read" in lines[0], lines
    assert "failed scans: bad" in stdout and not os.path.exists(tmp_path / "out" / "bad.nii.gz")
    with pytest.raises(ScanError, match="orientation cannot be read"):  # and when read all the same
        read_scan(path)


def test_an_unusable_sform_falls_back_to_the_qform(tmp_path):
    """sform code 1 with a zero matrix, qform in RAS: the qform orients the scan."""
    image = to_codes(kits_image(), ("R", "A", "S"))
    image.header.set_qform(image.affine, code=1)
    image.header.set_sform(np.zeros((4, 4)), code=1)
    path = str(tmp_path / "scan.nii.gz")
    nibabel.save(nibabel.Nifti1Image(np.asarray(image.dataobj), None, image.header), path)
    reference = str(tmp_path / "kits.nii.gz")
    nibabel.save(kits_image(), reference)
    raw = read_scan(path)
    assert raw.orientation.codes == ("R", "A", "S") and np.array_equal(raw.image, read_scan(reference).image)


# ----------------------------------------------------------------------------- --preview


def test_preview_is_drawn_from_the_kits_layout(tmp_path, monkeypatch):
    """--preview of an RAS scan gets the KiTS19-layout volume, labels, ground truth and spacing,
    so its axial view is a true axial slice (of the array axis 0 there), not the file's
    axis-0 (sagittal) one."""
    import runtime.predict.preview as preview

    drawn = {}
    monkeypatch.setattr(preview, "write_preview", lambda path, image, labels, truth, title, spacing=None:
                        drawn.update(image=image, labels=labels, truth=truth, spacing=spacing))
    infer = random_conv_infer()
    kits = case_variant(tmp_path / "raw", "kits", ("I", "P", "L"))
    segment_scan(kits, segmenter(infer), str(tmp_path))
    scan = case_variant(tmp_path / "raw", "ras", ("R", "A", "S"))
    segment_scan(scan, segmenter(infer), str(tmp_path), preview=True)
    assert np.array_equal(drawn["image"], read_scan(kits.image_path).image[0])
    assert np.array_equal(drawn["truth"], np.asarray(nibabel.load(kits.label_path).dataobj))
    assert np.array_equal(drawn["labels"], np.asarray(nibabel.load(str(tmp_path / "kits.nii.gz")).dataobj))
    assert list(drawn["spacing"]) == read_scan(kits.image_path).spacing


def test_preview_views_and_aspect(tmp_path):
    """The three views cut the KiTS19-layout axes 0, 1 and 2 through the largest tumour area of
    each, with the voxels' aspect; the PNG is written."""
    pytest.importorskip("matplotlib")
    from runtime.predict.preview import aspect, preview_slice, view, write_preview

    labels = np.zeros((6, 8, 10), np.uint8)
    labels[4, 2, 1:9] = 2
    labels[1:5, 2, 7] = 2
    assert [preview_slice(labels, axis) for axis in range(3)] == [4, 2, 7]
    volume = np.arange(6 * 8 * 10).reshape(6, 8, 10)
    assert np.array_equal(view(volume, 0, 4), volume[4]) and view(volume, 1, 2).shape == (6, 10)
    assert np.array_equal(view(volume, 2, 7), volume[:, :, 7])
    assert aspect((2.5, 0.75, 1.25), 0) == pytest.approx(0.6) and aspect((2.5, 0.75, 1.25), 2) == pytest.approx(2.5 / 0.75)
    path = str(tmp_path / "p.png")
    write_preview(path, volume.astype(np.float32), labels, labels, "case", (2.5, 0.75, 1.25))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_preprocessing_of_a_moved_scan_is_the_kits_ones(tmp_path):
    """The preprocessed network input of an LPS file equals the KiTS19 file's bit for bit."""
    nibabel.save(kits_image(), str(tmp_path / "kits.nii.gz"))
    nibabel.save(to_codes(kits_image(), ("L", "P", "S")), str(tmp_path / "lps.nii.gz"))
    a, ga = preprocess_scan(read_scan(str(tmp_path / "kits.nii.gz")))
    b, gb = preprocess_scan(read_scan(str(tmp_path / "lps.nii.gz")))
    assert ga == gb and np.array_equal(a, b)

"""The run's target spacing (runtime.spacing): recorded in the plan and the checkpoint from the
preprocessed folder's dataset.json, so that predict resamples a raw scan to the spacing the
network was trained at, and evaluate refuses a checkpoint trained at another one."""
import os
import types

import nibabel
import numpy as np
import pytest
import torch

from checkpoints import architecture, checkpoint_dict
from data_loading import synthetic
from runtime import spacing as S

OWN = (4.0, 3.0, 3.0)
CPU_KW = dict(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_the_spacing_is_the_checkpoints_then_the_datas():
    assert S.decide_spacing(None, None)[0] == S.KITS19_SPACING == (1.6, 1.2, 1.2)
    assert S.decide_spacing(OWN, None, "c.pt") == (OWN, "the checkpoint c.pt's")
    assert S.decide_spacing(OWN, [4, 3, 3], "c.pt", "d/dataset.json")[0] == OWN
    assert S.decide_spacing(None, OWN, "", "d/dataset.json")[0] == OWN
    with pytest.raises(S.SpacingError) as info:  # evaluate: refused in one line naming both
        S.decide_spacing(S.KITS19_SPACING, OWN, "c.pt", "d/dataset.json")
    text = str(info.value)
    assert "\n" not in text and "c.pt" in text and "1.6 x 1.2 x 1.2 mm" in text and "4 x 3 x 3 mm" in text
    spacing, why = S.decide_spacing(S.KITS19_SPACING, OWN, "c.pt", "d/dataset.json", trains=True)
    assert spacing == OWN and "c.pt" in why  # training learns at the data's spacing


def with_spacing(checkpoint: dict, spacing) -> dict:
    checkpoint["config"]["plan"] = [d for d in checkpoint["config"].get("plan") or [] if d.get("name") != "target_spacing"]
    checkpoint["config"]["plan"].append({"name": "target_spacing", "value": list(spacing)})
    return checkpoint


def test_the_plan_and_the_checkpoint_carry_the_datas_spacing(tmp_path):
    """resolve: the data's (its description's, read before run_start; KiTS19's for a folder
    without one), saved with the plan (a checkpoint written from it reads it back); predict: the
    checkpoint's (KiTS19's for one without it); evaluate with a checkpoint at another spacing: a
    one-line UsageError."""
    from data_loading import description as ds
    from main_runs import TINY
    from runtime.arguments import UsageError, parse_args
    from runtime.checkpoint import Saved, trained_network
    from runtime.distributed import DistInfo
    from runtime.plan import saved_values
    from runtime.resolve import resolve

    cpu = DistInfo(**CPU_KW)
    described = ds.parse_description({"labels": {"background": 0, "organ": 1}, "target_spacing": list(OWN)},
                                     "d/dataset.json")
    config = parse_args(TINY)
    assert resolve(config, cpu).network.target_spacing == S.KITS19_SPACING
    plan = resolve(config, cpu, dataset=described)
    assert plan.network.target_spacing == OWN and "d/dataset.json" in plan.why("target_spacing")
    saved = Saved("s.pt", {"config": saved_values(plan)}, resume=False)
    assert trained_network(saved).target_spacing == OWN
    old = Saved("o.pt", checkpoint_dict(architecture((4, 8, 16, 32, 32))), resume=False)
    assert trained_network(old).target_spacing == S.KITS19_SPACING  # written before: KiTS19's

    ckpt = str(tmp_path / "c.pt")
    open(ckpt, "wb").close()
    evaluate = parse_args([*TINY, "--exec_mode", "evaluate", "--load_ckpt_path", ckpt])
    kits = checkpoint_dict(config)
    kits["config"]["plan"] = [{"name": "labels", "value": [["background", 0], ["organ", 1]]}]
    with pytest.raises(UsageError) as info:
        resolve(evaluate, cpu, None, Saved("c.pt", kits, resume=False), dataset=described)
    assert "\n" not in str(info.value) and "c.pt" in str(info.value) and "4 x 3 x 3 mm" in str(info.value)
    plan = resolve(evaluate, cpu, None, Saved("c.pt", with_spacing(kits, OWN), resume=False), dataset=described)
    assert plan.network.target_spacing == OWN


@pytest.mark.parametrize("recorded", [None, OWN])
def test_predict_resamples_to_the_checkpoints_spacing(tmp_path, monkeypatch, recorded):
    """A raw scan is resampled to the spacing the checkpoint records (KiTS19's for one that
    records none): voxel size / target * shape, per axis, from nibabel's header."""
    from runtime.predict import scan as predict_scan
    from runtime.predict.api import PredictOptions, Segmenter

    checkpoint = checkpoint_dict(architecture((4, 8, 16, 32, 32)))
    if recorded is not None:
        with_spacing(checkpoint, recorded)
    path = str(tmp_path / "c.pt")
    torch.save(checkpoint, path)
    voxel = (2.0, 1.5, 1.5)
    affine = synthetic.kits_affine(voxel)
    image = nibabel.Nifti1Image(np.full((20, 24, 22), 40, np.int16), affine)
    image.header.set_zooms(voxel)
    image.header.set_qform(affine, code=1)
    image.header.set_sform(affine, code=1)
    scan = str(tmp_path / "scan.nii.gz")
    nibabel.save(image, scan)

    seen = []
    real = predict_scan.preprocess_scan

    class Seen(Exception):
        pass

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs)[1])
        raise Seen  # the geometry is what is checked: no inference needed

    monkeypatch.setattr(predict_scan, "preprocess_scan", spy)
    segmenter = Segmenter.from_checkpoint(path, PredictOptions(device="cpu", window=(32, 32, 32), verbose=False))
    with pytest.raises(Seen):
        segmenter.segment_file(scan)
    loaded = nibabel.load(scan)
    target = S.KITS19_SPACING if recorded is None else recorded
    # the MLCommons reference's new shape: (spacing / target_spacing * shape).astype(int), in that order
    expected = tuple(int(float(z) / t * n) for n, z, t in zip(loaded.shape, loaded.header.get_zooms(), target))
    assert seen[0].original == (20, 24, 22) and seen[0].resampled == expected
    assert expected == ((25, 30, 27) if recorded is None else (10, 12, 11))


def test_the_folders_description_has_its_spacing(tmp_path):
    """The preprocessed folder's description carries the spacing its dataset.json records
    (None without a description: KiTS19's folder)."""
    import json

    from data_loading import description as ds
    from data_loading.data_loader import PreprocessedData
    from test_labels import KITS23, write_preprocessed

    folder = write_preprocessed(tmp_path / "own", KITS23)
    path = os.path.join(folder, ds.DESCRIPTION_FILE)
    with open(path) as handle:
        record = json.load(handle)
    record["target_spacing"] = list(OWN)
    with open(path, "w") as handle:
        json.dump(record, handle)
    assert PreprocessedData(folder).description().target_spacing == OWN
    os.remove(path)
    assert PreprocessedData(folder).description() is None

"""CPU predict through its command line, per backend, lock-step against the real MLCommons code.

``main.py --exec_mode predict`` per variant and round on the same scans (``--input``, else one synthetic KiTS-size
scan; weights: ``--ckpt``, else random): ``torch_fp32``, ``openvino_fp32``, ``openvino_int8`` against ``mlcommons``
(the MLCommons network and window from ``--reference_code``, fp32, one window per forward, in predict's scan loop);
times from predict's own summary, OpenVINO's conversion apart."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import (checked_variants, header, lockstep, loads, parse_with_reference, ratios, report,
                                run_child, table)

VARIANTS = {"mlcommons": ["--backend", "torch", "--sw_batch_size", "1"],
            "torch_fp32": ["--backend", "torch", "--channels_last"],
            "openvino_fp32": ["--backend", "openvino"],
            "openvino_int8": ["--backend", "openvino", "--int8"]}


def run_mlcommons_child(code_dir: str, flags: list[str]) -> int:
    """The ``mlcommons`` process: predict's scan loop with the reference's network and window as
    its predict function (``windows``: those the reference's network ran on)."""
    from runtime import checkpoint as ckpt
    from runtime.arguments import parse_args
    from runtime.distributed import DistInfo
    from runtime.predict import api, body, folder, records
    from runtime.resolve import resolve
    from oracles.mlcommons_reference import reference_infer

    config = parse_args(flags)
    saved = ckpt.saved_for(config)
    plan = resolve(config, DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")), None, saved)
    infer = reference_infer(code_dir, ckpt.model_state_from(saved.checkpoint), plan.network, plan.inference)
    os.makedirs(config.output_dir, exist_ok=True)
    results = folder.predict_cases(body.predict_source(config, None), api.Segmenter.from_inference(infer, plan), plan,
                                   False)
    return records.print_outcome(results, config.output_dir, records.save_summary(config.output_dir, results))


def make_inputs(args, work: Path) -> tuple[str, str]:
    """``(scans, checkpoint)``: given, or written into ``work``."""
    from data_loading import synthetic
    from model.unet3d import Unet3D

    scans, ckpt = args.input or str(work / "raw"), args.ckpt or str(work / "random.pt")
    if not os.path.isdir(scans):  # a labelled KiTS-like case (id 1) that preprocesses to about --resampled
        spacing = tuple(round(t * r / s, 3) for t, r, s in zip(synthetic.TARGET_SPACING, args.resampled, args.shape))
        synthetic.save_case(synthetic.make_case(1, args.shape, spacing, synthetic.case_rng(0, 1)), scans, labelled=True)
    if not os.path.exists(ckpt):
        torch.manual_seed(0)
        torch.save({"best_model_state_dict": Unet3D(filters=args.filters).state_dict(),
                    "config": {"filters": args.filters, "normalization": "instancenorm", "activation": "relu"}}, ckpt)
    return scans, ckpt


def summary_of(out: str) -> dict:
    """Predict's own record of a run: seconds (all, inferring, other stages) and windows summed, mean Dice."""
    from runtime.predict.records import STAGES

    rows = [json.loads(line) for line in open(os.path.join(out, "summary.jsonl"))]
    cases = [r for r in rows if r["case"] not in ("mean", "count")]
    dice = [r["mean_dice"] for r in cases if r.get("mean_dice") is not None]
    stages = {s: sum(r.get(f"{s}_seconds") or 0 for r in cases) for s in STAGES}
    return {"seconds": sum(r["seconds"] for r in cases), "windows": sum(r.get("windows") or 0 for r in cases),
            "infer": stages["infer"], "rest": sum(stages.values()) - stages["infer"],
            "cases": [r["case"] for r in cases], "mean_dice": statistics.mean(dice) if dice else None}


def agreement(out: str, base: str, cases: list[str]) -> float:
    """The share of the kidney-or-tumour voxels of ``out`` or ``base`` labelled alike (the one metric)."""
    import nibabel

    from model.losses import foreground_agreement
    counts = [foreground_agreement(*(np.asarray(nibabel.load(os.path.join(o, f"{c}.nii.gz")).dataobj)
                                     for o in (out, base))) for c in cases]
    return sum(e for e, _ in counts) / max(1, sum(t for _, t in counts))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="", help=f"comma list of {list(VARIANTS)} (default: all)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input", default="", help="scans to segment (default: one synthetic KiTS-size scan)")
    p.add_argument("--shape", type=int, nargs=3, default=[300, 512, 512], help="raw synthetic scan D H W")
    p.add_argument("--resampled", type=int, nargs=3, default=[190, 250, 250], help="its size after preprocessing")
    p.add_argument("--ckpt", default="", help="checkpoint (default: random weights of --filters)")
    p.add_argument("--filters", type=int, nargs=5, default=[32, 64, 128, 256, 320])
    p.add_argument("--roi", type=int, default=128)
    p.add_argument("--workdir", default="", help="scans, outputs, caches (default: a temporary folder)")
    p.add_argument("--out", default="", help="also write the markdown report here")
    args = parse_with_reference(p, argv, run_mlcommons_child)
    names, args.reference_code = checked_variants(
        "bench_predict", args.variants or ",".join(n for n in VARIANTS if n != "mlcommons" or args.reference_code),
        VARIANTS, args.reference_code)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_predict_"))
    work.mkdir(parents=True, exist_ok=True)
    scans, ckpt = make_inputs(args, work)
    print(header("bench_predict", argv), flush=True)

    def command(name: str, r) -> list[str]:
        flags = ["--exec_mode", "predict", "--input", scans, "--output_dir", str(work / f"{name}-{r}"),
                 "--load_ckpt_path", ckpt, "--device", "cpu", "--force", "--val_input_shape", *[str(args.roi)] * 3,
                 *VARIANTS[name]]
        if name.startswith("openvino"):  # its converted networks in the work folder, not the user's cache
            flags += ["--cache_dir", str(work / "cache")]
        if name == "mlcommons":
            return [sys.executable, "-m", "benchmarks.bench_predict", "--child_mlcommons", args.reference_code, *flags]
        return [sys.executable, "main.py", *flags]

    setup = {}
    for name in [n for n in names if n.startswith("openvino")]:  # conversion and calibration into the cache
        wall, rss, code, _ = run_child(command(name, "setup"), work / f"{name}-setup.log")
        if code:
            raise SystemExit(f"bench_predict: {name} failed, see {work / f'{name}-setup.log'}")
        setup[name] = wall - summary_of(str(work / f"{name}-setup"))["seconds"]
    runs = lockstep(names, command, args.rounds, work,
                    measure=lambda name, r, text: summary_of(str(work / f"{name}-{r}"))["seconds"])
    base = names[0]
    speed = ratios({n: [run.value for run in rs] for n, rs in runs.items()}, base)
    stage = {n: [summary_of(str(work / f"{n}-{r}")) for r in range(args.rounds)] for n in names}
    first = {n: stage[n][0] for n in names}
    rows = [[n, f"`{' '.join(VARIANTS[n])}`" if n != "mlcommons" else "the MLCommons code, fp32",
             first[n]["windows"], statistics.median(r.value for r in runs[n]), f"{speed[n]:.2f}x",
             statistics.median(r.wall for r in runs[n]), max(r.rss_gb for r in runs[n]),
             f"{100 * agreement(str(work / f'{n}-0'), str(work / f'{base}-0'), first[base]['cases']):.3f}%",
             None if first[n]["mean_dice"] is None else f"{first[n]['mean_dice']:.4f}",
             statistics.median(x["infer"] for x in stage[n]), statistics.median(x["rest"] for x in stage[n])]
            for n in names]
    text = "\n".join([
        f"scans {scans}, windows of {args.roi}³ · weights {args.ckpt or 'random'} · {args.rounds} lock-step rounds · "
        + loads(runs), "",
        table(["variant", "flags", "windows", "median s (scans, predict's summary)", f"vs {base} (median of rounds)",
               "median s (process)", "peak RSS GB", f"kidney+tumour voxels = {base}", "mean Dice vs label",
               "median s inferring", "median s other stages (read, preprocess, restore, write, preview)"], rows), "",
        "conversion before the rounds (s, cached): " + (", ".join(f"{n} {s:.1f}" for n, s in setup.items()) or "none")])
    report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

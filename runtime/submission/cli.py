"""An MLPerf Training submission of unet3d, from the runs to the checked package.

    DATASET_DIR=DATA python -m runtime.submission runs --output RUNS [--recipe gbs28] [--runs 40] [--slurm]
        [-- main.py flags...]
    python -m runtime.submission package RUNS --output PACKAGE [--system_fields FILE.json]
    python -m runtime.submission describe --output FILE.json

Exit codes: 0 done (``package``: the official package checker accepted the package, and it has a
score), 1 bad input (one line naming the path or value), 2 a bad flag, 4 ``runs``: some run exited
non-zero / ``package``: written, but an official checker rejected it (the report says which and
why), 5 ``package``: accepted, but no score (too many failed or not converged runs, or too few).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Sequence

from data_loading.write_errors import failure_reason
from runtime import __version__

CHECKER_REJECTED = 4
ACCEPTED_NO_SCORE = 5


def _error(message: str) -> int:
    print(f"submission: {str(message).splitlines()[0] if str(message) else 'error'}", file=sys.stderr)
    return 1


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m runtime.submission", description=__doc__.split("\n\n")[0])
    top.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = top.add_subparsers(dest="command", required=True)

    runs = sub.add_parser("runs", help="N timed runs, each in a folder of its own with a seed of its own",
                          description="N timed runs in RUNS/run_00 .. run_<N-1>, each with its own seed; flags "
                                      "after -- go to every run's main.py (after run_and_time.sh's own)")
    runs.add_argument("--output", required=True, help="the sweep's folder (RUNS)")
    runs.add_argument("--runs", type=int, default=40, help="how many runs (unet3d's submission: 40)")
    runs.add_argument("--first_seed", type=int, default=None,
                      help="seeds first_seed, first_seed+1, ... (default: each drawn from the OS); open division "
                           "only (-- --submission_division open): closed seeds come from the OS or the clock")
    runs.add_argument("--recipe", default="",
                      help="scripts/recipes/RECIPE.sh for every run (RECIPE=... to run_and_time.sh or the job): "
                           "gbs28, gbs56, gbs64, gbs84 (the MLPerf 4.0.0 RCPs'), gbs2 (the reference's 1-GPU run)")
    runs.add_argument("--launcher", choices=["run_and_time", "main"], default="run_and_time",
                      help="run_and_time: ./run_and_time.sh SEED with RESULTS_DIR set (the reference's timed "
                           "run); main: python main.py --seed SEED --log_dir FOLDER")
    runs.add_argument("--slurm", action="store_true",
                      help="submit one job per run (sbatch --export ALL,SEED=..,RESULTS_DIR=..) instead")
    runs.add_argument("--job_script", default="", help="the job of --slurm (default scripts/slurm/single_node.sbatch)")
    runs.add_argument("--sbatch_args", default="", help="more sbatch options, as one string")
    runs.add_argument("--dry_run", action="store_true", help="print each run's command, run nothing")
    runs.add_argument("flags", nargs=argparse.REMAINDER, help="-- then main.py flags for every run")

    package = sub.add_parser("package", help="assemble the MLPerf package from run folders and run the official "
                                             "package, RCP and seed checkers on it")
    package.add_argument("runs", nargs="+", metavar="RUNS", help="run folders, or folders of them (a sweep)")
    package.add_argument("--output", required=True, help="a new (or empty) folder for the package and report.md")
    package.add_argument("--system_fields", default="",
                         help="a JSON object of system description fields to set (those the machine cannot tell; "
                              "a local `runs` sweep writes RUNS/system-fields.json to start from)")
    package.add_argument("--nodes", type=int, default=None,
                         help="number_of_nodes of the system description: the runs' records tell it (a different "
                              "value is refused); 1 with --system_from_packing_host")
    package.add_argument("--system_from_packing_host", action="store_true",
                         help="runs made before runs recorded their machines (no run_description.json): describe "
                              "the system from the machine running this command instead, and say so in the package")
    package.add_argument("--expected_runs", type=int, default=40,
                         help="result files the package holds (the package checker wants 40 for unet3d)")
    package.add_argument("--no_check", action="store_true", help="assemble only; run no checker")
    package.add_argument("--no_code", action="store_true",
                         help="leave the code out of benchmarks/ (and the checks that the runs' code can be packed)")

    describe = sub.add_parser("describe", help="this machine's system description fields, as JSON")
    describe.add_argument("--output", default="-", help="file to write (default: print)")
    return top


def _flags(remainder: Sequence[str]) -> list[str]:
    return list(remainder[1:] if remainder[:1] == ["--"] else remainder)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "runs":
        from runtime.submission.driver import DriverError, run_sweep

        try:
            return run_sweep(args.output, args.runs, _flags(args.flags), args.launcher, args.first_seed, args.slurm,
                             args.job_script, shlex.split(args.sbatch_args), args.dry_run, recipe=args.recipe)
        except (DriverError, OSError) as error:
            return _error(error)
    if args.command == "describe":
        from runtime.submission.system import describe

        fields = describe("", "", "", "")
        for key in ("submitter", "system_name", "division", "status"):
            fields.pop(key)
        text = json.dumps(fields, indent=2) + "\n"
        if args.output == "-":
            print(text, end="")
        else:
            try:
                with open(args.output, "x", encoding="utf-8") as handle:
                    handle.write(text)
            except OSError as error:
                return _error(f"cannot write {args.output}: {failure_reason(error)}")
        return 0
    from runtime.submission.package import PackageError, assemble

    system_fields = {}
    if args.system_fields:
        try:
            with open(args.system_fields, encoding="utf-8") as handle:
                system_fields = json.load(handle)
        except (OSError, ValueError) as error:
            return _error(f"--system_fields {args.system_fields}: {getattr(error, 'strerror', None) or error}")
        if not isinstance(system_fields, dict):
            return _error(f"--system_fields {args.system_fields}: not a JSON object")
    if (args.nodes is not None and args.nodes < 1) or args.expected_runs < 1:
        return _error("--nodes and --expected_runs must be at least 1")
    missing = [p for p in args.runs if not os.path.isdir(p)]
    if missing:
        return _error(f"{missing[0]}: no such folder")
    try:
        report = assemble(args.runs, args.output, expected=args.expected_runs, system_fields=system_fields,
                          nodes=args.nodes, check=not args.no_check, code=not args.no_code,
                          packing_host=args.system_from_packing_host)
    except (PackageError, OSError) as error:
        return _error(error)
    from runtime.submission.package import report_markdown

    print(report_markdown(report), end="")
    print(f"report: {os.path.join(report['output'], 'report.md')}")
    if args.no_check:
        return 0
    if not all(v["passed"] for k, v in report["checkers"].items() if k == "package_checker"):
        return CHECKER_REJECTED
    return ACCEPTED_NO_SCORE if report["score_minutes"] is None else 0

"""The named recipes (scripts/recipes/*.sh) against the RCP file of the installed mlperf-logging
(the oracle: its hyper-parameters per global batch; training_4.0.0 counts warm-up in samples,
training_3.1.0 the same warm-ups in epochs), and what RECIPE makes run_and_time.sh and the SLURM
jobs pass to main.py (dry runs, and a fake interpreter for what reaches the training process)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

import mlperf_logging

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "scripts" / "recipes"
RUN_AND_TIME = ROOT / "run_and_time.sh"
SINGLE_NODE = ROOT / "scripts" / "slurm" / "single_node.sbatch"
MULTI_NODE = ROOT / "scripts" / "slurm" / "multi_node.sbatch"
RCP_DIR = Path(mlperf_logging.__file__).parent / "rcp_checker"
SETTINGS = ("RECIPE_RCP", "GLOBAL_BATCH_SIZE", "OPTIMIZER", "LEARNING_RATE", "INIT_LEARNING_RATE",
            "LR_WARMUP_EPOCHS", "LR_DECAY_EPOCHS", "LR_DECAY_FACTOR", "MOMENTUM", "WEIGHT_DECAY")
KITS19_TRAIN_CASES = 168


def rcps(ruleset: str) -> dict:
    return json.loads((RCP_DIR / f"training_{ruleset}" / "rcps_unet3d.json").read_text())


def recipe(name: str) -> dict[str, str]:
    """The recipe file's settings, as bash sees them after sourcing it alone."""
    script = 'source "$1"; for v in ' + " ".join(SETTINGS) + '; do printf "%s=%s\\n" "$v" "${!v-}"; done'
    out = subprocess.run(["bash", "-c", script, "_", str(RECIPES / f"{name}.sh")], env={"PATH": os.environ["PATH"]},
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def as_hyperparams(settings: dict[str, str], samples_per_epoch: int) -> dict:
    """A recipe's settings in the RCP file's keys and units (warm-up and decay boundaries in
    samples when ``samples_per_epoch`` is 168, in epochs when it is 1)."""
    return {"opt_base_learning_rate": float(settings["LEARNING_RATE"]),
            "opt_momentum": float(settings["MOMENTUM"]),
            "opt_learning_rate_warmup_epochs": int(settings["LR_WARMUP_EPOCHS"]) * samples_per_epoch,
            "opt_initial_learning_rate": float(settings["INIT_LEARNING_RATE"]),
            "opt_learning_rate_decay_boundary_epochs": [int(e) * samples_per_epoch
                                                        for e in settings["LR_DECAY_EPOCHS"].split()],
            "opt_learning_rate_decay_factor": float(settings["LR_DECAY_FACTOR"]),
            "opt_weight_decay": float(settings["WEIGHT_DECAY"])}


def test_every_4_0_0_rcp_has_a_recipe_with_its_hyperparameters():
    official = rcps("4.0.0")
    with_rcp = {name: s for name, s in ((p.stem, recipe(p.stem)) for p in RECIPES.glob("*.sh"))
                if s["RECIPE_RCP"] != "none"}
    assert sorted(int(s["GLOBAL_BATCH_SIZE"]) for s in with_rcp.values()) == sorted(r["BS"] for r in official.values())
    for name, settings in with_rcp.items():
        record = official[settings["RECIPE_RCP"]]
        assert name == f"gbs{record['BS']}" and int(settings["GLOBAL_BATCH_SIZE"]) == record["BS"]
        assert settings["OPTIMIZER"] == "sgd"
        # every hyper-parameter the RCP names, none more and none fewer
        assert as_hyperparams(settings, KITS19_TRAIN_CASES) == record["Hyperparams"], name


def test_the_4_0_0_warmups_are_samples_of_168_per_epoch():
    """The unit of the conversion above, from the package itself: the same RCPs in 3.1.0 give
    their warm-up in epochs, 4.0.0 in samples, a factor of KiTS19's 168 training cases."""
    old = {r["BS"]: r["Hyperparams"] for r in rcps("3.1.0").values()}
    new = {r["BS"]: r["Hyperparams"] for r in rcps("4.0.0").values()}
    shared = sorted(set(old) & set(new))
    assert shared == [56, 64, 84]
    for batch in shared:
        assert new[batch]["opt_learning_rate_warmup_epochs"] == old[batch]["opt_learning_rate_warmup_epochs"] * 168


def test_the_reference_1_gpu_recipe_is_named_as_having_no_4_0_0_rcp():
    settings = recipe("gbs2")
    assert settings["RECIPE_RCP"] == "none" and settings["GLOBAL_BATCH_SIZE"] == "2"
    assert 2 not in {r["BS"] for r in rcps("4.0.0").values()}
    assert "NO MLPerf 4.0.0 RCP" in (RECIPES / "gbs2.sh").read_text()
    # the values are those of the RCP at global batch 2 that the older rulesets had (in epochs)
    (old,) = [r for r in rcps("3.1.0").values() if r["BS"] == 2]
    assert as_hyperparams(settings, 1) == old["Hyperparams"]


# --------------------------------------------------------------------------- the scripts

def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "USER": "tester",
           "SLURM_JOB_ID": "4242", "CONTAINER": "", "DATA_DIR": str(tmp_path / "data"),
           "DATASET_DIR": str(tmp_path / "data"), "RESULTS_DIR": str(tmp_path / "results"), "PYTHON": "python3"}
    (tmp_path / "data").mkdir(exist_ok=True)
    env.update(extra)
    return env


def run(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], env=env, cwd=env["HOME"], capture_output=True, text=True,
                          timeout=60)


def main_flags(stdout: str) -> list[str]:
    (line,) = [shlex.split(line) for line in stdout.splitlines() if str(ROOT / "main.py") in line]
    return line[line.index(str(ROOT / "main.py")) + 1:]


def option(flags: list[str], name: str) -> str:
    assert flags.count(name) == 1, (name, flags)
    return flags[flags.index(name) + 1]


@pytest.mark.parametrize("script, name, env, batch", [
    (RUN_AND_TIME, "gbs28", {"NPROC_PER_NODE": "4"}, 7),
    (RUN_AND_TIME, "gbs56", {"NPROC_PER_NODE": "2", "GA_STEPS": "4"}, 7),
    (SINGLE_NODE, "gbs64", {"GPUS_PER_NODE": "8"}, 8),
    (MULTI_NODE, "gbs84", {"GPUS_PER_NODE": "6", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "a,b",
                           "RDZV_PORT": "1", "RDZV_HOST": "a"}, 7),
    (RUN_AND_TIME, "gbs2", {}, 2),
])
def test_recipe_selects_the_flags_and_the_batch_per_process(tmp_path, script, name, env, batch):
    if script == MULTI_NODE:  # the job asks scontrol for its hosts
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'a\\nb\\n'\n")
        (bin_dir / "scontrol").chmod(0o755)
        env = {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = run(script, clean_env(tmp_path, DRY_RUN="1", RECIPE=name, **env), "7")
    assert proc.returncode == 0, proc.stderr
    flags = main_flags(proc.stdout)
    settings = recipe(name)
    assert option(flags, "--learning_rate") == settings["LEARNING_RATE"]
    assert option(flags, "--lr_warmup_epochs") == settings["LR_WARMUP_EPOCHS"]
    assert option(flags, "--init_learning_rate") == settings["INIT_LEARNING_RATE"]
    assert option(flags, "--momentum") == settings["MOMENTUM"] and option(flags, "--weight_decay") == "0.0"
    assert option(flags, "--batch_size") == str(batch) and option(flags, "--ga_steps") == env.get("GA_STEPS", "1")
    processes = int(env.get("NPROC_PER_NODE", env.get("GPUS_PER_NODE", "1"))) * int(env.get("SLURM_NNODES", "1"))
    assert batch * processes * int(env.get("GA_STEPS", "1")) == int(settings["GLOBAL_BATCH_SIZE"])
    assert option(flags, "--epochs") == "auto" and "--start_eval_at" not in flags and "--evaluate_every" not in flags
    assert "no MLPerf 4.0.0 RCP" not in proc.stderr


@pytest.mark.parametrize("env, args, message", [
    ({"RECIPE": "gbs28", "NPROC_PER_NODE": "3"}, (), "global batch 28 does not divide into 3 process(es)"),
    ({"RECIPE": "gbs64", "NPROC_PER_NODE": "4", "GA_STEPS": "32"}, (), "global batch 64 does not divide"),
    ({"RECIPE": "gbs84", "BATCH_SIZE": "2"}, (), "BATCH_SIZE=2, but global batch 84"),
    ({"RECIPE": "gbs56"}, ("--batch_size", "3"), "--batch_size 3 is not the derived 56; give the gradient accumulation"),
    ({"RECIPE": "gbs56"}, ("--ga_steps=2",), "--ga_steps 2 is not the derived 1"),
    ({"RECIPE": "gbs99"}, (), "RECIPE=gbs99: no such recipe"),
])
def test_a_recipe_that_cannot_run_is_refused_in_one_line_before_anything(tmp_path, env, args, message):
    proc = run(RUN_AND_TIME, clean_env(tmp_path, DRY_RUN="1", **env), "7", *args)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_a_recipe_takes_its_own_derived_batch_flags_back(tmp_path):
    """A packed launch script repeats the flags its run logged, the derived --batch_size and
    --ga_steps among them: those values are the recipe's own, so they are accepted."""
    proc = run(RUN_AND_TIME, clean_env(tmp_path, DRY_RUN="1", RECIPE="gbs28", NPROC_PER_NODE="4"), "7",
               "--batch_size", "7", "--ga_steps=1")
    assert proc.returncode == 0, proc.stderr
    flags = main_flags(proc.stdout)
    assert [flags[i + 1] for i, f in enumerate(flags) if f == "--batch_size"] == ["7", "7"]


def test_the_environment_overrides_a_recipe_and_says_so(tmp_path):
    proc = run(RUN_AND_TIME, clean_env(tmp_path, DRY_RUN="1", RECIPE="gbs28", NPROC_PER_NODE="4",
                                       LEARNING_RATE="1.0", START_EVAL_AT="30", MAX_EPOCHS="50"), "7")
    flags = main_flags(proc.stdout)
    assert option(flags, "--learning_rate") == "1.0" and option(flags, "--lr_warmup_epochs") == "1000"
    assert option(flags, "--start_eval_at") == "30" and "--evaluate_every" not in flags
    assert option(flags, "--epochs") == "50"
    assert "LEARNING_RATE=1.0 (the recipe: 2.0)" in proc.stderr


OVERRIDES_SEEN = """#!/usr/bin/env bash
printf '%s\\n' "${UNET3D_RECIPE_OVERRIDES-<unset>}" > "$HOME/overrides-seen"
exit 0
"""


def test_a_flag_after_the_recipes_that_overrides_one_of_its_values_is_said_in_a_line_of_its_own(tmp_path):
    """The reference's way to change a value, a flag after the script's own (main.py takes the last):
    each recipe value changed by a flag or the environment gets its line; a flag that repeats the
    recipe's value (as a packed launch script does) says nothing. The list reaches the training
    process, which records it (the package's README lists it)."""
    fake = tmp_path / "fake-python"
    fake.write_text(OVERRIDES_SEEN)
    fake.chmod(0o755)
    env = clean_env(tmp_path, PYTHON=str(fake), CLEAR_CACHES="0", RECIPE="gbs28", NPROC_PER_NODE="4",
                    LR_WARMUP_EPOCHS="500", DATASET_DIR=str(tmp_path))
    proc = run(RUN_AND_TIME, env, "7", "--learning_rate", "3.0", "--momentum=0.9", "--weight_decay", "0",
               "--lr_decay_epochs", "100", "200", "--amp")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "overrides" in line]
    assert lines == [
        "warning: RECIPE=gbs28 (RCP unet3d_ref_28): LR_WARMUP_EPOCHS=500 (the recipe: 1000) from the environment "
        "overrides the recipe's value",
        "warning: RECIPE=gbs28 (RCP unet3d_ref_28): the flag --learning_rate 3.0 (was 2.0), given after the "
        "recipe's, overrides its value",
        "warning: RECIPE=gbs28 (RCP unet3d_ref_28): the flag --lr_decay_epochs 100 200 (was none), given after the "
        "recipe's, overrides its value"], proc.stderr
    assert (tmp_path / "home" / "overrides-seen").read_text().strip() == (
        "LR_WARMUP_EPOCHS=500 (the recipe: 1000); --learning_rate 3.0 (was 2.0); --lr_decay_epochs 100 200 (was none)")
    same = run(RUN_AND_TIME, {**env, "LR_WARMUP_EPOCHS": "1000"}, "7", "--learning_rate", "2", "--momentum", "0.9")
    assert "overrides" not in same.stderr and (tmp_path / "home" / "overrides-seen").read_text().strip() == "<unset>"
    job = run(SINGLE_NODE, clean_env(tmp_path, DRY_RUN="1", RECIPE="gbs64", GPUS_PER_NODE="8",
                                     EXTRA_ARGS="--learning_rate 1.5"), "--momentum", "0.8")
    assert [line.split("): ", 1)[1] for line in job.stderr.splitlines() if "overrides" in line] == [
        "the flag --learning_rate 1.5 (was 2.0), given after the recipe's, overrides its value",
        "the flag --momentum 0.8 (was 0.9), given after the recipe's, overrides its value"], job.stderr


def test_slurm_jobs_pass_the_rules_schedule_and_the_default_recipe_says_it_has_no_rcp(tmp_path):
    proc = run(SINGLE_NODE, clean_env(tmp_path, DRY_RUN="1", GPUS_PER_NODE="8"))
    flags = main_flags(proc.stdout)
    assert option(flags, "--epochs") == "auto" and not {"--start_eval_at", "--evaluate_every"} & set(flags)
    assert option(flags, "--batch_size") == "2" and option(flags, "--learning_rate") == "0.8"  # as before recipes
    assert "global batch 16: no MLPerf 4.0.0 RCP stands behind them" in proc.stderr
    proc = run(SINGLE_NODE, clean_env(tmp_path, DRY_RUN="1", GPUS_PER_NODE="8", START_EVAL_AT="5",
                                      EVALUATE_EVERY="2"))
    flags = main_flags(proc.stdout)
    assert option(flags, "--start_eval_at") == "5" and option(flags, "--evaluate_every") == "2"


FAKE_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "${UNET3D_RECIPE-<unset>}" > "$HOME/recipe-seen"
exit 0
"""


@pytest.mark.parametrize("recipe_name, seen", [("gbs28", "gbs28"), ("", "<unset>")])
def test_the_recipe_reaches_the_training_process_and_the_reference_result_line_is_printed(tmp_path, recipe_name,
                                                                                           seen):
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = clean_env(tmp_path, PYTHON=str(fake), CLEAR_CACHES="0", UNET3D_RECIPE="stale", GLOBAL_BATCH_SIZE="28",
                    **({"RECIPE": recipe_name} if recipe_name else {}))
    proc = run(RUN_AND_TIME, env, "42")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "home" / "recipe-seen").read_text().strip() == seen
    # the reference's run_and_time.sh: echo "RESULT,$result_name,$SEED,$result,$USER,$start_fmt"
    (result,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT,")]
    start = re.search(r"STARTING TIMING RUN AT (.+)", proc.stdout).group(1)
    assert re.fullmatch(r"RESULT,image_segmentation,42,\d+,tester," + re.escape(start), result), result

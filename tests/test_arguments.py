import dataclasses
import os
import subprocess
import sys

import pytest

from runtime.arguments import ACCEPTED_ONLY, Config, build_parser, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REFERENCE_FLAGS = """--data_dir --log_dir --save_ckpt_path --load_ckpt_path --loader --local_rank --epochs
--quality_threshold --ga_steps --warmup_steps --batch_size --layout --input_shape --val_input_shape
--seed --num_workers --exec_mode --benchmark --amp --optimizer --learning_rate --init_learning_rate
--lr_warmup_epochs --lr_decay_epochs --lr_decay_factor --lamb_betas --momentum --weight_decay
--evaluate_every --eval_every --start_eval_at --verbose --normalization --activation --oversampling
--overlap --include_background --cudnn_benchmark --cudnn_deterministic --filters""".split()


def test_help_lists_every_reference_flag():
    out = subprocess.run([sys.executable, "main.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    for flag in REFERENCE_FLAGS:
        assert flag in out, flag


def test_reference_defaults(tmp_path):
    cfg = parse_args(["--data_dir", str(tmp_path)])
    assert cfg.epochs == 1 and cfg.batch_size == 2 and cfg.learning_rate == 1.0
    assert cfg.init_learning_rate == 1e-4 and cfg.oversampling == 0.4 and cfg.overlap == 0.5
    assert cfg.input_shape == (128, 128, 128) and cfg.quality_threshold == 0.908
    assert cfg.optimizer == "sgd" and cfg.momentum == 0.9 and cfg.seed == -1
    assert cfg.evaluate_every is None and cfg.start_eval_at is None
    assert cfg.filters == (32, 64, 128, 256, 320)


def test_config_is_frozen(tmp_path):
    cfg = parse_args(["--data_dir", str(tmp_path)])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 3  # type: ignore[misc]


def test_eval_every_alias_and_float_betas(tmp_path):
    cfg = parse_args(["--data_dir", str(tmp_path), "--eval_every", "7", "--lamb_betas", "0.8", "0.95"])
    assert cfg.evaluate_every == 7 and cfg.lamb_betas == (0.8, 0.95)


def test_every_flag_has_a_config_field():
    """Every flag but those accepted only for the reference's scripts (--layout, --pad_mode), which
    none has."""
    fields = {f.name for f in dataclasses.fields(Config)}
    for action in build_parser()._actions:
        if action.dest not in ("help", "version"):   # argparse's own actions: they exit
            assert (action.dest in fields) is (action.dest not in ACCEPTED_ONLY), action.dest
    assert ACCEPTED_ONLY == ("layout", "pad_mode")


def test_layout_is_accepted_and_kept_nowhere(tmp_path):
    cfg = parse_args(["--data_dir", str(tmp_path), "--layout", "NCDHW"])
    assert "layout" in cfg.explicit and not hasattr(cfg, "layout")
    help_text = " ".join(build_parser().format_help().split())
    assert "accepted for the reference's scripts" in help_text and "--channels_last picks" in help_text


def test_pad_mode_takes_the_references_choices_kept_nowhere_with_its_note(tmp_path):
    """The reference's --pad_mode (read by none of its modes: its sliding window pads with a
    constant) is accepted with its five choices; one line says it has no effect."""
    from runtime.arguments import no_effect_line

    for choice in ("constant", "edge", "reflect", "median", "symmetric"):
        cfg = parse_args(["--data_dir", str(tmp_path), "--pad_mode", choice])
        assert "pad_mode" in cfg.explicit and not hasattr(cfg, "pad_mode")
        assert no_effect_line(cfg).startswith("--pad_mode has no effect in --exec_mode train")


BAD = [
    (["--epochs", "-1"], "--epochs"),
    (["--input_shape", "128", "100", "128"], "--input_shape"),
    (["--val_input_shape", "64", "64"], "--val_input_shape"),
    (["--overlap", "1.0"], "--overlap"),
    (["--overlap", "-0.1"], "--overlap"),
    (["--lamb_betas", "0.9", "1.5"], "--lamb_betas"),
    (["--oversampling", "1.5"], "--oversampling"),
    (["--batch_size", "0"], "--batch_size"),
    (["--learning_rate", "0"], "--learning_rate"),
    (["--filters", "8", "16"], "--filters"),
    (["--exec_mode", "segment"], "--exec_mode"),
    (["--optimizer", "rmsprop"], "--optimizer"),
    (["--epochs", "abc"], "--epochs"),
    (["--input_shape", "32", "32", "32"], "--input_shape"),
    (["--exec_mode", "evaluate", "--benchmark", "--int8"], "--int8"),
    (["--int8"], "--int8"),  # train
]


@pytest.mark.parametrize("argv, flag", BAD)
def test_bad_values_one_line_exit_2(tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--data_dir", str(tmp_path)] + argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "Traceback" not in err


@pytest.mark.parametrize("mode", ["train", "evaluate"])
def test_missing_data_dir_named(tmp_path, mode):
    missing = str(tmp_path / "nowhere")
    ckpt = tmp_path / "c.pt"
    ckpt.write_bytes(b"x")
    proc = subprocess.run([sys.executable, "main.py", "--exec_mode", mode, "--data_dir", missing,
                           "--load_ckpt_path", str(ckpt)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--data_dir" in proc.stderr and missing in proc.stderr


def test_synthetic_loader_needs_no_data_dir():
    cfg = parse_args(["--loader", "synthetic", "--data_dir", "/definitely/not/here"])
    assert cfg.loader == "synthetic"


def test_usage_documents_every_flag():
    usage = open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8").read()
    for action in build_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert f"`{option}" in usage, option


def test_int8_combinations_for_predict(tmp_path):
    """--int8 is predict on the CPU without --amp: each conflict named in one message (the
    backend's levers, --compile and --channels_last, are refused when the backend is decided:
    tests/test_predict.py)."""
    from runtime.arguments import validate

    base = Config(exec_mode="predict", input=str(tmp_path), output_dir=str(tmp_path / "out"),
                  load_ckpt_path="", data_dir=str(tmp_path), int8=True)
    assert [m for m in validate(base) if "--int8" in m] == []
    for change, named in ((dict(device="cuda"), "--device cpu"), (dict(amp=True), "--amp")):
        messages = [m for m in validate(dataclasses.replace(base, **change)) if "--int8" in m]
        assert len(messages) == 1 and named in messages[0], messages


def test_every_exec_mode_has_its_checks():
    """A mode added to --exec_mode's choices without its entry in runtime.mode.MODES (and its
    checks) fails here."""
    from runtime.mode import MODES

    modes = next(a.choices for a in build_parser()._actions if a.dest == "exec_mode")
    assert {mode.exec_mode for mode in MODES.values() if mode.checks} == set(modes)


def test_mode_checks_stay_in_their_mode(tmp_path):
    """Predict's requirements bind predict only; evaluate's checkpoint, evaluate only."""
    from runtime.arguments import validate

    train = Config(data_dir=str(tmp_path))
    assert validate(train) == []
    assert validate(dataclasses.replace(train, exec_mode="evaluate")) == [
        "--exec_mode evaluate needs --load_ckpt_path"]
    assert validate(dataclasses.replace(train, exec_mode="predict")) == [
        f"--exec_mode predict needs --{name}" for name in ("load_ckpt_path", "input", "output_dir")]


@pytest.mark.parametrize("command, flag, value, message", [
    ([sys.executable, "main.py", "--data_dir", "."], "--batch_size", "0", "must be >= 1, got 0"),
    ([sys.executable, "main.py", "--data_dir", "."], "--sw_batch_size", "x", "expected an integer, got 'x'"),
    ([sys.executable, "preprocess_dataset.py", "--results_dir", "out"], "--num_workers", "0",
     "must be >= 1, got 0"),
    ([sys.executable, "-m", "data_loading.synthetic", "--output_dir", "out"], "--start_id", "-2",
     "must be >= 0, got -2"),
])
def test_integer_flags_of_every_command_line(command, flag, value, message):
    """main.py, preprocess_dataset.py and data_loading.synthetic share one parser and integer
    types: a bad integer is one line naming the flag, and exit 2."""
    proc = subprocess.run(command + [flag, value], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and f"argument {flag}: {message}" in proc.stderr

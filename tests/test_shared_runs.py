"""The suite's shared training runs (tests/main_runs.py, SharedRuns): one run per command line in a
session, ``{run}`` its own folder, its output and checkpoint writes kept for every later reader."""
import main_runs
from main_runs import SharedRuns


def test_one_run_per_command_line_with_its_own_folder_output_and_checkpoint_writes(tmp_path, capsys, monkeypatch):
    import runtime.checkpoint as checkpoint

    calls = []

    def fake_call(argv, capsys_, data_source):  # main.py's stand-in: prints, writes a "checkpoint"
        calls.append(argv)
        print(f"ran {len(calls)}")
        checkpoint.atomic_save({}, argv[-1])
        return 0, *capsys_.readouterr()

    monkeypatch.setattr(main_runs, "call", fake_call)
    def save(obj, path):
        open(path, "w").close()

    monkeypatch.setattr(checkpoint, "atomic_save", save)
    runs = SharedRuns(tmp_path / "shared")
    print("the test's own line")
    first = runs.run(["--epochs", "1", "--save_ckpt_path", "{run}/c.pt"], capsys)
    again = runs.run(["--epochs", "1", "--save_ckpt_path", "{run}/c.pt"], capsys)
    other = runs.run(["--epochs", "2", "--save_ckpt_path", "{run}/c.pt"], capsys)
    assert again is first and other is not first and len(calls) == 2
    assert calls[0] == ["--epochs", "1", "--save_ckpt_path", str(first.folder / "c.pt")]
    assert first.folder != other.folder and (first.folder / "c.pt").exists() and (other.folder / "c.pt").exists()
    assert (first.code, first.out, other.out) == (0, "ran 1\n", "ran 2\n")  # the run's output only
    assert len(first.save_times) == 1 and first.save_times[0][0] <= first.save_times[0][1]
    assert checkpoint.atomic_save is save  # the timing wrapper only during the run
    copy = first.copy_to(tmp_path / "copy")
    assert (copy / "c.pt").exists() and copy != first.folder

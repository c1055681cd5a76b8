"""--benchmark times what a run pays: every window batch shape the timed evaluation runs was run
once before the timing started (a shape's first run compiles, autotunes or builds kernels: with
--channels_last on a CPU the last partial batch's first run made one evaluation 308.8 s instead
of 3.26 s). Checked with a spy on the predictor, not with timings."""
import pytest
import torch

import easy_data
import runtime.training.benchmark as B
from main_runs import call
from runtime.inference.sliding_window import sliding_window_inference

NET = ["--filters", "2", "4", "4", "8", "8", "--val_input_shape", "32", "32", "32", "--normalization", "batchnorm",
       "--device", "cpu", "--seed", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return easy_data.write_dataset(str(tmp_path_factory.mktemp("easy") / "data"), range(13))


@pytest.mark.parametrize("shape,roi,overlap,batch", [((40, 40, 72), (32, 32, 32), 0.5, 3),
                                                     ((40, 40, 72), (32, 32, 32), 0.5, 4),
                                                     ((20, 33, 70), (16, 16, 32), 0.5, 5),
                                                     ((8, 8, 8), (16, 16, 16), 0.5, 2)])
def test_window_batch_sizes_are_those_the_sliding_window_runs(shape, roi, overlap, batch):
    seen = []

    def predict(windows):
        seen.append(windows.shape[0])
        return torch.zeros((windows.shape[0], 3, *windows.shape[2:]))

    sliding_window_inference(predict, torch.zeros((1, 1, *shape)), roi, overlap, batch)
    assert B.window_batch_sizes([shape], roi, overlap, batch) == sorted(set(seen))


@pytest.mark.parametrize("mode", [[], ["--exec_mode", "evaluate"]])
def test_every_timed_window_batch_shape_was_run_before_the_timing(data, capsys, monkeypatch, mode):
    events = []   # ("run", shape) for each predictor call, "timed" when a timed volume starts
    real_build, real_window = B.build_predictor, B.sliding_window_inference

    def spy_build(*args, **kwargs):
        predict = real_build(*args, **kwargs)

        def spy(batch):
            events.append(("run", tuple(batch.shape)))
            return predict(batch)
        return spy

    def spy_window(*args, **kwargs):
        events.append("timed")
        return real_window(*args, **kwargs)

    monkeypatch.setattr(B, "build_predictor", spy_build)
    monkeypatch.setattr(B, "sliding_window_inference", spy_window)
    train = ["--input_shape", "32", "32", "32", "--batch_size", "2", "--num_workers", "0"] if not mode else []
    code, out, err = call(["--data_dir", data, "--benchmark", "--epochs", "1", "--warmup_steps", "1",
                           "--sw_batch_size", "3", *NET, *train, *mode], capsys)
    assert code == 0, err[-2000:]
    first_timed = events.index("timed")
    warmed = {shape for event in events[:first_timed] if event != "timed" for _, shape in [event]}
    timed = {shape for event in events[first_timed:] if event != "timed" for _, shape in [event]}
    assert any(shape[0] < 3 for shape in timed)           # the volumes end in a partial batch
    assert timed <= warmed, (sorted(timed - warmed), sorted(warmed))

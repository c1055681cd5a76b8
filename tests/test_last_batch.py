"""The rules' epoch, checked against their text (v4.0 ``training_rules.adoc``), not this project's
code: every training case once per epoch at any global batch ("Training Data Order"; the last
batch padded, weight 0 in the loss), the evaluation epochs and non-convergence limit of "Quality
measure" from the padded samples per epoch, and a hand-set schedule never closed."""
import dataclasses
import math
from collections import Counter
from contextlib import nullcontext
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data_loading.data_loader import FolderTrainLoader
from data_loading.dataset import Case, TrainingSet
from data_loading.sampler import epoch_batches, epoch_permutation, step_weights
from model.losses import DiceCELoss
from runtime import distributed as D
from runtime.arguments import Config, UsageError, parse_args
from runtime.build import eager_train_step, weighted_loss
from runtime.plan import PrecisionPlan
from runtime.resolve import resolve, resolve_data
from runtime.training.loop import Reporters, eval_schedule_of, train_epoch

KITS_TRAIN = 168
PATCH = (4, 4, 4)
# (batch per process, processes, accumulation steps) -> global batches 2, 16, 28, 56, 64, 84
COMBOS = [(2, 1, 1), (16, 1, 1), (8, 2, 1), (14, 2, 1), (28, 1, 1), (4, 2, 7), (32, 2, 1), (64, 1, 1),
          (4, 2, 4), (84, 1, 1), (42, 2, 1), (5, 2, 1), (3, 1, 2)]


def rules_text_schedule(global_batch):
    """"Quality measure": spe = CEILING(168/global_batch_size) * global_batch_size; evaluation
    first at CEILING(1000*168/spe), then every CEILING(20*168/spe); failed at CEILING(10000*168/spe)."""
    spe = math.ceil(Fraction(KITS_TRAIN, global_batch)) * global_batch
    return tuple(math.ceil(Fraction(k * KITS_TRAIN, spe)) for k in (1000, 20, 10000))


@pytest.fixture(scope="module")
def kits_sized(tmp_path_factory):
    """168 tiny training cases (5³ volumes, a foreground voxel each)."""
    folder = tmp_path_factory.mktemp("kits168")
    cases = []
    for index in range(KITS_TRAIN):
        image, label = np.full((1, 5, 5, 5), float(index), np.float32), np.zeros((1, 5, 5, 5), np.uint8)
        label[0, 2, 2, 2] = 1
        x, y = folder / f"case_{index:05d}_x.npy", folder / f"case_{index:05d}_y.npy"
        np.save(x, image)
        np.save(y, label)
        cases.append(Case(f"{index:05d}", x, y, (5, 5, 5)))
    return cases


def traced_epoch(cases, batch, world, ga, rank, monkeypatch, epoch=3):
    """What rank ``rank``'s training epoch feeds its train step, traced from outside the sampler:
    the case whose arrays each sample is cropped from (``TrainingSet.volumes``, in order) and the
    loss weights the loop hands the step (None: a full step, every sample weighs the same)."""
    read, weights = [], []
    original = TrainingSet.volumes

    def volumes(self, index):
        read.append(index)
        return original(self, index)

    monkeypatch.setattr(TrainingSet, "volumes", volumes)
    loader = FolderTrainLoader(cases, patch=PATCH, oversampling=0.4, brightness="reference", seed=11,
                               num_shards=world, rank=rank, batch_size=batch, cache="memory", device=None,
                               num_workers=0, prefetch_depth=0, ga_steps=ga)
    cfg = dataclasses.replace(Config(), batch_size=batch, ga_steps=ga, learning_rate=0.1)

    def step(image, label, last_micro_batch=True, weights_=None):
        weights.append(weights_)
        return torch.zeros((), dtype=torch.float64)

    components = SimpleNamespace(
        plan=SimpleNamespace(config=cfg, precision=PrecisionPlan(False, "auto")),  # what train_epoch reads of a plan
        train_loader=loader, step=step,
        optimizer=SimpleNamespace(param_groups=[{"lr": 0.0}]),
        dist=D.DistInfo(rank=rank, local_rank=rank, world_size=1, device=torch.device("cpu")),
        state=SimpleNamespace(epoch=epoch - 1, step_in_epoch=0, epoch_loss_sum=0.0))
    train_epoch(components, Reporters(), epoch)
    monkeypatch.setattr(TrainingSet, "volumes", original)
    assert len(read) == batch * len(weights)
    samples = []
    for b, w in enumerate(weights):
        for j in range(batch):
            samples.append((read[b * batch + j], 1.0 / (batch * ga) if w is None else w[j]))
    return samples


@pytest.mark.parametrize("batch, world, ga", COMBOS)
def test_every_training_case_once_per_epoch_with_weight(batch, world, ga, kits_sized, monkeypatch):
    samples = [s for rank in range(world) for s in traced_epoch(kits_sized, batch, world, ga, rank, monkeypatch)]
    weighted = Counter(case for case, w in samples if w > 0)
    assert weighted == Counter(range(KITS_TRAIN))  # every case exactly once with a weight
    assert all(w == 0 or w > 0 for _, w in samples)
    spe = math.ceil(Fraction(KITS_TRAIN, batch * world * ga)) * batch * world * ga
    assert len(samples) == spe  # the rules' samples per epoch: padding counted, nothing more
    # what the MLPerf log counts (every epoch_num): the samples trained, those with a weight
    cfg, dist = _resolved(["--batch_size", str(batch), "--ga_steps", str(ga)], world)
    cfg = resolve_data(cfg, dist, SimpleNamespace(num_train=KITS_TRAIN, num_eval=42, train_bytes=0, synthetic=""))
    trained = sum(1 for _, w in samples if w > 0)
    assert (cfg.training.samples_per_epoch, cfg.training.samples_trained_per_epoch) == (spe, trained)


@pytest.mark.parametrize("world, batch, ga, semantics, trained", [
    (2, 5, 1, "project", 160), (2, 5, 4, "reference", 160),  # 84 // 5 = 16 batches a rank: 4 whole steps of 4
    (2, 5, 3, "reference", 150),  # 16 batches: 5 whole steps of 3, the 16th batch's gradient discarded
    (2, 5, 3, "project", 160),  # the project's semantics steps on the tail too
    (1, 64, 1, "reference", 128)])
def test_a_dropped_last_batch_trains_the_full_batches_only(world, batch, ga, semantics, trained):
    """--last_batch drop (the reference's loader, open): each rank's full batches of its shard;
    under the reference's semantics an epoch's last accumulation cut short is thrown away
    (zero_grad), so its samples are not trained either."""
    from runtime.schedule import samples_trained_per_epoch

    assert samples_trained_per_epoch(KITS_TRAIN, world, batch, ga, "drop", semantics) == trained
    assert samples_trained_per_epoch(KITS_TRAIN, world, batch, ga, "pad", semantics) == KITS_TRAIN


def test_padded_step_weights_make_each_step_the_mean_of_its_real_samples():
    # 10 cases, batch 2 x 2 processes x 2 accumulation steps (global 8): step 2 holds 2 real samples
    total = [0.0, 0.0]
    for rank in range(2):
        for b in range(4):
            w = step_weights(10, 2, rank, 2, 2, b)
            if b < 2:
                assert w is None
            else:
                total[b // 2 - 1] += sum(w) / 2  # DDP averages the 2 processes
    assert total[0] == pytest.approx(1.0)  # weights of a step sum to 1 after DDP's average


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(1, 3, 3, padding=1)
        self.norm = torch.nn.InstanceNorm3d(3, affine=True)

    def forward(self, x):
        return self.norm(self.conv(x))


def gradient(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("loss_fn", [DiceCELoss(), lambda logits, label: (logits - label).square().mean()],
                         ids=["dice_ce", "mse"])
def test_masked_loss_gradient_equals_the_real_samples_alone(loss_fn):
    """A global batch of 8 (2 per process x 2 processes x 2 accumulation steps) over 5 real
    samples: the summed weighted losses, DDP's 1/W average applied, give the gradient of the mean
    loss over the 5 real samples alone (float64 oracle)."""
    torch.manual_seed(0)
    model = TinyNet().double()
    images = torch.randn(8, 1, 6, 6, 6, dtype=torch.float64)
    labels = torch.randint(0, 3, (8, 1, 6, 6, 6), dtype=torch.uint8)
    num_cases, batch, world, ga = 5, 2, 2, 2
    grads = None
    for rank in range(world):
        for k in range(ga):
            positions = [k * batch * world + world * j + rank for j in range(batch)]
            image, label = images[positions], labels[positions]
            # a padding position repeats a real case, as the sampler pads
            image[torch.tensor([p >= num_cases for p in positions])] = images[0]
            w = step_weights(num_cases, world, rank, batch, ga, k)
            loss, _ = weighted_loss(loss_fn, model(image), label, w)
            g = gradient(model, loss)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
    grads = [g / world for g in grads]
    expected = gradient(model, loss_fn(model(images[:num_cases]), labels[:num_cases]))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)


def test_the_train_step_with_weights_updates_as_sgd_on_the_real_samples():
    torch.manual_seed(1)
    model, reference = TinyNet().double(), TinyNet().double()
    reference.load_state_dict(model.state_dict())
    loss_fn = DiceCELoss()
    images = torch.randn(3, 1, 6, 6, 6, dtype=torch.float64)
    labels = torch.randint(0, 3, (3, 1, 6, 6, 6), dtype=torch.uint8)
    images[2], labels[2] = images[0], labels[0]  # the padding repeats case 0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    step = eager_train_step(model, loss_fn, optimizer, torch.amp.GradScaler("cpu", enabled=False), nullcontext, 1)
    reported = step(images, labels, True, step_weights(2, 1, 0, 3, 1, 0))
    loss = loss_fn(reference(images[:2]), labels[:2])
    grads = gradient(reference, loss)
    for p, q, g in zip(model.parameters(), reference.parameters(), grads):
        torch.testing.assert_close(p, q - 0.5 * g, rtol=1e-5, atol=1e-9)
    # the reported loss: the real samples' losses over the batch (the epoch's mean divides by N / B)
    assert float(reported) == pytest.approx(float(loss.detach()) * 2 / 3, rel=1e-6)


@pytest.mark.parametrize("num_cases, batch, world, ga", [(168, 2, 1, 1), (168, 4, 2, 1), (168, 2, 2, 3),
                                                         (168, 84, 1, 1), (12, 3, 2, 2)])
def test_batches_unchanged_where_the_global_batch_divides_the_cases(num_cases, batch, world, ga):
    """Where nothing is padded the keys are those of the code before padding existed: rank r's
    positions r, r + W, ... of the epoch's permutation, its (N // W) // B full batches."""
    for rank in range(world):
        perm = epoch_permutation(5, 2, num_cases)
        old = [(2, i, int(perm[i])) for i in range(rank, num_cases, world)[:(num_cases // world) // batch * batch]]
        new = epoch_batches(5, 2, num_cases, world, rank, batch, ga)
        assert [key for b in new for key in b] == old
        assert all(step_weights(num_cases, world, rank, batch, ga, k) is None for k in range(len(new)))


# ---------------------------------------------------------------------------- schedule and division

def _resolved(argv, world=1):
    dist = D.DistInfo(rank=0, local_rank=0, world_size=world, device=torch.device("cpu"))
    return resolve(parse_args(["--data_dir", "/", "--device", "cpu", "--seed", "1", *argv]), dist), dist


@pytest.mark.parametrize("batch, world, ga", [(2, 1, 1), (8, 2, 1), (14, 2, 1), (4, 2, 7), (32, 2, 1), (84, 1, 1)])
def test_logged_schedule_is_the_rules_at_the_global_batch(batch, world, ga):
    cfg, dist = _resolved(["--batch_size", str(batch), "--ga_steps", str(ga)], world)
    cfg = resolve_data(cfg, dist, SimpleNamespace(num_train=168, num_eval=42, train_bytes=0, synthetic=""))
    schedule = eval_schedule_of(cfg.training)  # what the loop evaluates on and logs
    assert (schedule.start_eval_at, schedule.evaluate_every, schedule.fail_epoch) == \
        rules_text_schedule(batch * world * ga)
    assert cfg.training.samples_per_epoch == math.ceil(Fraction(168, batch * world * ga)) * batch * world * ga
    assert cfg.division == "closed"


def test_epochs_auto_is_the_rules_non_convergence_limit():
    cfg, _ = _resolved(["--epochs", "auto", "--batch_size", "8"], world=2)
    assert cfg.training.epochs == rules_text_schedule(16)[2] == 9546
    assert "10000" in cfg.why("epochs") and cfg.decision("epochs").asked == "auto"
    assert _resolved(["--epochs", "4000"])[0].training.epochs == 4000  # the reference's value stays
    with pytest.raises(SystemExit):
        parse_args(["--epochs", "many"])


def test_epochs_auto_in_a_shared_flag_set_passes_plain_evaluate_only(tmp_path, capsys):
    """run_and_time.sh's flags now carry --epochs auto; a script passing one flag set to train
    and evaluate keeps working (evaluate reads no --epochs), evaluate --benchmark counts passes."""
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"")
    evaluate = ["--data_dir", "/", "--exec_mode", "evaluate", "--load_ckpt_path", str(ckpt), "--epochs", "auto"]
    assert parse_args(evaluate).epochs == "auto"
    with pytest.raises(SystemExit):
        parse_args([*evaluate, "--benchmark"])
    assert "--epochs auto is training's non-convergence limit" in capsys.readouterr().err


@pytest.mark.parametrize("argv, world", [(["--start_eval_at", "1000", "--batch_size", "8"], 2),  # rules: 955
                                         (["--evaluate_every", "20", "--batch_size", "64"], 1),  # rules: 18
                                         (["--start_eval_at", "1", "--evaluate_every", "1"], 1),
                                         (["--last_batch", "drop"], 1)])
def test_a_hand_set_schedule_or_a_dropped_batch_is_never_closed(argv, world):
    cfg, _ = _resolved(argv, world)
    assert cfg.division == "open" and cfg.why("division")
    with pytest.raises(UsageError, match="cannot be closed"):
        _resolved([*argv, "--submission_division", "closed"], world)


def test_the_formulas_values_given_by_hand_stay_closed():
    cfg, _ = _resolved(["--start_eval_at", "1000", "--evaluate_every", "20"])  # global batch 2
    assert cfg.division == "closed"
    cfg, _ = _resolved(["--start_eval_at", "955", "--evaluate_every", "20", "--batch_size", "16"])
    assert cfg.division == "closed"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_cuda_graphs_train_a_padded_step_eagerly_on_the_graphs_state(optimizer_name):
    """--cuda_graphs: full steps replay the graph, the padded step runs eagerly on the same weights
    and optimizer state; the weights follow the all-eager run."""
    from runtime.build import graphed_train_step
    from runtime.optimizers import make_optimizer

    dev = torch.device("cuda")
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = False, True
    cfg = dataclasses.replace(Config(), batch_size=3, input_shape=(8, 8, 8))
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(3, 1, 8, 8, 8, generator=generator).to(dev),
                torch.randint(0, 3, (3, 1, 8, 8, 8), generator=generator, dtype=torch.uint8).to(dev))
               for _ in range(5)]
    weights = [None, None, [0.5, 0.5, 0.0], None, None]
    lr = 0.02 if optimizer_name == "sgd" else 1e-3
    results = []
    try:
        for graphed in (False, True):
            torch.manual_seed(0)
            model = TinyNet().to(dev)
            opt = make_optimizer(optimizer_name, model.parameters(), lr, momentum=0.9)
            scaler = torch.amp.GradScaler("cuda", enabled=False)
            step = (graphed_train_step(model, DiceCELoss(), opt, scaler, nullcontext,
                                       (cfg.batch_size, 1, *cfg.input_shape), cfg.channels_last, cfg.ga_steps, dev)
                    if graphed
                    else eager_train_step(model, DiceCELoss(), opt, scaler, nullcontext, 1))
            for (image, label), w in zip(batches, weights):
                step(image, label, True, w)
            torch.cuda.synchronize()
            results.append([p.detach().cpu() for p in model.parameters()])
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = flags
    for eager, graph in zip(*results):
        torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-5)

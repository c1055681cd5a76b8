"""The loaders end to end: sharding, evaluation assignment, determinism across workers, caches,
epochs and re-creation, prefetch, the synthetic loader."""
import dataclasses
import threading

import numpy as np
import pytest
import torch

from data_loading.data_loader import get_data_loaders
from runtime.resolve import resolve_cache
from runtime.schedule import samples_per_epoch
from data_loading.prefetch import prefetch
from data_loading.sampler import (balance_by_cost, batches_per_epoch, epoch_batches,
                                  epoch_permutation, sample_rng)
from data_loading.windows import window_geometry
from runtime.arguments import Config

PATCH = (32, 32, 32)
# ids 0..13: 00000 00003 00005 00006 00012 are evaluation cases, the other 9 training cases
CASES = range(14)


def _write_case(folder, case, shape):
    rng = np.random.default_rng(case)
    name = folder / f"case_{case:05d}"
    np.save(f"{name}_x.npy", rng.standard_normal((1, *shape)).astype(np.float32))
    y = np.zeros((1, *shape), np.uint8)
    lo = [int(rng.integers(0, s - 12)) for s in shape]
    y[0, lo[0]:lo[0] + 10, lo[1]:lo[1] + 8, lo[2]:lo[2] + 12] = 1
    y[0, lo[0] + 2:lo[0] + 6, lo[1] + 2:lo[1] + 5, lo[2] + 3:lo[2] + 7] = 2
    np.save(f"{name}_y.npy", y)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kits_tiny")
    for case in CASES:
        # evaluation volumes of different sizes so that their window counts differ
        shape = (34 + case % 5, 40, 36 + 8 * (case % 3))
        _write_case(folder, case, shape)
    return folder


def make_config(data_dir, **changes):
    base = dict(data_dir=str(data_dir), input_shape=PATCH, val_input_shape=PATCH, seed=7,
                num_workers=0, prefetch=0, batch_size=2, cache="memory", oversampling=0.4)
    return dataclasses.replace(Config(), **{**base, **changes})


def epoch_batches_of(loader, epoch):
    loader.set_epoch(epoch)
    return [(image.clone(), label.clone()) for image, label in loader]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (ia, la), (ib, lb) in zip(a, b):
        assert torch.equal(ia, ib) and torch.equal(la, lb)


# ---------------------------------------------------------------------------- sampler (pure)

@pytest.mark.parametrize("num_cases,shards,batch", [(168, 1, 2), (168, 8, 2), (42, 5, 3), (9, 4, 1)])
def test_shards_disjoint_covering_and_equal_steps_when_dropping(num_cases, shards, batch):
    per_rank = [epoch_batches(3, 5, num_cases, shards, r, batch, last_batch="drop") for r in range(shards)]
    positions = [[key[1] for b in batches for key in b] for batches in per_rank]
    steps = batches_per_epoch(num_cases, shards, batch, last_batch="drop")
    assert all(len(batches) == steps for batches in per_rank)
    assert all(len(b) == batch for batches in per_rank for b in batches)
    flat = [p for rank in positions for p in rank]
    assert len(flat) == len(set(flat)) == shards * batch * steps       # disjoint
    assert shards * batch * steps > num_cases - shards * batch - shards  # only partial batches dropped
    # the shard partition (before dropping incomplete batches) covers every position once
    from data_loading.sampler import shard_positions
    owned = sorted(p for r in range(shards) for p in shard_positions(num_cases, shards, r))
    assert owned == list(range(num_cases))
    # every position maps to the case of the shared epoch permutation
    perm = epoch_permutation(3, 5, num_cases)
    assert all(key[2] == perm[key[1]] and key[0] == 5 for bs in per_rank for b in bs for key in b)


def test_shuffle_depends_on_seed_and_epoch_only():
    a = epoch_permutation(1, 2, 50)
    assert np.array_equal(a, epoch_permutation(1, 2, 50))
    assert sorted(a) == list(range(50))
    assert not np.array_equal(a, epoch_permutation(1, 3, 50))
    assert not np.array_equal(a, epoch_permutation(2, 2, 50))
    assert sample_rng(1, 2, 3).random() == sample_rng(1, 2, 3).random()
    assert sample_rng(1, 2, 3).random() != sample_rng(1, 2, 4).random()


def test_balance_by_cost_is_balanced_and_assigns_each_once():
    rng = np.random.default_rng(0)
    for _ in range(50):
        costs = list(rng.integers(1, 60, int(rng.integers(1, 50))))
        shards = int(rng.integers(1, 9))
        assignment = balance_by_cost(costs, shards)
        assert sorted(i for s in assignment for i in s) == list(range(len(costs)))
        loads = [sum(costs[i] for i in s) for s in assignment]
        assert max(loads) - min(loads) <= max(costs)
    assert balance_by_cost([5, 1], 4) == [[0], [1], [], []]        # a rank may get none


# ---------------------------------------------------------------------------- loaders

def test_train_loader_contract(data_dir):
    train, val = get_data_loaders(make_config(data_dir), 1, 0)
    # 9 cases, batch 2: 5 batches, the last padded (every case once per epoch, as the rules say)
    assert train.num_cases == 9 and len(train) == 5 and samples_per_epoch(train.num_cases, 1, 2) == 10
    assert val.num_cases == len(val) == 5
    train.set_epoch(1)
    batches = list(train)
    assert len(batches) == 5
    for image, label in batches:
        assert image.shape == label.shape == (2, 1, *PATCH)
        assert image.dtype == torch.float32 and label.dtype == torch.uint8
        assert int(label.max()) <= 2
    ids = []
    for image, label, case_id in val:
        assert image.dtype == torch.float32 and label.dtype == torch.uint8
        assert image.shape[:2] == (1, 1) and image.shape == label.shape
        ids.append(case_id)
    assert ids == ["00000", "00003", "00005", "00006", "00012"]


def test_samples_per_epoch_counts_what_all_ranks_train(data_dir):
    train, _ = get_data_loaders(make_config(data_dir, batch_size=2), 2, 1)
    # 9 cases on 2 ranks at batch 2: global batch 4, padded to 12 positions -> 3 batches of 2 on
    # each rank, which is what the schedule's formula says
    assert len(train) == 3 and train.num_cases == 9
    assert samples_per_epoch(train.num_cases, 2, 2) == 2 * 2 * len(train) == 12
    dropping, _ = get_data_loaders(make_config(data_dir, batch_size=2, last_batch="drop"), 2, 1)
    # --last_batch drop (the reference): 4 cases each -> 2 batches of 2 -> 8 samples
    assert len(dropping) == 2 and samples_per_epoch(9, 2, 2, last_batch="drop") == 2 * 2 * len(dropping) == 8


def test_identical_batches_for_0_and_2_workers(data_dir):
    zero, _ = get_data_loaders(make_config(data_dir, num_workers=0), 1, 0)
    two, _ = get_data_loaders(make_config(data_dir, num_workers=2, prefetch=2), 1, 0)
    for epoch in (1, 2):
        assert_same_batches(epoch_batches_of(zero, epoch), epoch_batches_of(two, epoch))


def test_caches_give_identical_batches(data_dir):
    """memory, none and the device path (run on the CPU here) draw and apply the same."""
    results = {}
    for cache in ("memory", "none", "device"):
        loader, _ = get_data_loaders(make_config(data_dir, cache=cache, oversampling=0.7), 1, 0)
        results[cache] = epoch_batches_of(loader, 3)
    assert_same_batches(results["memory"], results["none"])
    assert_same_batches(results["memory"], results["device"])


def test_resume_reproduces_an_epoch_and_epochs_differ(data_dir):
    first, _ = get_data_loaders(make_config(data_dir, prefetch=1), 1, 0)
    epochs = [epoch_batches_of(first, e) for e in (1, 2, 3)]
    fresh, _ = get_data_loaders(make_config(data_dir), 1, 0)           # a resumed run
    assert_same_batches(epoch_batches_of(fresh, 3), epochs[2])
    assert_same_batches(epoch_batches_of(fresh, 1), epochs[0])
    assert not torch.equal(epochs[0][0][0], epochs[1][0][0])
    other_seed, _ = get_data_loaders(make_config(data_dir, seed=8), 1, 0)
    assert not torch.equal(epoch_batches_of(other_seed, 1)[0][0], epochs[0][0][0])


def test_loading_leaves_global_random_state_alone(data_dir):
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()
    loader, _ = get_data_loaders(make_config(data_dir, num_workers=2), 1, 0)
    epoch_batches_of(loader, 1)
    epoch_batches_of(loader, 2)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], np_state[1])


def test_ranks_train_disjoint_samples(data_dir):
    loaders = [get_data_loaders(make_config(data_dir, batch_size=1), 3, r)[0] for r in range(3)]
    keys = [key for loader in loaders for batch in loader.batch_keys(epoch=2) for key in batch]
    assert len(keys) == len({k[1] for k in keys}) == 9                # 3 ranks x 3 steps x 1
    assert sorted(k[2] for k in keys) == list(range(9))               # every case once


@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_evaluation_cases_balanced_by_windows(data_dir, shards):
    per_rank = [get_data_loaders(make_config(data_dir, batch_size=1), shards, r)[1]
                for r in range(shards)]
    assert all(v.num_cases == 5 for v in per_rank)
    ids = [[case.case_id for case in v.cases] for v in per_rank]
    assert sorted(i for rank in ids for i in rank) == ["00000", "00003", "00005", "00006", "00012"]
    windows = [[window_geometry(case.shape, PATCH, 0.5).n_windows for case in v.cases]
               for v in per_rank]
    assert len({w for rank in windows for w in rank}) > 1              # costs really differ
    loads = [sum(rank) for rank in windows]
    assert max(loads) - min(loads) <= max(w for rank in windows for w in rank)
    assert sum(len(v) for v in per_rank) == 5
    if shards == 7:
        assert [len(v) for v in per_rank].count(0) == 2                # ranks with no case


def test_auto_cache_choice():
    assert resolve_cache("auto", None) == "memory"
    assert resolve_cache("auto", torch.device("cpu")) == "memory"
    assert resolve_cache("auto", torch.device("cuda", 0)) == "device"
    assert resolve_cache("none", torch.device("cuda", 0)) == "none"


def test_synthetic_loader(tmp_path):
    cfg = make_config(tmp_path, loader="synthetic", batch_size=3)
    train, val = get_data_loaders(cfg, 2, 1)
    assert train.num_cases == 168 and len(train) == 28 and 2 * 3 * len(train) == 168
    assert val.num_cases == 42 and len(val) == 21
    train.set_epoch(1)
    batches = list(train)
    assert len(batches) == 28
    image, label = batches[0]
    assert image.shape == label.shape == (3, 1, *PATCH)
    assert image.dtype == torch.float32 and label.dtype == torch.uint8
    assert set(label.unique().tolist()) == {0, 1, 2}
    image, label, case_id = next(iter(val))
    assert image.shape == (1, 1, *PATCH) and isinstance(case_id, str) and len(case_id) == 5


# ---------------------------------------------------------------------------- prefetch

@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetch_keeps_order_and_values(depth):
    items = [(torch.full((2,), float(i)), str(i)) for i in range(7)]
    out = list(prefetch(iter(items), None, depth))
    assert [s for _, s in out] == [str(i) for i in range(7)]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(out, items))


def test_prefetch_runs_ahead_and_reraises():
    produced = []

    def source():
        for i in range(5):
            produced.append(i)
            yield i
        raise RuntimeError("broken volume")

    stream = prefetch(source(), None, depth=2)
    assert next(stream) == 0
    deadline = threading.Event()
    for _ in range(100):                     # the thread fills the queue while we wait
        if len(produced) >= 3:
            break
        deadline.wait(0.01)
    assert len(produced) >= 3
    with pytest.raises(RuntimeError, match="broken volume"):
        list(stream)


def test_prefetch_stops_when_the_consumer_leaves():
    def endless():
        i = 0
        while True:
            i += 1
            yield i

    before = threading.active_count()
    for i, _ in enumerate(prefetch(endless(), None, depth=2)):
        if i == 3:
            break
    assert threading.active_count() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_loaders_match_cpu(data_dir):
    device = torch.device("cuda", 0)
    cpu, cpu_val = get_data_loaders(make_config(data_dir), 1, 0)
    expected = epoch_batches_of(cpu, 2)
    noisy = [[cpu.dataset.augmentation(key).noise_std is not None for key in keys]
             for keys in cpu.batch_keys(epoch=2)]
    for cache in ("memory", "device"):
        loader, val = get_data_loaders(make_config(data_dir, cache=cache, prefetch=2), 1, 0, device)
        got = epoch_batches_of(loader, 2)
        assert len(got) == len(expected)
        for (image, label), (ref_image, ref_label), flags in zip(got, expected, noisy):
            assert image.device == device and label.device == device
            assert torch.equal(label.cpu(), ref_label)
            for b, with_noise in enumerate(flags):
                if cache == "memory" or not with_noise:
                    assert torch.equal(image[b].cpu(), ref_image[b])
                else:   # the CUDA generator draws other noise values of the same scale
                    assert float((image[b].cpu() - ref_image[b]).abs().max()) < 1.0
        for (image, label, case_id), (ref, ref_label, ref_id) in zip(val, cpu_val):
            assert image.device == device and case_id == ref_id
            assert torch.equal(image.cpu(), ref) and torch.equal(label.cpu(), ref_label)

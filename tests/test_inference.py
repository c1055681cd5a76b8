"""Sliding-window evaluation against a brute-force oracle written from the spec, and MONAI."""
import numpy as np
import pytest
import torch

from data_loading.windows import window_geometry
from runtime.inference.sliding_window import gaussian_importance_map, sliding_window_inference, trim_like_window


def _predictor(seed=0):
    """A position-sensitive predictor: a random 5^3 convolution with zero padding, so each
    window's output near its borders depends on where the window sits."""
    torch.manual_seed(seed)
    conv = torch.nn.Conv3d(1, 3, 5, padding=2)
    return lambda x: conv(x)


def brute_force(predict, image, label, roi, overlap):
    """The spec's algorithm, one window at a time, in float64 numpy where possible."""
    shape = list(image.shape[2:])
    strides = [int(r * (1 - overlap)) for r in roi]
    bounds = [s % st for s, st in zip(shape, strides)]
    bounds = [b if b < st // 2 else 0 for b, st in zip(bounds, strides)]
    sl = tuple(slice(b // 2, s - (b - b // 2)) for b, s in zip(bounds, shape))
    image, label = image[(..., *sl)], label[(..., *sl)]
    trimmed = list(image.shape[2:])
    pads = []
    for s, st, r in zip(trimmed, strides, roi):
        p = (st - s % st) % st
        while s + p < r:
            p += st
        pads.append(p)
    padded = torch.nn.functional.pad(
        image, [v for p in reversed(pads) for v in (p // 2, p - p // 2)], value=-2.2)
    n = roi[0]
    g = np.exp(-0.5 * ((np.arange(n) - (n - 1) / 2) / (0.125 * n)) ** 2)
    w = np.cbrt(np.einsum("i,j,k->ijk", g, g, g))
    w = torch.from_numpy(w / w.max()).float()
    out = torch.zeros(1, 3, *padded.shape[2:])
    norm = torch.zeros(1, 1, *padded.shape[2:])
    for i in range(0, padded.shape[2] - roi[0] + 1, strides[0]):
        for j in range(0, padded.shape[3] - roi[1] + 1, strides[1]):
            for k in range(0, padded.shape[4] - roi[2] + 1, strides[2]):
                s = (..., slice(i, i + roi[0]), slice(j, j + roi[1]), slice(k, k + roi[2]))
                out[s] += predict(padded[s]) * w
                norm[s] += w
    out = out / norm
    crop = tuple(slice(p // 2, p // 2 + t) for p, t in zip(pads, trimmed))
    return out[(..., *crop)], label


@pytest.mark.parametrize("shape, roi, overlap", [
    ((40, 33, 50), (16, 16, 16), 0.5),   # trims (40 % 8 = 0, 33 % 8 = 1 < 4) and pads
    ((20, 37, 30), (16, 16, 16), 0.5),   # 37 % 8 = 5 >= 4: padded, not trimmed
    ((10, 20, 17), (16, 16, 16), 0.75),  # smaller than the window on one axis
])
def test_matches_brute_force(shape, roi, overlap):
    g = torch.Generator().manual_seed(1)
    image = torch.randn(1, 1, *shape, generator=g)
    label = torch.randint(0, 3, (1, 1, *shape), generator=g)
    predict = _predictor()
    with torch.no_grad():
        ours = sliding_window_inference(predict, image, roi, overlap, sw_batch_size=1)
        our_label = trim_like_window(label, roi, overlap)
        ref, ref_label = brute_force(predict, image, label, roi, overlap)
    assert ours.shape == ref.shape and torch.equal(our_label, ref_label)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sw_batch_size", [2, 3, 7, 100])
def test_independent_of_sw_batch_size(sw_batch_size):
    image = torch.randn(1, 1, 40, 24, 33)
    predict = _predictor(3)
    with torch.no_grad():
        one = sliding_window_inference(predict, image, (16, 16, 16), 0.5, sw_batch_size=1)
        many = sliding_window_inference(predict, image, (16, 16, 16), 0.5, sw_batch_size)
    torch.testing.assert_close(one, many, rtol=1e-6, atol=1e-6)


def test_matches_monai_where_grids_coincide():
    inferers = pytest.importorskip("monai.inferers")
    roi = (16, 16, 16)
    image = torch.randn(1, 1, 32, 16, 48)  # (size - roi) multiple of the stride: same grid, no pad
    predict = _predictor(5)
    weights = gaussian_importance_map(roi)
    with torch.no_grad():
        ours = sliding_window_inference(predict, image, roi, 0.5, sw_batch_size=2)
        oracle = inferers.sliding_window_inference(image, roi, 2, predict, overlap=0.5,
                                                   roi_weight_map=weights)
    torch.testing.assert_close(ours, oracle, rtol=1e-5, atol=1e-5)


def test_gaussian_map_properties():
    w = gaussian_importance_map((8, 8, 8)).numpy()
    assert w.max() == pytest.approx(1.0) and w.min() > 0
    assert np.allclose(w, w.transpose(1, 2, 0)) and np.allclose(w, w[::-1])
    g = np.exp(-0.5 * ((np.arange(8) - 3.5) / 1.0) ** 2)
    # corner weight: cube root of g0^3 over cube root of the centre's g3^3 (std 0.125 * 8 = 1)
    assert w[0, 0, 0] == pytest.approx(g[0] / g[3], rel=1e-6)
    assert w[3, 0, 3] == pytest.approx(g[0] ** (1 / 3) * g[3] ** (2 / 3) / g[3], rel=1e-6)


def test_window_counts():
    assert window_geometry((128, 128, 128), (128,) * 3, 0.5).n_windows == 1
    assert window_geometry((190, 250, 250), (128,) * 3, 0.5).grid == (2, 3, 3)
    assert window_geometry((192, 256, 256), (128,) * 3, 0.5).n_windows == 2 * 3 * 3


@pytest.mark.parametrize("overlap", [0.3, 0.6, 0.1])
def test_odd_overlaps_cover_every_voxel(overlap):
    """A stride that does not divide the window (128 * 0.7 = 89) still weighs every voxel."""
    geo = window_geometry((200, 130, 128), (128, 128, 128), overlap)
    for size, stride, grid in zip(geo.padded_shape, geo.strides, geo.grid):
        assert (grid - 1) * stride + 128 == size
    image = torch.randn(1, 1, 50, 33, 32)
    with torch.no_grad():
        out = sliding_window_inference(lambda x: x.repeat(1, 3, 1, 1, 1), image, (32, 32, 32), overlap)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("shape,roi,overlap", [((37, 29, 50), (16, 16, 16), 0.5),
                                               ((9, 20, 13), (16, 16, 16), 0.25),
                                               ((33, 33, 33), (8, 16, 16), 0.75)])
def test_identity_predictor_returns_the_trimmed_image(shape, roi, overlap):
    """Known answer: a predictor that returns its input makes the Gaussian-weighted average of
    identical values, i.e. the (trimmed) image itself, whatever the overlap and padding."""
    torch.manual_seed(1)
    image = torch.randn(1, 3, *shape)
    label = torch.randint(0, 3, (1, 1, *shape), dtype=torch.uint8)
    logits = sliding_window_inference(lambda x: x, image, roi, overlap, sw_batch_size=3)
    trimmed_label = trim_like_window(label, roi, overlap)
    geo = window_geometry(shape, roi, overlap)
    trim = tuple(slice(b, b + s) for (b, _), s in zip(geo.trim, geo.trimmed_shape))
    assert logits.shape == (1, 3, *geo.trimmed_shape)
    torch.testing.assert_close(logits, image[(..., *trim)], rtol=1e-6, atol=1e-6)
    assert torch.equal(trimmed_label, label[(..., *trim)])

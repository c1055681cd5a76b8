"""Timing summaries for ``--benchmark`` (pure functions)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def latency_summary(seconds: Sequence[float], items_per_iteration: int) -> dict[str, float]:
    """Throughput (items/s over the timed iterations) and latency mean / p90 / p95 / p99 (ms)."""
    if len(seconds) == 0:
        raise ValueError("no timed iteration: raise --epochs or lower --warmup_steps")
    times = np.asarray(seconds, dtype=np.float64)
    return {
        "throughput": items_per_iteration * len(times) / times.sum(),
        "latency_mean_ms": 1e3 * times.mean(),
        "latency_p90_ms": 1e3 * np.percentile(times, 90),
        "latency_p95_ms": 1e3 * np.percentile(times, 95),
        "latency_p99_ms": 1e3 * np.percentile(times, 99),
        "timed_iterations": int(len(times)),
    }


def format_summary(prefix: str, summary: dict[str, float], unit: str) -> str:
    return (f"{prefix}: {summary['throughput']:.2f} {unit}/s | latency mean "
            f"{summary['latency_mean_ms']:.1f} ms, p90 {summary['latency_p90_ms']:.1f} ms, p95 "
            f"{summary['latency_p95_ms']:.1f} ms, p99 {summary['latency_p99_ms']:.1f} ms "
            f"({summary['timed_iterations']} timed iterations)")


def reference_stats(seconds: Sequence[float], items_per_iteration: int, mode: str) -> dict[str, float]:
    """The MLCommons reference's ``--benchmark`` statistics of the iterations that took ``seconds``
    each, under its keys (``runtime.run_files.BENCHMARK_STATS``; ``mode`` "train" or "eval"):
    ``throughput_<mode>`` is the mean of each iteration's items/s (not items over the total time,
    :func:`latency_summary`'s), ``latency_<mode>_mean`` and ``_90``/``_95``/``_99`` in ms (numpy's
    linear percentiles)."""
    if len(seconds) == 0:
        raise ValueError("no timed iteration: raise --epochs or lower --warmup_steps")
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    stats = {f"throughput_{mode}": float(np.mean(1e3 * items_per_iteration / ms)),
             f"latency_{mode}_mean": float(ms.mean())}
    for level in (90, 95, 99):
        stats[f"latency_{mode}_{level}"] = float(np.percentile(ms, level))
    return stats

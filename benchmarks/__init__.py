"""The benchmarks: each ``python -m benchmarks.NAME`` from the repository root answers one question
(docs/performance.md, "Current numbers"); :mod:`benchmarks.harness` is what they share."""

"""Each ``python -m benchmarks.NAME`` answers one question (docs/performance.md); ``harness`` is what they share."""

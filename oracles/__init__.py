"""Independent oracles that the tests and the benchmarks both use (neither imports the other, and
the product imports nothing of these): the MLCommons reference's own code, loaded from a checkout."""

"""Evaluate: a checkpoint scored on the evaluation cases (the benchmark's Dice, each case's)."""

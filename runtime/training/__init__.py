"""Training: the epoch loop, evaluation during training, pre-emption and the benchmark mode."""

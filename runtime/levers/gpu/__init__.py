"""The GPU's speed levers: the training step replayed from a CUDA graph (:mod:`~runtime.levers.gpu.graphs`)."""

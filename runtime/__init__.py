"""Training and evaluation loops, distributed helpers, logging and checkpoints."""

"""Training and evaluation loops, distributed helpers, logging and checkpoints."""

# The project's version, its one source. Predict records it beside every segmentation
# (runtime.predict.provenance), so an output made by another version is segmented again: bump
# it with every change that alters what predict or evaluate computes.
__version__ = "1.0.0"

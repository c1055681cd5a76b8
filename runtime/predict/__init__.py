"""Predict: raw CT scans in, segmentations in each scan's own grid out."""

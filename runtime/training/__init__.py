"""Training: the start of a run around the MLPerf clock (shared with evaluate), the train and
``--benchmark`` bodies, the epoch loop, evaluation during training, pre-emption."""

"""Training: the train and ``--benchmark`` bodies, the epoch loop, evaluation during training,
pre-emption (the start of a run around the MLPerf clock, shared with evaluate: ``runtime.clocked``)."""

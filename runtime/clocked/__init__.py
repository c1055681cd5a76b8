"""What training, evaluate and ``--benchmark`` share, apart from both products so that neither
imports the other: where a run reports and its MLPerf clock (``reporters``), the benchmark's
evaluation on the evaluation set (``evaluation``), and the start of a run around the clock
(``start``: the checkpoint started from, the reporters, the components built before ``run_start``,
the data after it). Each module imports only those before it."""

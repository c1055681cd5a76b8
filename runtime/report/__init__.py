"""The run report: ``python -m runtime.report RUN_DIR [RUN_DIR ...] --output DIR``.

It reads, judges and scores run folders with ``runtime.results`` (shared with training and the
submission package) and writes:

* ``run_summary``: ``summary.md`` and ``summary.json``;
* ``cli``: the command line (``make_report``, ``main``): the summaries, ``curves.png``, the
  compliance verdicts.

Nothing beyond the standard library (and the project's own standard-library modules) is imported
at import: matplotlib when a figure is drawn, the checker in a subprocess.
"""

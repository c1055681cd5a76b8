"""The run report: ``python -m runtime.report RUN_DIR [RUN_DIR ...] --output DIR``.

One module per job, each importing only those before it:

* ``files``: the report's error type and its atomic file write;
* ``runs``: reading run folders (``log.json``, the MLPerf logs) into ``Run`` records;
* ``validity``: which MLPerf logs are results: the one rule of the report's score and the
  submission package (``runtime.submission`` uses it; the report uses nothing of the submission);
* ``compliance``: the MLPerf compliance checker's verdict on each MLPerf log;
* ``time_to_train``: the MLPerf time to train predicted from a speed (also ``--benchmark``'s);
* ``scoring``: a run's outcome, time to target and best Dice, the time to train predicted at its
  speed; the olympic score of several runs;
* ``run_summary``: ``summary.md`` and ``summary.json``;
* ``figure``: the training-curves figure (``curves.png``);
* ``plotter``: ``CurvePlotter``, which redraws ``<log_dir>/curves.png`` while training runs;
* ``cli``: the command line (``make_report``, ``main``).

The names of the files read and written are ``runtime/run_files.py``'s. Nothing beyond the
standard library (and the project's own standard-library modules) is imported at import:
matplotlib when a figure is drawn, the checker in a subprocess.
"""

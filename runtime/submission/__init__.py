"""``python -m runtime.submission``: an MLPerf Training submission of unet3d: the timed runs
(``runs``), the package assembled from them and checked by the official tools (``package``),
and the system description of a machine (``describe``). See docs/submission.md."""

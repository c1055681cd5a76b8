"""How a trained network's windows become logits, in one place: evaluate, predict, the benchmark
mode and the benchmarks all go through here.

- :mod:`~runtime.inference.sliding_window`: the benchmark's Gaussian-weighted sliding window;
- :mod:`~runtime.inference.predictor`: ``predict(windows) -> logits`` (eager or compiled, autocast,
  channels-last, test-time flips);
- :mod:`~runtime.inference.backends`: the backend registry (``torch``, ``openvino``), each a
  converter applied to the loaded model (the PyTorch one's inference copy:
  :func:`runtime.levers.cpu.convert.prepare_for_inference`); which one runs is decided in ``resolve()``;
- :mod:`~runtime.inference.openvino`: the OpenVINO backend (cached conversion, int8 calibration);
- :mod:`~runtime.inference.memory_budget`: how many windows fit at once (the host memory a window
  keeps for the next is :mod:`runtime.levers.cpu.host_memory`'s, which training uses too).

Nothing here imports ``runtime.predict`` or ``runtime.training``: they import this package.
"""

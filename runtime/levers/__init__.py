"""Speed levers: what a device needs beyond the plain network of ``model/``, applied as
converters (modules swapped for subclasses that keep their parameters and state_dict keys).

- :mod:`~runtime.levers.cpu`: the CPU's levers (ISA facts, host-memory reuse, the bf16 guard,
  the channels-last norms, the fast blocks, and :mod:`~runtime.levers.cpu.convert`, which
  chooses and applies them);
- :mod:`~runtime.levers.gpu`: the GPU's (CUDA graphs).

Nothing here imports ``runtime.build``, ``runtime.resolve``, ``runtime.app``,
``runtime.predict`` or ``runtime.training``: they use the levers.
"""

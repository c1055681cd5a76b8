"""The CPU's speed levers; :mod:`~runtime.levers.cpu.convert` chooses and applies them."""

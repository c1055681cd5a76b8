"""Evaluate's components: the trained network as the resolved ``--backend`` computes its windows."""
from __future__ import annotations

import dataclasses
import sys

from runtime.build import Components
from runtime.checkpoint import unwrap
from runtime.clocked.reporters import Reporters
from runtime.inference.backends import BACKENDS, say_on


def evaluation_components(components: Components, out: Reporters) -> Components:
    """``components`` for ``--exec_mode evaluate`` with the resolved backend's model as
    ``eval_model`` (unchanged with PyTorch). Evaluate scores the trained network in fp32 (int8 is
    refused by the flag checks). ``out``: the conversion's lines go to stderr with ``--verbose``
    only, since evaluate's stdout is its result (evaluate prints the backend's line there, with
    its scores)."""
    plan = components.plan
    say = say_on(out.is_main and plan.config.verbose, sys.stderr)
    if plan.inference.backend == "torch":
        return components
    module = BACKENDS[plan.inference.backend].convert(unwrap(components.model).eval(), plan.network, plan.precision,
                                                      plan.inference, say)
    return dataclasses.replace(components, eval_model=module)

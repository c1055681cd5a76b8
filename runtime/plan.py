"""The resolved plan: every decision ``runtime.resolve`` makes for a run, with its reason apart
from what the user asked.

A :class:`Decision` is plain data (strings, numbers, booleans, tuples of them), so the plan
travels in the checkpoint beside the config and loads with ``torch.load(weights_only=True)``.
The config carries the plan (``Config.plan``); :func:`decided` is the one way to add to it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Decision:
    """One decision of a run: ``value`` is what runs, ``asked`` the user's flag value or intent
    (None when no flag asks), ``why`` one line saying how ``value`` followed from it."""

    name: str
    value: Any
    why: str = ""
    asked: Any = None

    def line(self) -> str:
        """``"name: value (why)"``, one line."""
        return f"{self.name}: {_text(self.value)}" + (f" ({self.why})" if self.why else "")


def _text(value) -> str:
    return "x".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def decided(config, name: str, value, why: str = "", asked=None):
    """``config`` (a frozen dataclass with a ``plan``) with the decision ``name`` recorded; a
    later stage deciding ``name`` again (the data stage's division) replaces the earlier entry."""
    plan = tuple(d for d in config.plan if d.name != name) + (Decision(name, value, why, asked),)
    return dataclasses.replace(config, plan=plan)


def find(plan, name: str) -> Decision | None:
    """The decision ``name`` of ``plan``, or None when the run did not make it."""
    return next((d for d in plan if d.name == name), None)

"""The MLPerf compliance verdict of each MLPerf log, from the official checker
(``mlperf_logging.compliance_checker``) run in a subprocess."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Sequence

from runtime.progress import progress

DEFAULT_RULESET = "4.0.0"


@dataclass(frozen=True)
class Compliance:
    log: str
    checked: bool
    passed: bool
    problems: tuple[str, ...] = ()

    def short(self) -> str:
        if not self.checked:
            return "not checked"
        return "PASS" if self.passed else f"FAIL ({len(self.problems)} problem{'s' * (len(self.problems) != 1)})"

    def verdict(self) -> str:
        if not self.checked:
            return "not checked: " + "; ".join(self.problems)
        if self.passed:
            return "PASS"
        return f"FAIL ({len(self.problems)}): " + "; ".join(self.problems)


def _checker_problems(output: str) -> list[str]:
    """One line per problem in the checker's log (records ``LEVEL - message``): the first line
    of each message, plus the failed test of a ``CHECK for 'key' failed in line N`` message, and
    ``parse error: ...`` per line the checker's parser rejected."""
    parts = re.split(r"^(INFO|WARNING|ERROR) - ", output, flags=re.M)
    problems = []
    for level, body in zip(parts[1::2], parts[2::2]):
        if level != "WARNING":
            continue
        if body.lstrip().startswith("^^"):  # the parser's reason for the line logged before it
            problems.append("parse error: " + body.lstrip()[2:].strip())
            continue
        if not body.startswith(" ") or body.startswith("  "):  # a rejected line, or its header
            continue
        for chunk in body.split("-" * 30):
            lines = [line.strip() for line in chunk.strip().splitlines() if line.strip()]
            if not lines:
                continue
            first = lines[0].rstrip(":")
            if first.startswith("Found parsing errors"):  # the "parse error" lines say which
                continue
            test = next((line for line in lines if line.startswith("failed test:")), None)
            if first.startswith("CHECK for") and test:
                first += ": " + test[len("failed test:"):].strip()
            problems.append(" ".join(first.split()))
    return problems


def check_compliance(log: str, ruleset: str = DEFAULT_RULESET, timeout: float = 300) -> Compliance:
    """Run ``mlperf_logging.compliance_checker`` on ``log`` in a subprocess (the checker keeps
    module-level state, configures the root logger and writes its own log file: a process of
    its own keeps all that away from ours)."""
    if importlib.util.find_spec("mlperf_logging") is None:
        return Compliance(log, False, False, ("mlperf_logging is not installed: pip install mlperf-logging",))
    with tempfile.TemporaryDirectory(prefix="unet3d-compliance-") as work:
        out = os.path.join(work, "checker.log")
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                 "--ruleset", ruleset, "--log_output", out, os.path.abspath(log)],
                cwd=work, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Compliance(log, False, False, (f"the checker took more than {timeout:.0f} s",))
        text = open(out, encoding="utf-8", errors="replace").read() if os.path.isfile(out) else ""
    problems = _checker_problems(text or proc.stderr)
    if proc.returncode == 0:
        return Compliance(log, True, True)
    if not problems:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        problems = [tail[-1] if tail else f"checker exit code {proc.returncode}"]
    return Compliance(log, True, False, tuple(problems))


def check_all(logs: Sequence[str], ruleset: str) -> dict[str, Compliance]:
    """The checker's verdict for every one of ``logs`` (one checker process each, in turn; a
    progress from four logs on: :func:`runtime.progress.progress`)."""
    return {log: check_compliance(log, ruleset)
            for log in progress(logs, "compliance", len(logs), show=len(logs) >= 4, unit="log")}

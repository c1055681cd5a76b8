"""unet3d left MLPerf Training after v4.0: a score made now is "unverified" under the MLPerf results
messaging guidelines, which ask for that word beside each score and the words "Result not verified
by MLCommons Association." (issue 48, item 10). The report's summary and the package's report say
both, right after the score; the README says it where it describes results."""
import os

from runtime.report.run_summary import summary_markdown
from runtime.results.scoring import score_runs
from runtime.submission.package import report_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDELINES_SENTENCE = "Result not verified by MLCommons Association."


def said_after(lines: list[str], score_line: str) -> str:
    """The first non-empty line after the one starting with ``score_line``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(score_line))
    return next(line for line in lines[start + 1:] if line.strip())


def test_the_reports_summary_says_unverified_after_the_score():
    text = summary_markdown([], [], score_runs([]), 0.908, "4.0.0", None)
    after = said_after(text.splitlines(), "**Score**")
    assert after.startswith("Unverified") and GUIDELINES_SENTENCE in after


def test_the_packages_report_says_unverified_after_the_score():
    report = {"runs": [], "ruleset": "4.0.0", "org": "Org", "system": "sys", "package": "p", "division": "closed",
              "status": "onprem", "expected_runs": 40, "global_batch_sizes": [2], "score": "score 10.00 min",
              "checkers": {}, "not_checked": [], "system_fields_to_fill": [], "paths_without_runs": []}
    after = said_after(report_markdown(report).splitlines(), "**score 10.00 min**")
    assert after.startswith("Unverified") and GUIDELINES_SENTENCE in after


def test_the_readme_says_results_are_unverified():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        text = " ".join(handle.read().split())
    assert "**unverified**" in text and GUIDELINES_SENTENCE in text

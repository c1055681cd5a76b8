"""The documentation keeps its own rules: no references the repository cannot resolve, a table of
the current measurements first, and every pointer from the code to a section of
docs/performance.md names a section that exists."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PERFORMANCE = os.path.join(ROOT, "docs", "performance.md")
UNRESOLVABLE = re.compile(r"\bissues? \d+|#\d+\b|\bthis session\b|\blast session\b|\btoday\b", re.IGNORECASE)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def doc_files() -> list[str]:
    folder = os.path.join(ROOT, "docs")
    return [os.path.join(ROOT, "README.md")] + [
        os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith(".md")]


def test_docs_name_no_issue_or_session():
    found = [f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}"
             for path in doc_files()
             for number, line in enumerate(read(path).splitlines(), 1) if UNRESOLVABLE.search(line)]
    assert found == []


def test_performance_opens_with_the_current_numbers():
    """The first section is a table whose every row has a date, a machine and a command run as
    ``python -m benchmarks.NAME`` (or says it is not measured), one row per question."""
    sections = re.split(r"^## ", read(PERFORMANCE), flags=re.MULTILINE)
    assert sections[1].startswith("Current numbers")
    header, *rows = [line for line in sections[1].splitlines() if line.startswith("| ")]
    assert header.split("|")[3:6] == [" date ", " machine, CPU ISA ", " command "]
    assert len(rows) >= 5
    assert len({row.split("|")[1] for row in rows}) == len(rows), "one row per question"
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        assert "python -m benchmarks." in cells[4] or cells[4] == "the same", row
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", cells[2]) or "not measured" in cells[1], row
        assert cells[3] or "not measured" in cells[1], row


def test_code_points_to_existing_sections():
    headings = [line.lstrip("#").strip() for line in read(PERFORMANCE).splitlines() if line.startswith("#")]
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    pointers = [(path, name) for path in files
                for name in re.findall(r'docs/performance\.md, "([^"]+)"', read(os.path.join(ROOT, path)))]
    assert pointers, "the pattern finds no pointer: the test would pass vacuously"
    missing = [(path, name) for path, name in pointers if not any(h.startswith(name) for h in headings)]
    assert missing == []

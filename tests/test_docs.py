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


def tracked_files() -> list[str]:
    return subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split("\0")[:-1]


# A relative path that climbs out of its folder (dot-dot-slash, then a name); not the three dots of an
# elided path, not a climb inside a longer path (``$HERE/..``)
CLIMBING = re.compile(r"(?<![\w/.$}])((?:\.\./)+[A-Za-z_{][\w{}.-]*(?:/[\w{}.-]+)*)")


def test_no_file_cites_a_path_outside_the_repository():
    """A packed copy of the code (the submission's benchmarks/ folder) holds this tree alone: a
    path that climbs out of it, into a folder beside the checkout, points nowhere there. Every
    climbing relative path of a tracked text file, taken from that file's folder, names a file or
    folder of the tree."""
    if not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(os.path.join(ROOT, ".git")):
        import pytest

        pytest.skip("no git checkout")
    outside, seen = [], 0
    tracked = set(tracked_files())
    folders = {os.path.dirname(name) for name in tracked}
    while "" not in folders:
        folders |= {os.path.dirname(folder) for folder in folders}
    for name in tracked:
        path = os.path.join(ROOT, name)
        try:
            text = read(path)
        except (UnicodeDecodeError, OSError):
            continue
        for match in CLIMBING.finditer(text):
            if "{" in match.group(1):  # a template the code fills in (the package's own layout)
                continue
            seen += 1
            target = os.path.relpath(os.path.normpath(os.path.join(os.path.dirname(path), match.group(1))), ROOT)
            if target.startswith("..") or (target not in tracked and target.rstrip("/") not in folders):
                outside.append(f"{name}: {match.group(1)}")
    assert seen, "the pattern finds no climbing path at all: the test would pass vacuously"
    assert outside == []


def test_the_ignore_file_hides_no_folder_of_the_tree():
    """git itself is the oracle: no tracked file is ignored, and a new file in any tracked folder
    (runtime/results/ among them, which an unanchored ``results/`` hid) would not be."""
    if not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(os.path.join(ROOT, ".git")):
        import pytest

        pytest.skip("no git checkout")
    ignored_tracked = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=ROOT,
                                     capture_output=True, text=True, check=True).stdout.split()
    assert ignored_tracked == []
    folders = sorted({os.path.dirname(name) for name in tracked_files() if "/" in name})
    assert "runtime/results" in folders
    probes = "".join(f"{folder}/new_file.py\n" for folder in folders)
    proc = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-v"], cwd=ROOT, input=probes,
                          capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout  # 1: nothing ignored
    hidden = subprocess.run(["git", "check-ignore", "--no-index", "results/x", "demo_work/x"], cwd=ROOT,
                            capture_output=True, text=True)
    assert hidden.stdout.split() == ["results/x", "demo_work/x"]  # what the file is for still works

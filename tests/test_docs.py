"""The front door stays a front door: README.md lists every experiment of conf/experiment/ in its experiment
table and stays short, every relative link of README.md and docs/*.md reaches an existing file (and heading,
by GitHub's anchor rules), and docs/extending.md names the keypoint task's files and only paths that exist.
The last test feeds the checkers a broken README, so a checker that finds nothing cannot pass silently."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
MAX_README_LINES = 300
# the keypoint task's files, the worked example of docs/extending.md
KEYPOINT_FILES = ("disteval/tasks/keypoints.py", "disteval/metrics/coco_keypoints.py", "disteval/data/coco_keypoints.py",
                  "disteval/data/coco_keypoints_synthetic.py", "conf/data/coco_keypoints.yaml",
                  "conf/data/coco_keypoints_replay.yaml", "conf/model/keypointrcnn_resnet50_fpn.yaml",
                  "conf/experiment/coco_keypoints_replay.yaml", "tests/test_keypoints.py")
# a backticked word that starts like this and has no spaces is a path in the checkout
REPO_PREFIXES = ("disteval/", "conf/", "tests/", "scripts/", "benchmarks/", "diagnostics/", "launchers/",
                 "hydra_plugins/", "docs/", ".ci/")
REPO_FILES = ("README.md", "pyproject.toml")

LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
        elif fence is not None and stripped.startswith(fence):
            fence = None
        elif fence is None:
            out.append((n, line))
    return out


def prose(text: str) -> str:
    """``text`` with its fenced code blocks blanked (line numbers kept)."""
    lines = [""] * len(text.splitlines())
    for n, line in prose_lines(text):
        lines[n - 1] = line
    return "\n".join(lines)


def code_spans(text: str) -> list[re.Match]:
    """The code spans of prose text, paired in order as markdown pairs them (a span may cross a line end)."""
    return list(re.finditer(r"(`+)(?P<code>.+?)\1", text, re.S))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading (github-slugger): the rendered text (code spans' content, links' text),
    lower-cased, every character but letters, digits, '_', '-' and spaces removed, spaces turned into '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = LINK.sub(lambda m: m.group("text"), text)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2, ... for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, text: str) -> list[str]:
    """The relative links of a markdown file (outside code blocks and code spans) whose file or heading does
    not exist, as 'file:line: target (why)'."""
    body = prose(text)
    spans = [m.span() for m in code_spans(body)]
    bad = []
    for m in LINK.finditer(body):
        if any(a <= m.start() < b for a, b in spans):
            continue
        target = m.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.name}:{body.count(chr(10), 0, m.start()) + 1}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text())):
            bad.append(f"{where} (no heading #{anchor} in {dest.name})")
    return bad


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of every row of the first table under the heading ``heading`` (header row first)."""
    rows, inside = [], False
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if m:
            if inside and rows:
                break
            inside = m.group(2).strip() == heading
            continue
        if inside and line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif inside and rows:
            break
    return rows


def experiment_table(text: str) -> dict[str, str]:
    """``{experiment name: its command cell}`` from the README's experiment table (columns experiment,
    command, ...)."""
    rows = table_rows(text, "Experiments")
    if not rows or [c.lower() for c in rows[0][:2]] != ["experiment", "command"]:
        return {}
    return {row[0].strip("`"): row[1] for row in rows[1:] if len(row) >= 2}


def missing_experiments(text: str, names: list[str]) -> list[str]:
    """The experiments without a row of their own whose command runs ``+experiment=NAME``."""
    table = experiment_table(text)
    return [n for n in names if n not in table or f"+experiment={n}" not in table[n]]


def backticked_repo_paths(text: str) -> list[str]:
    """The code spans that look like a path in the checkout (``tests/x.py::test_y`` counts as tests/x.py)."""
    out = []
    for m in code_spans(prose(text)):
        path = m.group("code").strip().split("::")[0].rstrip(".,;:")
        if not re.search(r"\s", path) and (path.startswith(REPO_PREFIXES) or path in REPO_FILES):
            out.append(path)
    return out


def test_every_experiment_has_a_row_in_the_readme_table():
    assert EXPERIMENTS, "conf/experiment/ holds no experiment"
    assert not missing_experiments(README.read_text(), EXPERIMENTS), \
        f"README.md's experiment table lacks {missing_experiments(README.read_text(), EXPERIMENTS)}"


def test_the_readme_table_names_only_real_experiments():
    unknown = [n for n in experiment_table(README.read_text()) if n.isidentifier() and n not in EXPERIMENTS]
    assert not unknown, f"README.md's experiment table names experiments that conf/experiment/ lacks: {unknown}"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path):
    assert not broken_links(path, path.read_text()), "\n".join(broken_links(path, path.read_text()))


def test_the_readme_stays_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}: move detail to docs/)"


def test_every_docs_page_has_a_title_and_a_way_back():
    for page in DOCS:
        lines = page.read_text().splitlines()
        assert lines and lines[0].startswith("# "), f"{page.name} does not start with a '# Title' line"
        assert "](../README.md)" in page.read_text(), f"{page.name} has no link back to the README"


def test_extending_names_the_keypoint_files_and_only_paths_that_exist():
    text = (REPO / "docs" / "extending.md").read_text()
    missing = [f for f in KEYPOINT_FILES if (REPO / f).exists() and f"`{f}`" not in text]
    assert not missing, f"docs/extending.md does not mention {missing}"
    gone = sorted({p for p in backticked_repo_paths(text) if not (REPO / p).exists()})
    assert not gone, f"docs/extending.md names paths that do not exist: {gone}"


def test_the_checkers_catch_a_broken_readme(tmp_path):
    """The checkers themselves: a removed experiment row, a link to a missing file or heading, a table without
    its header and a made-up path are all found; GitHub's slugs of headings with code and punctuation."""
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `coco_replay` |"))
    assert missing_experiments(text.replace(row + "\n", ""), EXPERIMENTS) == ["coco_replay"]
    assert missing_experiments(text.replace("| experiment | command |", "| name | command |"), EXPERIMENTS) == EXPERIMENTS
    broken = text.replace("(docs/metrics.md)", "(docs/no-such-page.md)", 1).replace(
        "(docs/doctor.md)", "(docs/doctor.md#no-such-heading)", 1)
    found = broken_links(README, broken)
    assert len(found) == 2 and "no such file" in found[0] and "no heading #no-such-heading" in found[1], found
    assert backticked_repo_paths("see `disteval/tasks/nope.py` and `tests/test_keypoints.py::test_x`") == [
        "disteval/tasks/nope.py", "tests/test_keypoints.py"]
    assert slug("Mixed hardware: the canary and `dist.heterogeneous`") == "mixed-hardware-the-canary-and-distheterogeneous"
    assert slug("Quick start (fresh machine, Python 3.11)") == "quick-start-fresh-machine-python-311"
    assert slug("COCO keypoints (OKS AP/AR)") == "coco-keypoints-oks-apar"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def _drawing_script(name: str):
    """A script of scripts/ that draws a docs block from the code, and scripts/generated_block.py (which it imports
    as a sibling, as it does when run as ``python scripts/NAME.py``)."""
    import importlib
    import sys

    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    return importlib.import_module(name), importlib.import_module("generated_block")


def test_the_layout_page_s_tree_is_drawn_from_the_packages():
    """docs/layout.md's tree is scripts/layout_tree.py's output for the code as it is: a module added, moved or
    redescribed without ``python scripts/layout_tree.py --write`` fails here."""
    tree, blocks = _drawing_script("layout_tree")
    drawn = blocks.block(REPO / "docs" / "layout.md", tree.BEGIN, tree.END)
    assert drawn == tree.tree(), "docs/layout.md's tree is stale: run python scripts/layout_tree.py --write"
    for name in ("engine.py", "records.py", "cli.py"):  # the drawing is of the real tree
        assert f"    {name}" in drawn


def test_adding_a_launcher_names_every_member_of_the_protocol():
    """docs/extending.md's launcher table is tied to launchers.protocol.Launcher: every public member of the base
    class has its row, and every row names a member that exists."""
    from launchers.protocol import Launcher

    text = (REPO / "docs" / "extending.md").read_text(encoding="utf-8").split("## Adding a launcher", 1)[1]
    rows = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    members = {n for n in dir(Launcher) if not n.startswith("_")}
    assert members - rows == set(), f"docs/extending.md lacks rows for {sorted(members - rows)}"
    assert rows - members == set(), f"rows for members that do not exist: {sorted(rows - members)}"


def test_the_task_table_is_drawn_from_the_registry():
    """docs/configuration.md's task table is scripts/task_table.py's output for the registered tasks: a task or
    a data name added without ``python scripts/task_table.py --write`` fails here; the config's descriptions
    point to it rather than list some of the names."""
    table, blocks = _drawing_script("task_table")
    drawn = blocks.block(REPO / "docs" / "configuration.md", table.BEGIN, table.END)
    assert drawn == table.table(), "docs/configuration.md's task table is stale: run python scripts/task_table.py --write"
    assert all(f"| `{name}` |" in drawn for name in table.builtin_tasks())
    assert {"classification", "detection", "segmentation", "embedding"} <= set(table.builtin_tasks())
    config = (REPO / "disteval" / "config.py").read_text(encoding="utf-8")
    assert not re.search(r"digits \| fashion_mnist|classification, detection, replay", config)


def test_adding_a_task_names_every_member_of_the_task_base_class():
    """docs/extending.md is tied to disteval.tasks.Task: every public method and attribute of the base class is
    described (as `name(` or `name`) in its "Adding a task" part, so a hook added to Task without its page fails."""
    from disteval.tasks.base import Task

    text = (REPO / "docs" / "extending.md").read_text(encoding="utf-8").split("## Adding a launcher", 1)[0]
    members = sorted(n for n in dir(Task) if not n.startswith("_"))
    missing = [n for n in members if f"`{n}(" not in text and f"`{n}`" not in text]
    assert not missing, f"docs/extending.md does not describe Task's {missing}"

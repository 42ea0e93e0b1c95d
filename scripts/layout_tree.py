"""Print the tree of disteval's layer folders, drawn from the code: each folder (in layer order, lowest first)
with its package docstring's first sentence, and each module with its own. docs/layout.md holds this output
between its ``<!-- tree -->`` markers (tests/test_docs.py checks that it is current):
``python scripts/layout_tree.py`` prints it, ``--write`` replaces the block in docs/layout.md."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import generated_block  # scripts/, beside this file

REPO = Path(__file__).resolve().parent.parent
# lowest first; the domain folders, then the three folders of a run's processes
FOLDERS = ["common", "options", "metrics", "data", "comm", "models", "tasks", "job", "rank", "driver"]
BEGIN, END = "<!-- tree: python scripts/layout_tree.py --write -->", "<!-- /tree -->"


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = re.sub(r"^[A-Z][A-Z ()]+: ", "", " ".join(doc.split()))  # "DATA LAYER: datasets ..." -> "datasets ..."
    m = re.match(r"(.+?[.;])(\s|$)", text)
    text = (m.group(1) if m else text).rstrip(".;")
    return text if len(text) <= 96 else text[:96].rsplit(" ", 1)[0].rstrip(",:;(") + " ..."


def tree() -> str:
    lines = ["```"]
    for folder in FOLDERS:
        pkg = REPO / "disteval" / folder
        lines.append(f"disteval/{folder}/  {first_sentence(pkg / '__init__.py')}")
        if folder in ("job", "rank", "driver"):  # the run's processes: every module
            for path in sorted(pkg.iterdir()):
                if path.name.startswith(("_", ".")) or not (path.suffix == ".py" or (path / "__init__.py").is_file()):
                    continue
                src = path if path.suffix == ".py" else path / "__init__.py"
                name = path.name if path.suffix == ".py" else path.name + "/"
                lines.append(f"    {name:<16}{first_sentence(src)}")
    lines.append("```")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(generated_block.main(REPO / "docs" / "layout.md", BEGIN, END, tree))

"""Print the table of the built-in tasks and the data names each claims (``eval.task=auto`` picks a task by
``data.name``), drawn from the task registry (``disteval.tasks.registered_tasks``). docs/configuration.md holds
it between its ``<!-- tasks -->`` markers, and the config's descriptions point there instead of listing names
(tests/test_docs.py checks that the table is current): ``python scripts/task_table.py`` prints it, ``--write``
replaces the block."""
from __future__ import annotations

import sys
from pathlib import Path

import generated_block  # scripts/, beside this file

REPO = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- tasks: python scripts/task_table.py --write -->", "<!-- /tasks -->"


def builtin_tasks() -> dict:
    """The registered tasks that ship with disteval (a test or a user's package may register more)."""
    from disteval.tasks import registered_tasks

    return {name: cls for name, cls in registered_tasks().items() if cls.__module__.startswith("disteval.tasks.")}


def table() -> str:

    rows = ["| `eval.task` | `data.name` it claims | class |", "|---|---|---|"]
    for name, cls in sorted(builtin_tasks().items()):
        claims = ", ".join(f"`{d}`" for d in cls.data_names) or "(named only)"
        rows.append(f"| `{name}` | {claims} | `{cls.__module__}.{cls.__qualname__}` |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(generated_block.main(REPO / "docs" / "configuration.md", BEGIN, END, table))

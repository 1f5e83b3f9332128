"""The package's folders are its architecture: every import goes one way, and the checker
imports nothing but the core data types (a walk over every module's imports, lazy ones too)."""

from __future__ import annotations

import ast
from pathlib import Path

import slackswap

ROOT = Path(slackswap.__file__).parent
REPO = ROOT.parents[1]

# lower layers never import higher ones; runtime sits beside the chain, on core and the checker
LAYER = {
    "core": 0,
    "check": 1,
    "planners": 2,
    "solve": 3,
    "solve_options": 3,
    "compare": 3,
    "fit": 3,
    "workloads": 3,
    "cnn": 3,
    "plot": 3,
    "cli": 4,
    "cli_fit": 4,
    "cli_errors": 4,
    "fit_search": 3,
    "sharding": 3,
    "pipeline": 3,
    "fit_stages": 3,
    "demo": 4,
    "distributed": 4,
    "hf": 4,
    "lightning": 4,
    "loop": 4,
    "refine": 4,
    "refinements": 4,
}
APPLICATION = 4  # the command line and the demo may drive the runtime (profile, apply)
RUNTIME = "runtime"
# the checker's whole world: data types and what a budget means, no model, no planner
# the data types, with the graph's own rules (core/graph_rules.py: checked when a graph is made),
# and the checker's own parts
CHECKER_MAY_IMPORT = {
    "check.validate",
    "check.walk",
    "check.timeline",
    "check.schedule_checks",
    "check.violation",
    "core.graph",
    "core.graph_rules",
    "core.plan",
    "core.status",
    "core.hardware",
    "core.errors",
    "core.units",
    "core.pipeline",
}
# none: the plan's torch policy is the runtime's (ss.checkpoint_policy)
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, top_only: bool = False) -> set[str]:
    """Every slackswap module ``path`` imports, at the top or (unless ``top_only``) inside a
    function."""
    mod = _module(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found = set()
    tree = ast.parse(path.read_text())
    for node in tree.body if top_only else ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("slackswap"):
                target = node.module.removeprefix("slackswap").lstrip(".")
            else:
                continue
            names = [a.name for a in node.names]
            for name in names:  # "from . import x" may name a module
                full = f"{target}.{name}" if target else name
                found.add(
                    full if (ROOT / full.replace(".", "/")).with_suffix(".py").exists() else target
                )
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("slackswap."):
                    found.add(a.name.removeprefix("slackswap."))
    found.discard("")
    return found


def _modules(top_only: bool = False) -> dict[str, set[str]]:
    return {_module(p): _imports(p, top_only) for p in ROOT.rglob("*.py") if _module(p)}


def _layer(mod: str):
    top = mod.split(".")[0]
    return RUNTIME if top == RUNTIME else LAYER[top]


def test_every_module_has_a_layer():
    for mod in _modules():
        _layer(mod)  # KeyError names a module outside the layout


def test_no_import_goes_up_the_chain():
    bad = []
    for mod, deps in _modules().items():
        mine = _layer(mod)
        for dep in deps:
            theirs = _layer(dep)
            if (mod, dep) in ALLOWED_UPWARD:
                continue
            if mine == RUNTIME:
                # the runtime runs no plan the checker refuses: it may ask the checker; and it
                # replays its log through the simulator's rules (runtime/positions.py)
                ok = theirs == RUNTIME or theirs == 0 or dep in ("check.validate", "check.simulate")
            elif theirs == RUNTIME:
                ok = mine == APPLICATION
            else:
                ok = theirs <= mine
            if not ok:
                bad.append(f"{mod} imports {dep}")
    assert not bad, bad


def test_checker_imports_only_core_data_types():
    """Everything check/validate.py and check/validate_stage.py import (lazily too), and what
    those load with them."""
    mods = _modules(top_only=True)
    seen, todo = set(), ["check.validate", "check.validate_stage"]
    mods["check.validate"] = _imports(ROOT / "check" / "validate.py")
    mods["check.validate_stage"] = _imports(ROOT / "check" / "validate_stage.py")
    while todo:
        mod = todo.pop()
        for dep in mods[mod]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    assert seen <= CHECKER_MAY_IMPORT, sorted(seen - CHECKER_MAY_IMPORT)
    assert "core.stepmodel" not in seen and "check.simulate" not in seen


def test_the_walk_sees_imports(tmp_path):
    """The walk itself: an import written inside a function is found (the loop imports the
    executor where it opens a plan's context), and one at the top."""
    deps = _imports(ROOT / "loop.py")
    assert "runtime.executor" in deps and "core.errors" in deps
    assert "runtime.executor" not in _imports(ROOT / "loop.py", top_only=True)


def test_the_public_functions_say_their_arguments_and_results():
    """Every public function (``ss.<name>``, lazy ones too) documents its arguments (Args:)
    and its result (Returns:), Google style, so ``help()`` answers without the source."""
    import inspect

    names = list(slackswap.__all__) + list(slackswap._LAZY)
    missing = []
    for name in names:
        obj = getattr(slackswap, name)
        if not inspect.isfunction(obj):
            continue
        doc = inspect.getdoc(obj) or ""
        signature = inspect.signature(obj)
        if signature.parameters and "Args:" not in doc:
            missing.append(f"{name}: Args")
        if signature.return_annotation not in (None, "None") and "Returns:" not in doc:
            missing.append(f"{name}: Returns")
    assert not missing, missing


def _retired_names() -> dict[str, str]:
    """The glossary's "Retired names": each retired word and the term that replaced it."""
    import re

    glossary = (REPO / "formulations" / "glossary.md").read_text()
    section = glossary.split("## Retired names", 1)[1]
    return dict(re.findall(r"^- `([A-Za-z_]+)`: \*\*([^*]+)\*\*", section, flags=re.M))


def _retired_words_in(paths: list[Path], retired: dict[str, str]) -> list[str]:
    """Every line of ``paths`` that uses a retired word, as ``path:line: word`` (Python's
    ``__slots__`` and torch's ``get_proxy_slot`` aside, and the glossary's own list of them)."""
    import re

    found = []
    for path in paths:
        text = path.read_text().replace("__slots__", "").replace("get_proxy_slot", "")
        if path.name == "glossary.md":
            text = text.split("## Retired names", 1)[0]
        for line_no, line in enumerate(text.splitlines(), 1):
            found += [f"{path}:{line_no}: {w}" for w in retired if re.search(w, line, flags=re.I)]
    return found


def test_the_glossarys_retired_names_are_gone():
    """One term per concept: a word the glossary retired (``slot`` for position) appears in no
    identifier, comment or document."""
    retired = _retired_names()
    assert retired.get("slot") == "position", "the glossary lost its Retired names section"
    paths = [REPO / "README.md", *(REPO / "formulations").glob("*.md")]
    paths += [*(REPO / "docs").glob("*.md"), *ROOT.rglob("*.py")]
    assert not _retired_words_in(paths, retired)


def test_the_retired_names_search_finds_a_retired_word(tmp_path):
    """The search above on a module that uses one (in a name, in any case) and one that only
    has ``__slots__``: the first line found, the second not."""
    used = tmp_path / "used.py"
    used.write_text("def bwd_Slot(op):\n    return op\n")
    clean = tmp_path / "clean.py"
    clean.write_text("class A:\n    __slots__ = ()\n")
    assert _retired_words_in([used, clean], {"slot": "position"}) == [f"{used}:1: slot"]


def test_no_module_function_or_signature_outgrows_its_limits():
    """The sizes a newcomer can read: no file in src/ over 600 lines, no function over 120
    (docstring and comments included), no public function with more than 8 positional
    parameters (self and cls aside)."""
    import ast

    over = []
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        where = path.relative_to(ROOT)
        if text.count("\n") > 600:
            over.append(f"{where}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            if length > 120:
                over.append(f"{where}:{node.name}: {length} lines")
            positional = [a.arg for a in node.args.posonlyargs + node.args.args]
            positional = [a for a in positional if a not in ("self", "cls")]
            if not node.name.startswith("_") and len(positional) > 8:
                over.append(f"{where}:{node.name}: {len(positional)} positional parameters")
    assert not over, over


# numerical tolerances (not tuned: they say when two floats are the same) and the scaling's
# ranges (planners/scaling.py: one module of their own)
NOT_TUNING = {
    "minimal.py": {"SAME_STEP"},
    "local_search.py": {"STALL_TOLERANCE_S"},
    "lpmodel.py": {"IPM_MARGIN", "PIQP_GAP"},
}


def _numeric_constants(path: Path) -> list[str]:
    """The module-level UPPER_CASE names bound to a number (or a negated one) in ``path``."""
    import ast

    names = []
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        value = getattr(node, "value", None)
        if isinstance(value, ast.UnaryOp):
            value = value.operand
        number = isinstance(value, ast.Constant) and isinstance(value.value, (int, float))
        for target in targets:
            if isinstance(target, ast.Name) and target.id.isupper() and number:
                names.append(target.id)
    return names


def test_the_planners_tuning_constants_live_in_one_module():
    """A planner's calibrated number (a size limit, a rate, a share) is in planners/
    limits.py with its reason, its measurement in docs/tuning.md: found anywhere else in
    planners/, it fails here."""
    planners = ROOT / "planners"
    elsewhere = []
    for path in planners.rglob("*.py"):
        if path.name in ("limits.py", "scaling.py"):
            continue
        allowed = NOT_TUNING.get(path.name, set())
        found = [n for n in _numeric_constants(path) if n not in allowed]
        elsewhere += [f"{path.relative_to(ROOT)}: {n}" for n in found]
    assert not elsewhere, elsewhere


def test_the_constant_finder_sees_a_number_and_not_a_name(tmp_path):
    """The finder above on a module with a number, a negative one, a string and an alias."""
    module = tmp_path / "m.py"
    module.write_text('LIMIT = 1_500\nFLOOR = -1e-3\nNAME = "x"\nALIAS = LIMIT\nlower = 3\n')
    assert _numeric_constants(module) == ["LIMIT", "FLOOR"]


def test_the_exact_planner_is_one_way():
    """planners/exact/ builds on the rest of planners/, never the other way: no module that
    exact/ imports (or what that imports in turn) imports anything under exact/."""
    mods = _modules()
    exact = {m for m in mods if m.startswith("planners.exact")}
    todo = [d for m in exact for d in mods[m] if d.startswith("planners.") and d not in exact]
    seen: set[str] = set()
    while todo:
        mod = todo.pop()
        if mod in seen or mod not in mods:
            continue
        seen.add(mod)
        todo.extend(d for d in mods[mod] if d.startswith("planners.") and d not in exact)
    back = sorted(f"{m} imports {d}" for m in seen for d in mods[m] if d in exact)
    assert seen and not back, back


def _bare_status_words(path: Path) -> list[str]:
    """String literals in code (not docstrings, not text inside an f-string) that spell a
    status: each should be core.status.Status."""
    from slackswap.core.status import Status

    # "heuristic" and "baseline" also name planners; the words that are statuses alone
    words = {str(s) for s in Status} - {Status.HEURISTIC, Status.BASELINE}
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in ast.walk(node))
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                skip.add(id(body[0].value))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in words
        and id(node) not in skip
    ]


def test_every_status_is_the_status_type():
    """A status is written as ``Status.X`` wherever code sets or compares one (core/status.py
    alone spells the words)."""
    found = [
        hit
        for path in sorted(ROOT.rglob("*.py"))
        # the solver child's script speaks JSON to its parent and imports nothing of the package
        if path.name not in ("status.py", "native_worker.py")
        for hit in _bare_status_words(path)
    ]
    assert not found, found


def test_the_status_finder_sees_a_bare_word(tmp_path):
    module = ROOT / "core" / "_probe_status.py"
    module.write_text('"""doc: optimal"""\nx = "optimal"\ny = f"{x} optimal"\n')
    try:
        assert [h.split(": ", 1)[1] for h in _bare_status_words(module)] == ["'optimal'"]
    finally:
        module.unlink()


def test_mypy_checks_every_module_of_the_package():
    """`make lint` type-checks the files listed under [tool.mypy]; a module left off the list
    would go unchecked without anyone noticing."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["files"])
    for path in sorted(ROOT.rglob("*.py")):
        assert str(path.relative_to(REPO)) in listed, f"{path.relative_to(REPO)} not in mypy"

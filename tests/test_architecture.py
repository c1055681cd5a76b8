"""The tree's architecture as docs/development.md states it, read from the code's own imports
(every ``import`` statement, at module level or inside a function): no import circle; ``model/``
and ``data_loading/`` use nothing of ``runtime/``; the speed levers and the inference engines
are used by the run's assembly, they do not use it; the benchmarks import nothing from the
tests; ``model/`` is the network, losses and metric only; a product (training, evaluate, predict,
report, submission) uses no other product but those :data:`MAY_USE` names, and what products
share uses none; the product imports nothing of ``oracles/``."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("model", "data_loading", "runtime", "benchmarks", "oracles")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _sources() -> dict[str, str]:
    """Module name -> file path, for the product's code and its tests."""
    files = {}
    for top in PACKAGES + ("tests",):
        for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "deploy")]
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    files[_module_name(path)] = path
    for script in ("main.py", "preprocess_dataset.py"):
        files[script[:-3]] = os.path.join(ROOT, script)
    return files


def _imports(path: str, module: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports (``from a import b`` counts ``a.b`` when
    that is a module, else ``a``)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = _sources()
    known = set(files)
    return {module: _imports(path, module, known) for module, path in files.items()}


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle(graph):
    product = {m: {d for d in deps if not _under(d, ("tests",))} for m, deps in graph.items()
               if not _under(m, ("tests",))}
    assert _circles(product) == []


def test_the_checker_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _offending(graph, users, forbidden) -> dict[str, list[str]]:
    return {m: sorted(d for d in deps if _under(d, forbidden))
            for m, deps in graph.items() if _under(m, users) and any(_under(d, forbidden) for d in deps)}


def test_model_and_data_loading_use_nothing_of_runtime(graph):
    assert _offending(graph, ("model", "data_loading"), ("runtime", "benchmarks", "tests")) == {}


def test_levers_and_inference_are_used_not_users(graph):
    users = ("runtime.levers", "runtime.inference")
    assembly = ("runtime.build", "runtime.resolve", "runtime.app", "runtime.predict", "runtime.training",
                "runtime.evaluate", "runtime.clocked")
    assert any(_under(m, ("runtime.levers",)) for m in graph), "runtime/levers/ is where the speed levers live"
    assert _offending(graph, users, assembly) == {}


# The products: each a folder of runtime/ behind one command or exec mode. What several of them
# share lives outside every product (runtime/clocked/, runtime/results/, the modules at the top of runtime/).
PRODUCTS = ("runtime.training", "runtime.evaluate", "runtime.predict", "runtime.report", "runtime.submission")
# Which product may use which (docs/development.md, "Layout"): none uses another. What reads and
# scores run folders for the report, the submission package and training (--plot's curves,
# --benchmark's predicted time to train) is runtime/results/, shared, not a product.
MAY_USE: dict[str, set[str]] = {}


def _product(module: str) -> str | None:
    return next((p for p in PRODUCTS if _under(module, (p,))), None)


def _product_arrows(graph, may_use) -> dict[str, list[str]]:
    """Module -> the modules of another product it imports that ``may_use`` does not allow."""
    found = {}
    for module, deps in graph.items():
        user = _product(module)
        if user is None:
            continue
        wrong = sorted(d for d in deps if _product(d) not in (None, user) and _product(d) not in may_use.get(user, ()))
        if wrong:
            found[module] = wrong
    return found


def test_products_use_only_the_products_they_may(graph):
    assert all(_product(m) for m in graph if _under(m, PRODUCTS)) and all(any(_under(m, (p,)) for m in graph)
                                                                          for p in PRODUCTS)
    assert _product_arrows(graph, MAY_USE) == {}


def test_the_product_rule_finds_a_forbidden_arrow():
    graph = {"runtime.evaluate.body": {"runtime.training.loop", "runtime.clocked.start"},
             "runtime.training.loop": {"runtime.clocked.evaluation", "runtime.results.plotter"},
             "runtime.training.bodies": {"runtime.report.plotter"},
             "runtime.report.scoring": {"runtime.submission.validity"}}
    assert _product_arrows(graph, MAY_USE) == {"runtime.evaluate.body": ["runtime.training.loop"],
                                              "runtime.training.bodies": ["runtime.report.plotter"],
                                              "runtime.report.scoring": ["runtime.submission.validity"]}
    assert _product_arrows(graph, {"runtime.training": {"runtime.report"}}) == {
        "runtime.evaluate.body": ["runtime.training.loop"], "runtime.report.scoring": ["runtime.submission.validity"]}


def test_products_use_each_other_in_one_direction():
    """The table itself: no product may use one that may use it (directly or not)."""
    edges = {user: set(used) for user, used in MAY_USE.items()}
    assert _circles(edges) == [] and all(user not in used for user, used in MAY_USE.items())


def test_shared_modules_use_no_product(graph):
    """What products share is below them: no shared module imports a product (the lifecycle reaches
    a mode's body by its ``"module:function"`` name, imported when the mode runs)."""
    shared = {m: sorted(d for d in deps if _product(d)) for m, deps in graph.items()
              if _under(m, ("runtime",)) and _product(m) is None}
    assert {"runtime.app", "runtime.clocked.start", "runtime.results.plotter"} <= set(shared)
    assert {m: used for m, used in shared.items() if used} == {}


def test_benchmarks_import_nothing_from_tests(graph):
    assert _offending(graph, ("benchmarks",), ("tests",)) == {}


def test_the_oracles_are_used_by_the_tests_and_benchmarks_only(graph):
    """oracles/ (the MLCommons reference's loader) is not the product: nothing the product runs
    imports it, and it imports neither the tests nor the benchmarks that use it."""
    assert any(_under(m, ("oracles",)) for m in graph), "oracles/ is where the reference's loader lives"
    product = ("model", "data_loading", "runtime", "main", "preprocess_dataset")
    assert _offending(graph, product, ("oracles",)) == {}
    assert _offending(graph, ("oracles",), ("tests", "benchmarks")) == {}


def _lines(paths) -> int:
    return sum(sum(1 for _ in open(p, encoding="utf-8")) for p in paths)


def _python_files(folder: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(os.path.join(ROOT, folder)) for n in names
            if n.endswith(".py")]


def test_model_is_the_network_only():
    """At most 400 lines, and none of the speed code that lives in runtime/levers/: no autograd
    Function, no private PyTorch API, no switch set from outside."""
    files = _python_files("model")
    assert _lines(files) <= 400
    for path in files:
        text = open(path, encoding="utf-8").read()
        for sign in ("autograd.Function", "._conv_forward", "channels_last", "torch.compile", "mkldnn"):
            assert sign not in text, f"{os.path.relpath(path, ROOT)}: {sign}"


def test_build_components_calls_the_levers_once():
    tree = ast.parse(open(os.path.join(ROOT, "runtime", "build.py"), encoding="utf-8").read())
    lever_names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and (node.module or "").startswith("runtime.levers") for alias in node.names}
    build = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_components")
    calls = [n.func.id for n in ast.walk(build) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in lever_names]
    assert len(calls) == 1, calls


def test_sizes_a_newcomer_can_read():
    assert _lines([os.path.join(ROOT, "docs", "performance.md")]) <= 400
    # 1600 until issue 58 (check, plan, run in bench_throughput; the convolution floor as code, not a string)
    assert _lines(_python_files("benchmarks")) <= 1660

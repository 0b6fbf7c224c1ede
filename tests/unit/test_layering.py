"""The import graph: no cycles between modules, and subsystems import one way only.

The check reads every `import` in autoshard/, passes/ and kernels/ (function-level and
TYPE_CHECKING imports included), the same way `python -m tests.harness.imports` prints it.
"""
from tests.harness.imports import ALLOWED, TOP_LEVEL, cycles, import_graph, layer_violations


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_subsystems_import_one_way():
    assert layer_violations(import_graph()) == []


def test_every_subsystem_has_a_rule():
    layers = {m.split(".")[1] for m in import_graph() if m.count(".") >= 1}
    assert layers <= set(ALLOWED) | TOP_LEVEL, layers - set(ALLOWED) - TOP_LEVEL


def test_the_checker_sees_a_cycle_and_a_backwards_import():
    graph = {"autoshard.passes.a": {"autoshard.runtime.b"}, "autoshard.runtime.b": {"autoshard.passes.a"}}
    assert cycles(graph) == [["autoshard.passes.a", "autoshard.runtime.b"]]
    assert layer_violations(graph) == ["autoshard.passes.a imports autoshard.runtime.b (passes may not import runtime)"]


def test_each_import_up_a_layer_is_inside_a_function():
    """CALLS_UP's imports run at call time: at module level they would make a cycle at import."""
    import ast
    import pathlib

    from tests.harness.imports import CALLS_UP, ROOT
    for (module, target), _why in CALLS_UP.items():
        path = pathlib.Path(ROOT, "autoshard", *module.split(".")[1:]).with_suffix(".py")
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == target]
        inner = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == target]
        assert inner and not top, (module, target)

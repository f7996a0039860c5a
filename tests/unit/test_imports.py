"""Imports point one way: no cycle among the project's modules (imports inside functions counted), and no project
module imported inside a function (those imports only hid cycles). Read from the source with ast."""
from tests.helpers import import_graph


def test_no_import_cycle():
    cycles = import_graph.build().cycles()
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_cycle_among_the_benchmarks():
    """benchmarks/ scripts import one another's helpers (attention.py and tune.py once imported each other)."""
    cycles = import_graph.build({"benchmarks": "benchmarks"}).cycles()
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_function_level_project_import():
    found = import_graph.build().function_imports
    assert found == [], "import these at module level (or break the cycle they hide):\n" + "\n".join(
        f"  {m}:{line} imports {t}" for m, line, t in found)


def test_the_graph_sees_cycles_and_function_imports(tmp_path, monkeypatch):
    """The checker itself can fail: a made-up package with a cycle and a function-level import."""
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "a.py").write_text("from flash_forensics.kernels import b\n")
    (pkg / "b.py").write_text("def f():\n    from flash_forensics.kernels.a import x\n")
    for name in ("flash_forensics", "models", "orchestrator"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(import_graph, "ROOT", tmp_path)
    g = import_graph.build()
    assert g.cycles() == [["flash_forensics.kernels.a", "flash_forensics.kernels.b"]]
    assert g.function_imports == [("flash_forensics.kernels.b", 2, "flash_forensics.kernels.a")]

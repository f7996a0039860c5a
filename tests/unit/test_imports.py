"""Imports point one way: no cycle among the project's modules (imports inside functions counted), and no project
module imported inside a function (those imports only hid cycles). Read from the source with ast. And no command pays
for dynamo's import before it compiles."""
import subprocess
import sys

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


def test_a_command_that_never_compiles_does_not_import_dynamo():
    """torch.compiler's decorators import dynamo (about a second): applied at import, every command paid it."""
    code = ("import sys, flash_forensics, flash_forensics.orchestrator.launch.task, flash_forensics.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout

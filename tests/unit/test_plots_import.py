"""orchestrator/report/plots.py imports pyplot at its first plot: every run.py process imports the module (through
the sweep report), and many draw nothing (a sweep's jobs on SLURM, DDP's other ranks, a refused config)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import sys
import flash_forensics.orchestrator.launch.task  # what run.py's job imports
from flash_forensics.orchestrator.report import plots
assert "matplotlib.pyplot" not in sys.modules, "pyplot imported before any plot"
assert len(plots.palette(3)) == 3
assert "matplotlib.pyplot" in sys.modules, "the first plot must import it"
import matplotlib
assert matplotlib.get_backend().lower() == "agg", matplotlib.get_backend()  # headless, as before
"""


def test_a_job_imports_pyplot_only_when_it_plots():
    r = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]

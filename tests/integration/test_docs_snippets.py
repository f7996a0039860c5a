"""The GUIDE's "Your own model" snippet runs as written (a user pastes it first)."""
from pathlib import Path

import pytest

pytest.importorskip("transformers")
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "GUIDE.md"


def _snippet(section: str) -> str:
    text = GUIDE.read_text()
    start = text.index("```python\n", text.index(section)) + len("```python\n")
    return text[start:text.index("```\n", start)]


def test_the_own_model_snippet_runs_as_written(capsys):
    code = _snippet("## Your own model")
    assert "flash_forensics.use(" in code and "Monitor(" in code
    exec(compile(code, f"{GUIDE}: Your own model", "exec"), {"__name__": "guide"})
    rmax, logit = capsys.readouterr().out.split()
    assert float(rmax) >= 0 and float(logit) > 0  # the Monitor counted rows of layer 1 and measured its logits

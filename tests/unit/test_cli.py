"""`flash-forensics TOOL`: every tool's module exists and has main(argv); the help lists them; a wrong name says so."""
import importlib
import subprocess
import sys

import pytest

from flash_forensics import cli


@pytest.mark.parametrize("tool", sorted(cli.TOOLS))
def test_each_tool_has_a_main(tool):
    module = importlib.import_module(cli.TOOLS[tool][0])
    assert callable(getattr(module, "main", None)), tool


def test_help_lists_every_tool(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.TOOLS)


def test_unknown_tool_names_the_choices(capsys):
    assert cli.main(["isolat"]) == 2
    err = capsys.readouterr().err
    assert "unknown tool 'isolat'" in err and "isolate" in err


@pytest.mark.parametrize("tool, commands", [("fork", "{list,pick,jobs}"), ("forensics", "{add,example,pv-trace}"),
                                             ("data", "{prepare,fetch,tokenizer}")])
def test_a_missing_command_names_the_commands(tool, commands, capsys):
    """`flash-forensics fork` said 'the following arguments are required: cmd' (the parser's internal name)."""
    with pytest.raises(SystemExit) as e:
        cli.main([tool])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"the following arguments are required: {commands}" in err, err


def test_a_tool_runs_through_the_command():
    r = subprocess.run([sys.executable, "-m", "flash_forensics.cli", "forensics", "add", "-2.4071154594421387",
                        "-2.296875"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "BF16 result -4.71875" in r.stdout


def test_a_closed_pipe_ends_the_tool_quietly_with_exit_0(monkeypatch, capsys):
    """`flash-forensics early-warning ... | head`: the reader closing the pipe is no error (it was
    'BrokenPipeError' and exit 1); stdout goes to /dev/null so that the final flush says nothing either."""
    import flash_forensics.orchestrator.analysis.early_warning as ew
    from flash_forensics import cli as cli_mod

    def closed(argv):
        raise BrokenPipeError(32, "Broken pipe")

    quieted = []
    monkeypatch.setattr(ew, "main", closed)
    monkeypatch.setattr(cli_mod, "_quiet_stdout", lambda: quieted.append(True))
    assert cli_mod.main(["early-warning", "x"]) == 0 and quieted == [True]
    assert "BrokenPipe" not in capsys.readouterr().err

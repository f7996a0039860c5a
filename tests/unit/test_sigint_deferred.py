"""A ^C (SIGINT) that lands while torch.save writes a checkpoint (preemption.sigint_deferred, around
checkpoint_policy.save): held until the file is whole, then delivered; without the guard the same ^C leaves a
broken write, not a clean interrupt."""
import os
import signal

import pytest
import torch

from flash_forensics.orchestrator.job import checkpoint
from flash_forensics.orchestrator.job.preemption import sigint_deferred

STATE = {"resume": {"w": torch.arange(300_000, dtype=torch.float32)}}


@pytest.fixture
def sigint_mid_write(monkeypatch):
    """The first write of the checkpoint's bytes sends this process a SIGINT, as a user's ^C would."""
    orig, sent = checkpoint._HashingWriter.write, []
    # Python's own ^C handler, whatever this process inherited (started in the background, a shell ignores SIGINT)
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)

    def write(self, b):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return orig(self, b)

    monkeypatch.setattr(checkpoint._HashingWriter, "write", write)
    yield sent
    signal.signal(signal.SIGINT, prev)


def test_a_sigint_mid_write_is_delivered_after_the_checkpoint_is_whole(tmp_path, sigint_mid_write):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            checkpoint.save(tmp_path / "step.pt", STATE)
            done.append(True)  # reached: nothing interrupted the block
    assert sigint_mid_write and done
    assert checkpoint.verify(tmp_path / "step.pt")
    assert torch.equal(checkpoint.load(tmp_path / "step.pt")["resume"]["w"], STATE["resume"]["w"])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back


def test_without_the_guard_the_same_sigint_breaks_the_write(tmp_path, sigint_mid_write):
    with pytest.raises((KeyboardInterrupt, RuntimeError)):  # RuntimeError: from torch.s zip writer
        checkpoint.save(tmp_path / "step.pt", STATE)
    assert sigint_mid_write and not (tmp_path / "step.pt").exists()


def test_a_custom_handler_gets_the_held_signal_once(tmp_path, sigint_mid_write):
    got = []
    prev = signal.signal(signal.SIGINT, lambda s, f: got.append(s))
    try:
        with sigint_deferred():
            checkpoint.save(tmp_path / "step.pt", STATE)
            assert got == []  # held while the block runs
        assert got == [signal.SIGINT]
        assert checkpoint.verify(tmp_path / "step.pt")
    finally:
        signal.signal(signal.SIGINT, prev)


def test_no_sigint_no_interrupt(tmp_path):
    with sigint_deferred():
        checkpoint.save(tmp_path / "step.pt", STATE)
    assert checkpoint.verify(tmp_path / "step.pt")

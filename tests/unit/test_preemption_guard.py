"""PreemptionGuard on its own (no cluster): the signal becomes a flag, submitit's handler is chained, not lost."""
import os
import signal

import pytest

from flash_forensics.orchestrator.job.preemption import REQUEUE_EXIT_CODE, PreemptionGuard, preempt_signal


def test_signal_sets_the_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGUSR2)
    with PreemptionGuard() as guard:
        assert not guard.requested and not guard.should_stop(0)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert guard.requested and guard.should_stop(1) and guard.signum == signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR2) == before


def test_submitit_handler_is_called_at_the_step_boundary_not_at_the_signal(monkeypatch):
    """Under submitit the guard defers submitit's checkpoint-and-requeue handler to exit_for_requeue()."""
    calls = []

    def submitit_handler(signum, frame):  # stands in for SignalHandler.checkpoint_and_try_requeue
        calls.append(signum)
        raise SystemExit(-1)

    monkeypatch.setenv("SUBMITIT_FOLDER", "/tmp/x")
    previous = signal.signal(signal.SIGUSR2, submitit_handler)
    try:
        guard = PreemptionGuard().install()
        assert guard.signals == [signal.SIGUSR2]  # SIGTERM stays with submitit (it ignores it on purpose)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert guard.requested and calls == []  # nothing happened mid-step
        with pytest.raises(SystemExit) as e:
            guard.exit_for_requeue("step 7")
        assert calls == [signal.SIGUSR2] and e.value.code == -1
        assert signal.getsignal(signal.SIGUSR2) is submitit_handler  # restored for submitit
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_without_a_scheduler_the_guard_exits_with_the_requeue_code(monkeypatch):
    monkeypatch.delenv("SUBMITIT_FOLDER", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    guard = PreemptionGuard().install()
    assert signal.SIGTERM in guard.signals
    os.kill(os.getpid(), signal.SIGTERM)
    assert guard.requested
    with pytest.raises(SystemExit) as e:
        guard.exit_for_requeue()
    assert e.value.code == REQUEUE_EXIT_CODE


def test_preempt_signal_follows_submitit_env(monkeypatch):
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    assert preempt_signal() == signal.SIGUSR1

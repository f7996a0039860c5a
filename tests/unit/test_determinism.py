"""orchestrator/job/determinism.py: what the deterministic scope changes in inductor's code, and what it restores."""
import os

import torch

from flash_forensics.orchestrator.job.determinism import CUBLAS_WORKSPACE, deterministic_algorithms


def test_the_embedding_backward_compiles_without_atomics_inside_the_scope():
    """The cause of compiled runs that did not reproduce (an H100, 2026-12-07): inductor lowers an embedding's
    backward over repeated token ids to atomic adds; inside the scope it calls aten's index_put_ (deterministic)."""
    from torch._inductor.utils import run_and_get_code
    emb = torch.nn.Embedding(50, 8)
    idx = torch.randint(0, 5, (4, 16), generator=torch.Generator().manual_seed(0))  # every id repeats

    def step(i):
        emb(i).square().sum().backward()
    code, threads = {}, torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs one thread a process (tests/conftest.py): inductor's CPU code adds
    try:                      # without atomics there, and GPU code always has them
        for on in (False, True):
            torch._dynamo.reset()
            with deterministic_algorithms(on):
                code[on] = "\n".join(run_and_get_code(torch.compile(step), idx)[1])
    finally:
        torch.set_num_threads(threads)
    assert "atomic_add" in code[False] and "index_put" not in code[False]
    assert "atomic_add" not in code[True] and "index_put" in code[True]


def test_the_scope_sets_and_restores_the_process_settings(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    with deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory is False  # no NaN fill of every new tensor
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # set by the scope, unset after: no child process inherits it
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory) == before
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own choice is kept
    with deterministic_algorithms():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    try:
        with deterministic_algorithms():
            raise RuntimeError("a failing job")
    except RuntimeError:
        pass
    assert torch.are_deterministic_algorithms_enabled() == before[0]


def test_an_op_without_a_deterministic_form_is_named_once_and_the_warning_still_shows():
    import warnings

    from torch._prims_common import alert_not_deterministic  # the message torch's C++ ops give too
    seen = []
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with deterministic_algorithms(seen=seen):
            for _ in range(2):
                alert_not_deterministic("scatter_add_cuda_kernel")
            alert_not_deterministic("index_add_cuda_")
        alert_not_deterministic("after_the_scope")  # deterministic algorithms are off again: no warning
    assert seen == ["scatter_add_cuda_kernel", "index_add_cuda_"]
    assert sum("does not have a deterministic implementation" in str(w.message) for w in shown) == 3

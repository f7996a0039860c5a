"""The SFA edge-case matrix (kernels/sfa_matrix.py): the guarded variant is right in every cell, the exact
Algorithm 3's failures are counted by AttnStats, and the committed table is what the code gives today."""
from pathlib import Path

import pytest
import torch

from flash_forensics.kernels.config import AttentionKnobs
from flash_forensics.kernels.emulator import capture_forward, flash_attention
from flash_forensics.kernels.sfa_matrix import TOL, markdown, matrix, ok
from flash_forensics.kernels.stats import AttnStats

TABLE = Path(__file__).resolve().parents[2] / "results" / "bench" / "sfa_edge_matrix.md"


@pytest.fixture(scope="module")
def rows():
    return matrix()


def test_guarded_has_no_nan_no_zero_rows_and_bf16_error_in_every_cell(rows):
    guarded = [r for r in rows if r["softmax"] == "stabilized_guarded"]
    assert len(guarded) == 6 * 4 * 3 * 2
    bad = [r for r in guarded if not ok(r)]
    assert not bad, bad[:3]
    assert all(r["underflow_rows"] == 0 for r in guarded)


def test_exact_failures_are_counted_not_silent(rows):
    exact = [r for r in rows if r["softmax"] == "stabilized"]
    failed = [r for r in exact if not ok(r)]
    assert len(failed) >= 48  # rm = 200 / 1000 at beta 2, rm = -200 everywhere, ... (the findings)
    assert all(r["underflow_rows"] > 0 or r["sfa_p1_rows"] > 0 for r in failed), \
        [r for r in failed if not (r["underflow_rows"] or r["sfa_p1_rows"])][:3]
    big = {(r["rm"], r["recipe"]): r for r in failed if r["beta"] == 2.0 and r["tiling"]}
    assert big[(200, "fa2")]["nan"] > 0 and big[(200, "paper_bf16")]["zero_rows"] > 0


def test_beta_near_one_rounds_back_to_one_in_bf16_and_is_counted(rows):
    cell = next(r for r in rows if (r["rm"], r["beta"], r["recipe"], r["tiling"], r["softmax"]) ==
                (10, 1.0001, "fa2", True, "stabilized"))
    assert cell["sfa_p1_rows"] > 0


def test_committed_table_is_current(rows):
    assert TABLE.read_text() == markdown(rows), "rerun: flash-forensics sfa-matrix --out " + str(TABLE)


@pytest.mark.parametrize("recipe", ["paper_bf16", "fa2", "fp32"])
def test_guarded_leaves_no_pbar_equal_one_where_it_fires(recipe):
    """Repeated maxima at the row max (random scores, many ties after BF16 rounding): no P̄ = 1 in fired rows."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 40, 16).round()
    k = torch.randn(2, 2, 40, 16).round()
    v = torch.randn(2, 2, 40, 16)
    st = AttnStats(2)
    knobs = AttentionKnobs(recipe=recipe, softmax="stabilized_guarded", beta=2.0, block_q=16, block_k=16)
    cap = capture_forward(q, k, v, knobs, st)
    assert int(st.repeated_max_rows.sum()) > 0 and int(st.sfa_p1_rows.sum()) == 0
    ref = flash_attention(q.double(), k.double(), v.double(), AttentionKnobs(recipe="fp32", tiling=False))
    assert (cap["o"].double() - ref).abs().max() <= TOL[recipe]


def test_guarded_gradients_match_exact_softmax():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 24, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 2, 24, 8, dtype=torch.float64)
    g = []
    for sm in ("safe", "stabilized_guarded"):
        o = flash_attention(q, k, v, AttentionKnobs(recipe="fp32", softmax=sm, block_q=8, block_k=8))
        g.append(torch.autograd.grad(o, (q, k, v), do))
    for a, b in zip(*g):
        torch.testing.assert_close(a, b)


def test_sfa_switched_on_at_the_paper_regimes_logits_zeroes_the_rows_it_fires_on():
    """results/paper_1gpu/lease-2026-12-04: SFA forked onto a checkpoint whose max logits are ~1e5 started 6 nats
    above the baseline. With repeated maxima at a logit of ~1e5, beta * rowmax underflows every P̄ of the row:
    paper_bf16's floor gives O = 0, and AttnStats counts each such row; safe softmax and the guarded shift lose none."""
    g = torch.Generator().manual_seed(0)
    T, D = 64, 64
    k = torch.randn(1, 1, T, D, generator=g)
    k[:, :, 1::2] = k[:, :, 0::2]  # every key twice: every row's max repeats
    q = k[:, :, :1].expand(1, 1, T, D).clone()  # every query is key 0: its score is the row max
    q = q * (1e5 / float((q @ k.transpose(-1, -2) / D ** 0.5).max()))  # max logit ~1e5
    v = torch.randn(1, 1, T, D, generator=g)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    zero = {}
    for sm in ("safe", "stabilized", "stabilized_guarded"):
        st = AttnStats(1, "cpu")
        o = flash_attention(q, k, v, AttentionKnobs(recipe="paper_bf16", softmax=sm, beta=2.0, counters=True,
                                                    block_q=16, block_k=16), st)
        assert float(st.max_logit) > 9e4
        zero[sm] = (int((o.float().abs().amax(-1) == 0).sum()), int(st.underflow_rows.sum()))
    assert zero["safe"] == (0, 0) and zero["stabilized_guarded"] == (0, 0)
    assert zero["stabilized"][0] >= T - 1 and zero["stabilized"][1] == zero["stabilized"][0]  # row 0 has one key


def test_an_out_under_a_file_is_named(tmp_path, capsys):
    """--out a/b.md with a a file: mkdir's FileExistsError naming no flag, after the matrix was computed."""
    from flash_forensics.kernels import sfa_matrix
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as e:
        sfa_matrix.main(["--out", str(tmp_path / "afile" / "m.md")])
    assert e.value.code == 2 and f"{tmp_path / 'afile'} is a file; expected a file path in a folder" in \
        capsys.readouterr().err

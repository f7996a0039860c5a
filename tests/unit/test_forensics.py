"""kernels/forensics.py: the paper's worked BF16 addition, exact rounding against torch, and the P̄V error trace."""
import random
import re

import numpy as np
import pytest
import torch

from flash_forensics.kernels import forensics as fx

A_BITS = "11000000000110100000111000101110"
B_BITS = "11000000000100110000000000000000"


def test_paper_worked_example_exactly():
    x = fx.explain_add(-2.4071154594421387, -2.296875)
    assert x.a_bits.replace(" | ", "") == A_BITS and x.b_bits.replace(" | ", "") == B_BITS
    assert not x.a_is_bf16 and x.b_is_bf16  # A is an FP32 partial sum, B a BF16 value of V
    assert x.shift == 0 and x.overflow_shift == 1 and x.exponent == 2
    assert x.significand_sum == "-10.01011010000111000101110"
    assert (x.guard, x.round, x.sticky) == (1, 0, 1)
    assert x.exact == -4.703990459442139 and x.exact_is_float
    assert x.bf16 == -4.71875 and x.bf16_bits_raw == "1100000010010111"
    assert x.error == -0.014759540557861328
    assert x.torch_exact_to_bf16 == x.bf16 == x.torch_fp32_then_bf16


def test_operands_as_fp32_bits(capsys):
    assert fx.parse_operand(A_BITS) == -2.4071154594421387
    assert fx.parse_operand("0xC0130000") == -2.296875
    assert fx.main(["add", A_BITS, B_BITS]) == 0
    out = capsys.readouterr().out
    assert "-4.71875 = 1100000010010111" in out and "-0.014759540557861328" in out and "sticky=1" in out


def test_rounding_matches_torch_on_random_pairs():
    rng = random.Random(0)
    for _ in range(400):
        a = fx.f32_from_bits(rng.getrandbits(32) & 0xBFFFFFFF | 0x30000000)  # finite, moderate exponents
        b = rng.choice([a * rng.uniform(-3, 3), rng.uniform(-8, 8), -a, 0.0])
        b = fx.f32_from_bits(fx.f32_bits(b))
        x = fx.explain_add(a, b)
        assert x.bf16 == x.torch_exact_to_bf16, (a, b)
        if x.bf16 != 0:
            assert abs(x.error) <= abs(x.bf16) * 2.0 ** -8  # at most half a BF16 ulp
    tie = fx.explain_add(1.0, 2.0 ** -8)  # exactly halfway: ties to even keeps 1.0
    assert tie.guard == 1 and tie.round == 0 and tie.sticky == 0 and tie.bf16 == 1.0
    assert fx.explain_add(1.0078125, 2.0 ** -8).bf16 == 1.015625  # odd last bit: tie rounds up


def test_pv_trace_math_on_a_hand_made_row():
    # t=0: -2.296875 (exact in BF16); t=1: + 1e-3 * 1.0 (FP32 keeps it); t=2: + the paper's second operand
    p = np.array([1.0, 1e-3, 1.0])
    v = np.array([-2.296875, 1.0, -2.296875])
    tr = fx.pv_trace(p, v)
    p_fed = float(torch.tensor(1e-3).to(torch.bfloat16))
    acc = np.float32(np.float32(-2.296875) + np.float32(p_fed))
    lp1 = fx.to_bf16(float(acc))
    lp2 = fx.to_bf16(float(np.float32(acc + np.float32(-2.296875))))
    hp = np.cumsum(p * v)
    assert np.allclose(tr.err, [0.0, lp1 - hp[1], lp2 - hp[2]], rtol=0, atol=1e-15)
    assert tr.is_one.tolist() == [True, False, True]
    s = tr.summary()
    assert s["ones_count"] == 2 and s["others_count"] == 1
    assert s["ones_sum"] + s["others_sum"] == pytest.approx(s["total_error"], abs=1e-15)
    with pytest.raises(ValueError, match="accumulate"):
        fx.pv_trace(p, v, accumulate="fp16")


def test_pv_trace_cli_on_generated_example(tmp_path, capsys):
    png = tmp_path / "trace.png"
    assert fx.main(["pv-trace", "--out", str(png), "--json"]) == 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    import json
    s = json.loads(capsys.readouterr().out)
    assert s["ones_count"] == 16 and s["positions"] == 1024
    assert abs(s["ones_mean"]) > 10 * abs(s["others_mean"])  # the error arrives at the P̄ = 1 positions


def test_pv_trace_out_must_be_a_plot_file(tmp_path):
    """--out a folder, a bare name or a suffix matplotlib cannot write: refused naming --out, before any work
    (a bare name was written as <name>.png while the summary printed <name>)."""
    for bad, says in ((tmp_path, "(it is a folder)"), (tmp_path / "trace", "ending in .png"),
                      (tmp_path / "t.txt", "ending in .png, .pdf, .svg")):
        with pytest.raises(SystemExit, match=r"--out=.* is not allowed: expected a file path"):
            try:
                fx.main(["pv-trace", "--out", str(bad)])
            except SystemExit as e:
                assert says in str(e)
                raise
    assert not list(tmp_path.iterdir())
    assert fx.main(["pv-trace", "--out", str(tmp_path / "t.svg"), "--json"]) == 0
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")


def test_pv_trace_from_file(tmp_path, capsys):
    p, v = fx.example_row(length=64, ones=4, seed=3)
    torch.save({"p": p, "v": v}, tmp_path / "row.pt")
    np.save(tmp_path / "row.npy", np.stack([p.numpy(), v.numpy()]))
    for name in ("row.pt", "row.npy"):
        assert fx.main(["pv-trace", "--input", str(tmp_path / name), "--out", str(tmp_path / "t.png")]) == 0
        out = capsys.readouterr().out
        assert "share of the error at P̄ = 1 positions" in out and "positions 64" in out


def test_help_is_clear(capsys):
    with pytest.raises(SystemExit):
        fx.main(["pv-trace", "--help"])
    out = capsys.readouterr().out
    assert "--input" in out and "--accumulate" in out and "P̄ = 1" in out


@pytest.mark.parametrize("argv, says", [
    (["abc", "def"], "argument a: a='abc' is not allowed: expected a decimal number"),
    (["1.5", "0xZZ"], "argument b: b='0xZZ' is not allowed"),
    (["0x1ffffffff", "1"], "a='0x1ffffffff' is not allowed"),  # more than 32 bits
])
def test_bad_operands_name_the_argument(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        fx.main(["add", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "could not convert" not in err


def test_bad_operands_and_rows_are_refused_naming_what(tmp_path, capsys):
    import numpy as np

    from flash_forensics.kernels import forensics as F
    for text in ("1e40", "nan", "inf"):
        with pytest.raises(SystemExit):
            F.main(["add", text, "1"])
        assert f"a={text!r} is not allowed: expected a finite number within FP32's range" in capsys.readouterr().err
    np.save(tmp_path / "three.npy", np.ones((3, 8)))
    bad = np.stack([np.full(8, 0.5), np.ones(8)])
    bad[0, 3] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    np.save(tmp_path / "neg.npy", np.stack([np.full(8, -0.5), np.ones(8)]))
    np.savez(tmp_path / "keys.npz", q=np.ones(8), v=np.ones(8))
    for name, needle in (("three.npy", "shape (3, 8), expected (2, T)"), ("nan.npy", "non-finite values"),
                         ("neg.npy", "P̄ is outside [0, 1]"), ("keys.npz", "has no entry 'p is not a file"),
                         ("missing.pt", "no such file")):
        with pytest.raises(SystemExit, match=re.escape(needle)):
            F.main(["pv-trace", "--input", str(tmp_path / name), "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match=r"--length=100000000 .*expected 0 < length <= 1048576"):
        F.main(["pv-trace", "--length", "100000000", "--out", str(tmp_path / "x.png")])


def test_the_explanation_says_when_the_sum_overflows_or_is_subnormal():
    from flash_forensics.kernels import forensics as F
    over = F.format_add(F.explain_add(3e38, 3e38, "bf16"))
    assert "overflow:" in over and "the result is inf" in over
    assert "saturates at 448" in F.format_add(F.explain_add(300.0, 300.0, "e4m3"))
    sub = F.format_add(F.explain_add(1e-40, 1e-40, "bf16"))
    assert "subnormal:" in sub and "2^-133" in sub
    paper = F.format_add(F.explain_add(F.PAPER_A, F.PAPER_B, "bf16"))
    assert "\noverflow:" not in paper and "\nsubnormal:" not in paper


def test_pv_trace_garbage_truncated_or_mismatched_input_is_named(tmp_path):
    """A text or random-bytes .pt/.npy/.npz gave torch's 'Weights only load failed ... re-run with weights_only=False'
    (an UnpicklingError with no --input) or numpy's 'load it unsafely with allow_pickle'; P̄ and V of different
    lengths or empty named p_row/v_col, not --input. Each is now one line naming --input and what it should be."""
    (tmp_path / "junk.pt").write_bytes(bytes(range(100)))
    (tmp_path / "text.npy").write_text("hello\n")
    (tmp_path / "text.npz").write_text("hello\n")
    torch.save({"p": torch.zeros(8), "v": torch.zeros(8)}, tmp_path / "whole.pt")
    data = (tmp_path / "whole.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    torch.save({"p": torch.zeros(5), "v": torch.zeros(4)}, tmp_path / "lengths.pt")
    np.save(tmp_path / "empty.npy", np.zeros((2, 0)))
    for name, needle in (("junk.pt", "is not readable as .pt: expected a file torch.save wrote, whole"),
                         ("text.npy", "is not readable as .npy: expected a file np.save wrote, whole"),
                         ("text.npz", "is not readable as .npz: expected a file np.savez wrote, whole"),
                         ("cut.pt", "is not readable as .pt: expected a file torch.save wrote, whole (RuntimeError"),
                         ("lengths.pt", "P̄ has 5 and V 4 values; expected two non-empty vectors of one length"),
                         ("empty.npy", "P̄ has 0 and V 0 values")):
        with pytest.raises(SystemExit) as e:
            fx.main(["pv-trace", "--input", str(tmp_path / name), "--out", str(tmp_path / "x.png")])
        msg = str(e.value.code)
        assert msg.startswith(f"--input={str(tmp_path / name)!r}") and needle in msg, (name, msg)
        assert "\n" not in msg and "unsafe" not in msg and "weights_only" not in msg, (name, msg)


def test_pv_trace_out_under_a_file_is_named(tmp_path):
    """--out a/x.png with a a file: mkdir's FileExistsError after the trace, naming no flag."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match=re.escape(f"{tmp_path / 'afile'} is a file; expected a file path in a")):
        fx.main(["pv-trace", "--length", "64", "--out", str(tmp_path / "afile" / "x.png")])


def test_pv_trace_of_a_row_without_error_says_the_share_is_undefined(tmp_path, capsys):
    """A row whose P̄V adds no error (all zeros) printed 'share ...: nan ...; signed share +nan', unexplained."""
    torch.save({"p": torch.zeros(8), "v": torch.zeros(8)}, tmp_path / "zeros.pt")
    assert fx.main(["pv-trace", "--input", str(tmp_path / "zeros.pt"), "--out", str(tmp_path / "z.png")]) == 0
    out = capsys.readouterr().out
    assert "share of the error at P̄ = 1 positions: undefined: no error was added anywhere" in out
    assert "nan" not in out

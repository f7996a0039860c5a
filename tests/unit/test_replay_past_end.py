"""A replay past its file's last step: the seeded order continues (checked against the recorded part), or is refused."""
import zlib
from dataclasses import replace

import numpy as np
import pytest

from flash_forensics.orchestrator.data.batches import BatchStream
from flash_forensics.orchestrator.data.config import DataConfig, DataError
from flash_forensics.orchestrator.data.replay import HEADER_BYTES, OrderReader, read_header, seeded_offsets

T, B, GA = 8, 3, 2


@pytest.fixture()
def tokens(tmp_path):
    p = tmp_path / "train.bin"
    np.arange(5000, dtype=np.uint16).tofile(p)
    return p


def _record(tokens, path, steps, seed=7):
    with BatchStream(tokens, T, B, seed, record_path=path, grad_accum=GA) as s:
        for step in range(steps):
            for m in range(GA):
                s.get(step, m)
    return path


def test_regenerate_continues_the_seeded_order(tokens, tmp_path):
    order = _record(tokens, tmp_path / "order.bin", 5)
    full = BatchStream(tokens, T, B, 7, grad_accum=GA)  # the seeded order itself, never recorded
    # replayed by a run whose own seed differs: steps past the end follow the *file's* seed
    s = BatchStream(tokens, T, B, 99, replay_path=order, grad_accum=GA, replay_past_end="regenerate")
    s.check_covers(12)
    assert s.reader.regenerates(12) and not s.reader.regenerates(5)
    for step in range(12):
        for m in range(GA):
            assert np.array_equal(s.offsets(step, m), full.offsets(step, m)), (step, m)
    x, y = s.get(9, 1)
    assert x.shape == (B, T) and int(y[0, 0]) == int(x[0, 1])


def test_refuse_names_the_knob(tokens, tmp_path):
    order = _record(tokens, tmp_path / "order.bin", 4)
    s = BatchStream(tokens, T, B, 7, replay_path=order, grad_accum=GA, replay_past_end="refuse")
    s.check_covers(4)
    with pytest.raises(DataError, match=r"holds 4 steps, shorter than the run's 6 steps.*replay_past_end=refuse"):
        s.check_covers(6)
    with pytest.raises(DataError, match="holds 4 steps"):
        s.offsets(4, 0)


def test_an_order_that_is_not_its_seeds_is_not_regenerated(tokens, tmp_path):
    """A file whose offsets are valid and checksummed but not its header seed's order (recorded from another order)
    replays as recorded, and refuses to go past its end, naming the first step that differs."""
    order = _record(tokens, tmp_path / "order.bin", 6)
    h = read_header(order)
    raw = bytearray(order.read_bytes())
    step_bytes = h.step_bytes
    body = bytearray(raw[HEADER_BYTES:HEADER_BYTES + h.covered * step_bytes])
    body[3 * step_bytes:3 * step_bytes + 4] = (17).to_bytes(4, "little")  # step 3, micro 0, first offset
    other = tmp_path / "other.bin"
    other.write_bytes(replace(h, crc=zlib.crc32(bytes(body))).pack() + bytes(body))
    r = OrderReader(other, h, "regenerate")
    r.check_covers(6)  # within the recording: fine
    assert int(r.offsets(3, 0)[0]) == 17
    with pytest.raises(DataError, match=r"step 3 \(micro-batch 0\) is not the seeded order of its seed 7"):
        r.check_covers(7)
    assert not r.regenerates(7)


def test_seeded_offsets_is_the_streams_order(tokens):
    s = BatchStream(tokens, T, B, 5, rank=1, world_size=2, grad_accum=GA)
    assert np.array_equal(s.offsets(3, 1), seeded_offsets(5, 3, 1, 1, 5000, T, B))


def test_config_knob_is_validated():
    assert DataConfig().replay_past_end == "regenerate"
    with pytest.raises(DataError, match=r"data.replay_past_end='extend' is not allowed: expected one of regenerate, "
                                         r"refuse"):
        DataConfig(replay_past_end="extend").validate()
    with pytest.raises(DataError, match="replay_past_end"):
        OrderReader("x.bin", None, "extend")

"""The oracle's own arithmetic, checked by hand: codes, decoding, segment planes, snapshots."""

from __future__ import annotations

import pytest
import torch

from kvcore import GeometryError
from kvcore.testing import oracle


def test_codes_number_every_element_and_decode_back():
    enc = oracle.Encoding(num_layers=2, kv_size=2, num_slots=6, num_heads=3, head_size=4, width=4)
    assert enc.exact and enc.count == 2 * 2 * 6 * 3 * 4
    # layer 1, V, slot 5, head 2, element 3: index ((1*2+1)*6+5)*3*4 + 2*4 + 3 = 287, code 288
    plane = enc.plane(1, 1, (3, 2, 3, 4))  # [A=3, B=2] -> slot 5 = (2, 1)
    assert int(plane[2, 1, 2, 3]) == 288
    assert enc.decode(288) == "the cache value of layer 1, V, slot 5, head 2, element 3"
    assert enc.decode(288 + enc.count) == "the staged source value for layer 1, V, slot 5, head 2, element 3"
    assert enc.decode(0) is None and enc.decode(2 * enc.count + 1) is None
    rows = enc.rows([1], torch.tensor([5, -1]))
    assert rows.shape == (2, 1, 2, 12) and int(rows[1, 0, 0, 2 * 4 + 3]) == 288 and int(rows[1, 0, 1].abs().sum()) == 0


def test_narrow_elements_hash_instead_of_colliding_silently():
    enc = oracle.Encoding(num_layers=4, kv_size=2, num_slots=256, num_heads=8, head_size=128, width=1)
    assert not enc.exact and enc.decode(5) is None
    codes = enc.plane(0, 0, (16, 16, 8, 128))
    assert int(codes.min()) >= 1 and int(codes.max()) <= 255
    assert not torch.equal(codes, enc.plane(0, 1, (16, 16, 8, 128)))  # K and V differ


def test_unsigned_round_trip_keeps_every_bit_pattern():
    for dtype, width in ((torch.uint8, 1), (torch.int16, 2), (torch.int32, 4)):
        bits = torch.tensor([0, 1, (1 << (8 * width - 1)), (1 << (8 * width)) - 1], dtype=torch.int64)
        back = oracle.to_unsigned(oracle.from_unsigned(bits, dtype))
        assert torch.equal(back, bits), dtype
    assert min(oracle.special_patterns(torch.float64)) == -(1 << 63)  # the sign bit, as int64 holds it
    assert 0x8000 in oracle.special_patterns(torch.bfloat16)  # -0
    assert 0x7FC0 in oracle.special_patterns(torch.bfloat16)  # the canonical NaN


def test_segment_plane_reads_and_writes_records_that_live_apart():
    # a page of 4 tokens: 4 x 6 value bytes, then 4 x 2 scale bytes
    buf = torch.zeros(3, 4 * (6 + 2), dtype=torch.uint8)
    vals = buf[:, :24].unflatten(1, (4, 1, 6))
    scales = buf[:, 24:].unflatten(1, (4, 1, 2))
    plane = oracle.Plane([vals, scales])
    assert plane.shape == (3, 4, 1, 8)
    plane.write(torch.tensor([5]), torch.arange(1, 9).view(1, 8))  # slot 5 = page 1, token 1
    assert buf[1, 6:12].tolist() == [1, 2, 3, 4, 5, 6]
    assert buf[1, 24 + 2 : 24 + 4].tolist() == [7, 8]
    assert int(buf.sum()) == sum(range(1, 9))
    assert plane.read(torch.tensor([5, 0])).tolist() == [list(range(1, 9)), [0] * 8]
    with pytest.raises(GeometryError, match="same A, B, NH"):
        oracle.Plane([vals, buf[:2, 24:].unflatten(1, (4, 1, 2))])


def test_snapshot_sees_a_change_anywhere_in_shared_storage_and_restores_it():
    base = torch.zeros(64, dtype=torch.uint8)
    views = [base[:32].view(4, 8), base[32:].view(4, 8)]  # two tensors, one storage
    snap = oracle.Snapshot({"a": views[0], "b": [views[1]]})
    assert len(snap.views) == 1 and snap.first_change() is None
    base[40] = 7
    assert snap.first_change() == (0, 40, 0, 7)
    snap.restore()
    assert int(base.sum()) == 0

"""A failure on a plane too narrow to number its elements (1-byte codes are hashed) still
says where the expected value belongs and where the actual one can come from (docs/plugins.md
§6's promise)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcore.testing import oracle
from kvcore.testing.checks.planes import _first_diff
from kvcore.testing.results import CheckFailure


def test_a_one_byte_plane_mismatch_names_the_expected_place_and_the_actual_candidates():
    enc = oracle.PlanesEncoding(2, 64, [oracle.PlaneShape("K", 4, 32, 1), oracle.PlaneShape("KS", 4, 1, 2)])
    assert not enc.exact(0)
    layout = SimpleNamespace(planes=[SimpleNamespace(role="K", head_size=32, dtype=torch.uint8)])
    slots = torch.tensor([5, 9])
    expected = enc.rows(0, [1], slots)  # [1, T, NH*HS]
    actual = expected.clone()
    actual[0, 1, 3] = int(enc.rows(0, [0], torch.tensor([9]))[0, 0, 35])  # layer 0's value of slot 9, head 1, element 3
    with pytest.raises(CheckFailure) as e:
        _first_diff("gather", layout, enc, 0, actual, expected, [1], slots)
    d = e.value.detail
    assert d["expected_means"] == "the cache value of plane K, layer 1, slot 9, head 0, element 3"
    assert d["actual_means"].startswith("a 1-byte code of plane K that cannot name one place: the cache value of ")
    assert "layer 0, slot 9, head 1, element 3" in d["actual_means"] or "more" in d["actual_means"]
    assert "expected 0x" in str(e.value) and "(the cache value of plane K, layer 1, slot 9" in str(e.value)

"""Shared fixtures of the core tests.

The core's tests must not depend on which engine plugins happen to be installed: the
``core_only`` fixture gives them a plugin host that loads no entry point (only kvcore's
built-in plugin: the reference kernel), and puts the process-wide host back afterwards.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from kvcore import registry


@pytest.fixture
def core_only(monkeypatch):
    """A fresh plugin host that sees no entry points; the previous host is restored."""
    saved = registry._HOST
    monkeypatch.delenv("KVCORE_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("KVCORE_STRICT_PLUGINS", raising=False)
    monkeypatch.setattr(registry.md, "entry_points", lambda **kw: [])
    registry.reset()
    yield registry
    registry._HOST = saved


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Install fake entry points of group ``kvcore``: call ``install([(name, value), ...])``.

    Each value is ``"module"`` or ``"module:attr"``; modules may be fakes placed in
    ``sys.modules`` by the test. Returns a counter of ``entry_points`` calls
    (``calls["n"]``) to check lazy, once-only loading. The previous host is restored.
    """
    saved = registry._HOST
    monkeypatch.delenv("KVCORE_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("KVCORE_STRICT_PLUGINS", raising=False)
    calls = {"n": 0, "eps": []}

    def entry_points(**kw):
        calls["n"] += 1
        if kw.get("group") != registry.ENTRY_POINT_GROUP:
            return []
        return list(calls["eps"])

    def install(pairs):
        calls["eps"] = [importlib.metadata.EntryPoint(name=n, value=v, group=registry.ENTRY_POINT_GROUP) for n, v in pairs]
        registry.reset()
        return calls

    monkeypatch.setattr(registry.md, "entry_points", entry_points)
    registry.reset()
    yield install
    registry._HOST = saved


# -- an oracle independent of kvcore's stride table ------------------------------------

_TOKEN_SIZES = {"NL": 2, "NB": 3, "BS": 4, "NH": 2, "HS": 8, "CS": 16, "NBBS": 12, "TWO": 2, "ONE": 1}


def name_oracle_row(name, kv_caches, layer, kv, slot, *, block_size=None, dtype=None):
    """``[NH, HS]`` view of one (layer, K/V, slot) row, by torch indexing of the tensors
    along the axes the format name lists (not through kvcore's stride table)."""

    from kvcore.grammar import parse

    s = parse(name)
    node = kv_caches
    for lvl in s.list_levels:
        node = node[{"NL": layer, "TWO": kv}[lvl]]
    t = node
    keep = []
    idx = []
    for i, tok in enumerate(s.axes):
        if tok == "NL":
            idx.append(layer)
        elif tok == "TWO":
            idx.append(kv)
        elif tok == "NB":
            idx.append(slot // t.shape[s.axes.index("BS")])
        elif tok == "BS":
            idx.append(slot % t.shape[i])
        elif tok == "NBBS":
            idx.append(slot)
        elif tok == "ONE":
            idx.append(0)
        else:  # NH, HS, CS
            idx.append(slice(None))
            keep.append(tok)
    row = t[tuple(idx)]
    if "NH" not in keep:
        row = row.unsqueeze(0)
        keep = ["NH"] + keep
    if keep[0] != "NH":
        row = row.transpose(0, 1)
    if dtype is not None and dtype != row.dtype:
        row = row.view(dtype)
    if "CS" in keep:
        hs = row.shape[-1] // 2
        row = row[:, kv * hs : (kv + 1) * hs]
    return row


def alloc_by_name(name, sizes=None, dtype=None, pad_elems=0):
    """Allocate a cache for ``name`` with the axes in name order (contiguous), each dim-0
    row padded by ``pad_elems`` elements; returns the container nested as the name says."""
    import math

    import torch

    from kvcore.grammar import parse

    dtype = dtype or torch.float32
    sz = dict(_TOKEN_SIZES, **(sizes or {}))
    s = parse(name)
    shape = [sz[t] for t in s.axes]

    def one():
        inner = math.prod(shape[1:])
        buf = torch.zeros(shape[0], inner + pad_elems, dtype=dtype)
        return buf[:, :inner].view(*shape) if pad_elems else buf.view(*shape)

    lv = s.list_levels
    if lv == ():
        return one()
    if lv == ("NL",):
        return [one() for _ in range(sz["NL"])]
    if lv == ("TWO", "NL"):
        return [[one() for _ in range(sz["NL"])] for _ in range(2)]
    return [tuple(one() for _ in range(2)) for _ in range(sz["NL"])]


@pytest.fixture
def oracle():
    return name_oracle_row


@pytest.fixture
def alloc():
    return alloc_by_name


@pytest.fixture(autouse=True)
def _no_device_refusal_leaks_between_tests():
    """A CUDA transfer refused on the device reports at the next transfer or at
    kvcore.synchronize(): drain what an earlier test left, so it cannot fail the next one."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from kvcore.kernels.native import take_device_error

        torch.cuda.synchronize()
        take_device_error()
    yield

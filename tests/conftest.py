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

"""The conformance suite as an opt-in pytest plugin.

It is not registered through ``pytest11``, so it is never loaded into unrelated pytest
runs; ask for it::

    pytest -p kvcore.testing.pytest_plugin --kvcore-plugin trtllm
    pytest -p kvcore.testing --kvcore-plugin trtllm          # the same (the package re-exports the hooks)

or from a plugin's own ``conftest.py``::

    pytest_plugins = ["kvcore.testing.pytest_plugin"]

and run ``pytest --kvcore-plugin NAME``. Each (plugin, format, fixture, kernel, check) becomes
one test item named like the report's line; a failure prints the check's message (the first
wrong element, expected and actual), a check that does not apply is skipped with its reason.
Without ``--kvcore-plugin`` the plugin adds nothing.
"""

from __future__ import annotations

from typing import Any

from kvcore.errors import PluginError
from kvcore.testing import suite

__all__ = ["pytest_addoption", "pytest_collection_modifyitems"]


def pytest_addoption(parser: Any) -> None:
    g = parser.getgroup("kvcore", "kvcore conformance suite")
    g.addoption(
        "--kvcore-plugin",
        action="append",
        default=[],
        metavar="NAME",
        help="run kvcore's conformance suite on this kvcore plugin (repeatable; 'all' for every loaded plugin)",
    )
    g.addoption("--kvcore-check", action="append", default=[], metavar="GLOB", help="only these checks (glob, repeatable)")
    g.addoption("--kvcore-format", action="append", default=[], metavar="GLOB", help="only these formats (glob, repeatable)")
    g.addoption("--kvcore-kernel", action="append", default=[], metavar="GLOB", help="only these kernels (glob, repeatable)")
    g.addoption("--kvcore-examples", type=int, default=8, metavar="N", help="hypothesis examples per kernel agreement check")


def pytest_collection_modifyitems(session: Any, config: Any, items: list) -> None:
    names = config.getoption("kvcore_plugin")
    if not names:
        return
    import pytest

    opts = suite.Options(examples=max(1, config.getoption("kvcore_examples")))
    try:
        tasks = suite.plan(None if "all" in names else names, opts)
    except PluginError as e:
        raise pytest.UsageError(str(e)) from None
    tasks = suite.select(
        tasks,
        checks=config.getoption("kvcore_check") or None,
        formats=config.getoption("kvcore_format") or None,
        kernels=config.getoption("kvcore_kernel") or None,
    )
    item_cls = _item_class()
    items.extend(item_cls.from_parent(session, name=t.id, nodeid=f"kvcore-check::{t.id}", task=t) for t in tasks)


_ITEM: Any = None


def _item_class() -> Any:
    global _ITEM
    if _ITEM is not None:
        return _ITEM
    import pytest

    class CheckFailed(Exception):
        def __init__(self, result: Any):
            super().__init__(result.message)
            self.result = result

    class KVCoreCheck(pytest.Item):
        """One conformance check."""

        def __init__(self, *, task: Any, **kw: Any):
            super().__init__(**kw)
            self.task = task

        def runtest(self) -> None:
            r = self.task.run()
            if r.status == "SKIP":
                pytest.skip(r.message)
            if r.status == "FAIL":
                raise CheckFailed(r)

        def repr_failure(self, excinfo: Any, style: Any = None) -> Any:
            if isinstance(excinfo.value, CheckFailed):
                r = excinfo.value.result
                return f"{r.check} failed for {r.plugin} {r.format} {r.fixture} {r.kernel}:\n{r.message}"
            return super().repr_failure(excinfo)

        def reportinfo(self) -> tuple[Any, int | None, str]:
            return self.path, None, f"kvcore check {self.name}"

    _ITEM = KVCoreCheck
    return _ITEM

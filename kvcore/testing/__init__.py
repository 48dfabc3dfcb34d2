"""kvcore.testing: the fixture contract plugins implement, and the conformance suite.

* :class:`FixtureCase`: what a plugin registers through ``kvcore_register_fixtures``
  (the contract: :mod:`kvcore.testing.fixtures`); :func:`registered_fixtures` lists them.
* :class:`Writer`: the engine's own write path a fixture carries, the oracle of the
  ``writer_*`` checks (:mod:`kvcore.testing.writers`).
* :mod:`kvcore.testing.suite`: the checks, importable (``suite.run_checks(["myplugin"])``).
* ``kvcore check [PLUGIN ...]``: the report (:mod:`kvcore.testing.check`).
* ``pytest -p kvcore.testing --kvcore-plugin NAME`` (or ``-p kvcore.testing.pytest_plugin``):
  the same checks as pytest items. The pytest hooks below only forward to
  :mod:`kvcore.testing.pytest_plugin`, so importing this package never imports pytest.
"""

from kvcore.testing.fixtures import FixtureCase, registered_fixtures
from kvcore.testing.oracle import TokenGroups
from kvcore.testing.writers import Writer, WriterUnsupported

__all__ = ["FixtureCase", "TokenGroups", "Writer", "WriterUnsupported", "registered_fixtures"]


def pytest_addoption(parser):
    from kvcore.testing import pytest_plugin

    pytest_plugin.pytest_addoption(parser)


def pytest_collection_modifyitems(session, config, items):
    from kvcore.testing import pytest_plugin

    pytest_plugin.pytest_collection_modifyitems(session, config, items)

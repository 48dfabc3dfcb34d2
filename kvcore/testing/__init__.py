"""kvcore.testing: the fixture contract plugins implement, and the conformance suite.

* :class:`FixtureCase`: what a plugin registers through ``kvcore_register_fixtures``
  (the contract: :mod:`kvcore.testing.fixtures`); :func:`registered_fixtures` lists them.
* :class:`Writer`: the engine's own write path a fixture carries, the oracle of the
  ``writer_*`` checks (:mod:`kvcore.testing.writers`).
* :mod:`kvcore.testing.suite`: the checks, importable (``suite.run_checks(["myplugin"])``).
* ``kvcore check [PLUGIN ...]``: the report (:mod:`kvcore.testing.check`).
* ``pytest -p kvcore.testing --kvcore-plugin NAME`` (or ``-p kvcore.testing.pytest_plugin``):
  the same checks as pytest items. The package re-exports the pytest hooks of
  :mod:`kvcore.testing.pytest_plugin` (which imports pytest only inside a hook), so
  importing this package never imports pytest.
"""

from kvcore.testing.fixtures import FixtureCase, registered_fixtures
from kvcore.testing.oracle import TokenGroups
from kvcore.testing.pytest_plugin import pytest_addoption, pytest_collection_modifyitems  # noqa: F401 - pytest -p kvcore.testing
from kvcore.testing.writers import Writer, WriterUnsupported

__all__ = ["FixtureCase", "TokenGroups", "Writer", "WriterUnsupported", "registered_fixtures"]

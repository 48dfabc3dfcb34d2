"""kvcore.testing: the fixture contract plugins implement, and the conformance suite."""

from kvcore.testing.fixtures import FixtureCase, fixtures

__all__ = ["FixtureCase", "fixtures"]

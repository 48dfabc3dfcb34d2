"""Running a plan: :func:`select` filters tasks by glob patterns, :func:`run_checks` plans and
runs them."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from kvcore.testing.planner import plan
from kvcore.testing.results import Options, Result, Task


def select(tasks: Sequence[Task], *, formats=None, fixtures=None, kernels=None, checks=None) -> list[Task]:
    """Filter tasks by glob patterns on format, fixture, kernel (``name`` or ``name@device``;
    checks that move no data are kept) and check (``invalid`` matches every ``invalid[...]``)."""

    def ok(value: str, pats) -> bool:
        return not pats or any(
            fnmatch.fnmatchcase(value, p) or fnmatch.fnmatchcase(value.split("@")[0], p) or fnmatch.fnmatchcase(value.split("[")[0], p)
            for p in pats
        )

    return [
        t
        for t in tasks
        if ok(t.format, formats) and ok(t.fixture, fixtures) and (t.kernel == "-" or ok(t.kernel, kernels)) and ok(t.check, checks)
    ]


def run_checks(plugins: Sequence[str] | None = None, opts: Options | None = None, **filters) -> list[Result]:
    """Plan and run; ``filters`` as in :func:`select`."""
    return [t.run() for t in select(plan(plugins, opts), **filters)]

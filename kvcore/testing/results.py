"""What the conformance suite reports: one :class:`Result` per check, the :class:`Task` that
produces it, the exceptions a check raises to fail (:class:`CheckFailure`) or to step aside
(:class:`CheckSkip`), and a run's :class:`Options`."""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class CheckFailure(Exception):
    """A check found a defect; ``detail`` carries the first wrong element, when there is one."""

    def __init__(self, message: str, detail: dict | None = None):
        super().__init__(message)
        self.detail = detail or {}


class CheckSkip(Exception):
    """A check does not apply (with the reason)."""


@dataclass
class Result:
    """One line of the report.

    Attributes:
        plugin: the plugin whose format or kernel is checked.
        format: the format name ("" for plugin-level checks).
        fixture: the fixture's name ("" for format-level checks).
        kernel: ``name@device`` for checks that move data, "-" otherwise.
        check: the check name, e.g. ``semantic_gather`` or ``roundtrip[bfloat16]``.
        status: PASS, FAIL or SKIP.
        message: why it failed or was skipped, or a note.
        detail: for a wrong element, its coordinates (layer, kv, token, slot, head,
            element) and the expected and actual bits.
        seconds: wall time.
    """

    plugin: str
    format: str
    fixture: str
    kernel: str
    check: str
    status: str
    message: str = ""
    detail: dict = field(default_factory=dict)
    seconds: float = 0.0

    def line(self, widths: Sequence[int] = (0, 0, 0, 0, 0)) -> str:
        cols = [self.plugin, self.format or "-", self.fixture or "-", self.kernel, self.check]
        head = f"{self.status}  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()
        if self.message and self.status != PASS:
            head += "\n      " + self.message.replace("\n", "\n      ")
        elif self.message:
            head += f"  ({self.message})"
        return head

    def as_dict(self) -> dict[str, Any]:
        return {
            "plugin": self.plugin,
            "format": self.format,
            "fixture": self.fixture,
            "kernel": self.kernel,
            "check": self.check,
            "status": self.status,
            "message": self.message,
            "detail": self.detail,
            "seconds": round(self.seconds, 4),
        }


@dataclass(frozen=True)
class Options:
    """Knobs of a run. Every random choice (slot mappings, bits, hypothesis examples) is
    seeded from the fixture's name, so a run is reproducible.

    Attributes:
        examples: hypothesis examples per kernel agreement check.
        devices: device types to run on (None: every device present).
    """

    examples: int = 8
    devices: tuple[str, ...] | None = None


@dataclass
class Task:
    """One check, ready to run: ``task.run() -> Result``."""

    plugin: str
    format: str
    fixture: str
    kernel: str
    check: str
    fn: Callable[[], str | None]

    @property
    def id(self) -> str:
        return "::".join([self.plugin, self.format or "-", self.fixture or "-", self.kernel, self.check])

    def run(self) -> Result:
        with single_thread():
            return self._run()

    def _run(self) -> Result:
        t0 = time.perf_counter()
        status, msg, detail = PASS, "", {}
        try:
            note = self.fn()
            msg = note or ""
        except CheckFailure as e:
            status, msg, detail = FAIL, str(e), e.detail
        except CheckSkip as e:
            status, msg = SKIP, str(e)
        except Exception as e:  # noqa: BLE001 - a crash is a failure of the thing checked, reported
            tb = traceback.extract_tb(e.__traceback__)
            where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
            status, msg = FAIL, f"crashed with {type(e).__name__}: {e}{where}"
        return Result(self.plugin, self.format, self.fixture, self.kernel, self.check, status, msg, detail, time.perf_counter() - t0)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One torch CPU thread for the block: the suite's tensors are tiny, and thread-pool
    hand-offs would cost more than the copies (much more on a loaded machine)."""
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)

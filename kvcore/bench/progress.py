"""Progress of a run on stderr: one line per finished case (CI logs, pipes), or a tqdm bar
on a terminal."""

from __future__ import annotations

import sys
import time


class _Progress:
    """One line per finished case on stderr (CI logs, pipes), or a tqdm bar on a terminal."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.done, self.t0 = total, 0, time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="kvcore bench", unit="case", file=sys.stderr)
            except ImportError:  # pragma: no cover - tqdm is a dependency
                self.bar = None
        if self.bar is None:
            print(f"kvcore bench: {total} cases ({what})", file=sys.stderr, flush=True)

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label)

    def finished(self, label: str, rows: int, seconds: float) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            print(f"kvcore bench: [{self.done}/{self.total}] {label}: {rows} rows in {seconds:.1f} s", file=sys.stderr, flush=True)

    def note(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(f"kvcore bench: {msg}", file=sys.stderr)
        else:
            print(f"kvcore bench: {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        print(f"kvcore bench: done in {time.monotonic() - self.t0:.1f} s", file=sys.stderr, flush=True)

"""The code blocks of the project's documents, and the convention that says how each runs.

Every fenced block carries a language tag:

* ``python``: run, the blocks of one document in order in one namespace (a later block may
  use an earlier block's names); a block whose first line is ``# file: PATH`` is written to
  ``PATH`` in the document's scratch folder instead (and that folder is on ``sys.path``).
* ``bash``: run, line by line, in the checkout (the plugin guide: in a scratch folder, with a
  fresh venv) with the test venv's ``bin`` first on ``PATH`` (``kvcore``, ``pip``,
  ``python``). Two kinds of line the test venv has already run are checked, not repeated:
  ``pip install -e PATH`` of paths ``requirements-dev.txt`` installs editable, and
  ``pytest PATH`` of test paths the suite collects.
* ``toml``: parsed; with a ``file`` marker written to its path.
* ``text``: never run (command output, listings, directory trees).

A marker on the line right before the fence, an HTML comment the rendered page hides:

* ``<!-- docs: skip REASON -->``: not run here; the reason must say it needs a GPU, a live
  engine, several processes or hosts, or another checkout, e.g. ``<!-- docs: skip needs a
  live vLLM engine (runner.kv_caches) -->``.
* ``<!-- docs: file PATH -->``: the block is the content of file ``PATH``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAGS = ("python", "bash", "toml", "text")
SKIP_WORDS = ("gpu", "live", "engine", "processes", "hosts", "checkout", "cuda", "xpu")
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*docs:\s*(skip|file)\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    tag: str
    code: str
    skip: str | None = None
    file: str | None = None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "plugins").glob("*/README.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, with their markers.

    Raises:
        ValueError: an unclosed fence, an indented fence, or a marker not followed by a fence.
    """
    lines = path.read_text().split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```") and not lines[i].startswith("```"):
            raise ValueError(f"{path.name}:{i + 1}: an indented fence; the collector reads fences at column 0 only")
        m = _FENCE.match(lines[i])
        mark = _MARK.match(lines[i])
        if mark and not (i + 1 < len(lines) and _FENCE.match(lines[i + 1])):
            raise ValueError(f"{path.name}:{i + 1}: a docs marker must be the line right before a fence")
        if not m:
            i += 1
            continue
        start, tag = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j >= len(lines):
            raise ValueError(f"{path.name}:{start + 1}: unclosed fence")
        prev = _MARK.match(lines[start - 1]) if start else None
        skip = prev.group(2) if prev and prev.group(1) == "skip" else None
        file = prev.group(2) if prev and prev.group(1) == "file" else None
        code = "\n".join(lines[start + 1 : j])
        if tag == "python" and code.startswith("# file: "):
            file = code.split("\n", 1)[0][len("# file: ") :].strip()
        out.append(Block(path, start + 1, tag, code, skip, file))
        i = j + 1
    return out

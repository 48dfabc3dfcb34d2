"""Render docs/benchmarks.md's tables from the JSON that ``kvcore bench --output`` wrote.

python3 scripts/bench_doc.py docs/bench_data/h200.json   # prints markdown tables
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(path: str) -> int:
    from kvcore.bench import Row, format_table

    d = json.loads(Path(path).read_text())
    rows = [Row(**r) for r in d["rows"]]
    print(f"<!-- {d['meta']['device_name']}, torch {d['meta']['torch']}, {d['meta']['gbps_counts']} -->\n")
    dev = [r for r in rows if r.staging == "device"]
    pin = [r for r in rows if r.staging == "pinned"]
    print(format_table(dev))
    if pin:
        print()
        print(format_table(pin))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

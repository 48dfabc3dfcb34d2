"""Render docs/benchmarks.md's tables from the JSON that ``kvcore bench --output`` wrote.

python3 scripts/bench_doc.py docs/bench_data/h200.json   # prints markdown tables
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(path: str) -> int:
    from kvcore.bench import Row, SmallRow, format_small, format_table

    d = json.loads(Path(path).read_text())
    fields = set(Row.__dataclass_fields__)
    rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in d["rows"]]
    m = d["meta"]
    load = f", load average {m['loadavg_start']} -> {m.get('loadavg_end')}" if m.get("loadavg_start") else ""
    print(f"<!-- {m['device_name']}, torch {m['torch']}, {m['gbps_counts']}{load} -->\n")
    dev = [r for r in rows if r.staging == "device"]
    pin = [r for r in rows if r.staging == "pinned"]
    print(format_table(dev))
    if pin:
        print()
        print(format_table(pin))
    if d.get("small"):
        print()
        print(format_small([SmallRow(**r) for r in d["small"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

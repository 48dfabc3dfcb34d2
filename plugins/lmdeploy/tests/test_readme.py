"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path


def test_readme_example_runs(capsys):
    text = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "K=NL_X_NB_BS_NH_HS+V=NL_X_NB_BS_NH_HS+KSZ=NL_X_NB_BS_NH_HS+VSZ=NL_X_NB_BS_NH_HS"
    assert out[1] == "K: 2 x [4, 16, 2, 32] + V: 2 x [4, 16, 2, 32] + KSZ: 2 x [4, 16, 2, 2] + VSZ: 2 x [4, 16, 2, 2]"
    assert float(out[-1]) < 0.3  # half an int4 step of randn over 64 values, plus bf16 scale rounding

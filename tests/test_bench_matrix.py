"""``kvcore bench``'s matrix and progress (no timing here: the measuring functions are
replaced by recorders, so this checks what would be measured and what the user sees).

``--quick`` is the CI smoke run: a handful of short cases, the reference kernel timed on
the first case only; progress goes to stderr one line per case when stderr is not a
terminal (tqdm turns itself off there), so a piped run is never silent."""

from __future__ import annotations

import argparse

import pytest

from kvcore import bench


@pytest.fixture
def recorded(monkeypatch):
    seen: dict[str, list] = {"case": [], "small": []}

    def fake_case(case, block_size, tokens, device, **kw):
        seen["case"].append((case.label, block_size, tokens, kw))
        return [
            bench.Row(**{**_ROW, "layout": case.label, "block_size": block_size, "tokens": tokens, "direction": d})
            for d in ("gather", "scatter")
        ]

    def fake_small(device, *, tokens, repeats, calls=None):
        seen["small"].append((tokens, repeats, calls))
        return []

    monkeypatch.setattr(bench, "bench_case", fake_case)
    monkeypatch.setattr(bench, "bench_small", fake_small)
    return seen


_ROW = dict(
    device="cpu",
    layout="",
    format="NL_X_TWO_NB_BS_NH_HS",
    dtype="bfloat16",
    block_size=0,
    tokens=0,
    direction="",
    staging="device",
    kernel="native-cpu",
    mbytes=1.0,
    seconds=1e-3,
    gbps=2.0,
    baseline="copy",
    baseline_gbps=2.0,
    vs_copy=1.0,
    reference_gbps=None,
    vs_reference=None,
)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(["--device", "cpu", *argv])


def test_quick_is_a_few_short_cases_with_one_reference_timing(recorded, capsys):
    assert bench.run(_args("--quick")) == 0
    cases = recorded["case"]
    assert [(label, bs, t) for label, bs, t, _ in cases] == [("NHD", 16, 256), ("HND", 16, 256), ("MLA-bf16", 16, 256)]
    assert [kw["with_reference"] for *_, kw in cases] == [True, False, False]
    assert {kw["repeats"] for *_, kw in cases} == {3} and {kw["sample_bytes"] for *_, kw in cases} == {40e6}
    assert recorded["small"] == [(16, 3, 10)]
    out, err = capsys.readouterr()
    assert "# --quick: 3 repeats of ~40 MB samples; the reference kernel timed on the first case only" in out
    assert out.count("| NHD | bfloat16 | 16 | 256 |") == 2


def test_the_default_matrix_times_the_reference_everywhere(recorded, capsys):
    assert bench.run(_args("--layouts", "NHD,MLA-fp8", "--block-sizes", "16,64", "--tokens", "32")) == 0
    cases = recorded["case"]
    assert [(label, bs, t) for label, bs, t, _ in cases] == [("NHD", 16, 32), ("NHD", 64, 32), ("MLA-fp8", 16, 32), ("MLA-fp8", 64, 32)]
    assert all(kw["with_reference"] and kw["repeats"] == 5 and kw["sample_bytes"] == 400e6 for *_, kw in cases)
    assert recorded["small"] == [(16, 5, None)]
    assert "--quick" not in capsys.readouterr().out


def test_a_piped_run_shows_one_progress_line_per_case_on_stderr(recorded, capsys):
    assert bench.run(_args("--quick", "--no-reference", "--small", "")) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == "kvcore bench: 3 cases (cpu, --quick, 3 repeats)"
    progress = [line for line in lines if line.startswith("kvcore bench: [")]
    assert [p.split(":")[1].strip() for p in progress] == ["[1/3] NHD BS=16 T=256", "[2/3] HND BS=16 T=256", "[3/3] MLA-bf16 BS=16 T=256"]
    assert all(" 2 rows in " in p for p in progress)
    assert lines[-1].startswith("kvcore bench: done in ") and "reference" not in err
    assert "kvcore bench" not in out  # stdout is the table only


def test_slot_mapping_and_clock_reach_every_case_and_the_header_names_the_load(recorded, capsys):
    assert bench.run(_args("--layouts", "KT,Ktile", "--block-sizes", "32", "--tokens", "64", "--slots", "random", "--clock", "cpu")) == 0
    cases = recorded["case"]
    assert [(label, bs, t) for label, bs, t, _ in cases] == [("KT", 32, 64), ("Ktile", 32, 64)]
    assert all(kw["slots"] == "random" and kw["clock"] == "cpu" for *_, kw in cases)
    out, _ = capsys.readouterr()
    assert "load average" in out.splitlines()[0]
    assert bench.run(_args("--layouts", "KT", "--block-sizes", "32", "--tokens", "64")) == 0
    assert recorded["case"][-1][3]["slots"] == "blocks" and recorded["case"][-1][3]["clock"] == "wall"

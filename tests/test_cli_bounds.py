"""Every numeric option is bounded and every typo'd name is a usage error (review D3-D5):
one line on stderr naming the accepted range or names, exit 2 -- never an internal error,
never exit 1, never a green run that checked nothing."""

from __future__ import annotations

import argparse
import json

import pytest

import kvcore
from kvcore import bench, cli, registry
from kvcore.cli_args import float_range, int_list, int_range

DOC = {"engine": "vllm", "kv_caches": {"repeat": 2, "of": {"shape": [2, 5, 16, 4, 64], "dtype": "bfloat16"}}}


def _usage(capsys, argv) -> str:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert "internal error" not in err and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# -- the types themselves -------------------------------------------------------------------


def test_int_range_accepts_the_range_and_refuses_the_rest():
    t = int_range(1, 10)
    assert [t("1"), t("10"), t(" 7 ")] == [1, 10, 7]
    for bad, said in [("0", "0 is out of range"), ("11", "11 is out of range"), ("-5", "-5 is out of range"), ("abc", "'abc' is not an integer"),
                      ("1.5", "not an integer"), ("", "not an integer"), ("99999999999999999999", "out of range")]:  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=said) as ei:
            t(bad)
        assert "from 1 to 10" in str(ei.value)


def test_int_list_checks_every_value():
    t = int_list(1, 100)
    assert t("1,2, 100") == (1, 2, 100)
    with pytest.raises(argparse.ArgumentTypeError, match="in '1,0,3': 0 is out of range; give an integer from 1 to 100"):
        t("1,0,3")
    with pytest.raises(argparse.ArgumentTypeError, match="names no value"):
        t(",")
    assert int_list(1, 100, allow_empty=True)("") == ()


def test_float_range_refuses_nan_inf_and_zero():
    t = float_range(0, 1e3)
    assert t("0.5") == 0.5 and t("1000") == 1000.0
    for bad in ("0", "-1", "nan", "inf", "1e9", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="a number above 0 up to 1000"):
            t(bad)


# -- bench / check options --------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            ["--tokens", "4611686018427387904"],
            "--tokens: in '4611686018427387904': 4611686018427387904 is out of range; give an integer from 1 to 4194304",
        ),
        (["--tokens", "99999999999999999999"], "--tokens: in '99999999999999999999': 99999999999999999999 is out of range"),
        (["--tokens", "0"], "--tokens: in '0': 0 is out of range"),
        (["--tokens", "-5"], "--tokens: in '-5': -5 is out of range"),
        (["--tokens", "abc"], "--tokens: in 'abc': 'abc' is not an integer"),
        (["--tokens", "256,x"], "in '256,x': 'x' is not an integer"),
        (["--repeats", "-1"], "--repeats: -1 is out of range; give an integer from 1 to 100000"),
        (["--repeats", "0"], "--repeats: 0 is out of range"),
        (["--block-sizes", "0"], "--block-sizes: in '0': 0 is out of range; give an integer from 1 to 65536"),
        (["--block-sizes", "99999999999"], "--block-sizes: in '99999999999': 99999999999 is out of range"),
        (["--small", "5000"], "--small: in '5000': 5000 is out of range; give an integer from 1 to 1024"),
        (["--max-seconds", "nan"], "--max-seconds: nan is out of range; give a number above 0"),
        (["--max-seconds", "-3"], "--max-seconds: -3 is out of range"),
        (["--device", "tpu"], "--device: invalid choice: 'tpu'"),
    ],
)
def test_bench_numeric_options_are_bounded(capsys, argv, said):
    line = _usage(capsys, ["bench", *argv])
    assert line.startswith("kvcore bench: error: argument ") and said in line, line


def test_bench_refuses_a_matrix_larger_than_memory_before_allocating(capsys, monkeypatch):
    monkeypatch.setattr(bench, "_available_bytes", lambda device: 1 << 30)  # 1 GiB
    line = _usage(capsys, ["bench", "--device", "cpu", "--layouts", "NHD", "--block-sizes", "16", "--tokens", "4194304"])
    want = bench._case_bytes(bench.CASES["NHD"], 16, 4194304, __import__("torch").device("cpu"))
    assert want > 1 << 40  # 32 layers x 8 heads x 128 x 2 B x 2 (K, V) = 128 KiB a token: TiBs
    assert f"needs about {want / 2**30:.1f} GiB of cpu memory, more than the 1.0 GiB available" in line


def test_check_examples_is_bounded(capsys):
    assert "--examples: 0 is out of range; give an integer from 1 to 10000" in _usage(capsys, ["check", "--examples", "0"])
    assert "'many' is not an integer" in _usage(capsys, ["check", "--examples", "many"])


def test_an_unknown_option_is_one_line(capsys):
    assert _usage(capsys, ["formats", "--nosuch"]) == "kvcore: error: unrecognized arguments: --nosuch; see `kvcore --help`"


# -- detect: @hints files and unknown engines ----------------------------------------------------


@pytest.mark.parametrize(
    "content, said",
    [
        (b"\xff\xfe{}", "is not UTF-8 text (byte 0xff at offset 0)"),
        (b"{not json", "is not valid JSON"),
        (b"[" * 100000 + b"]" * 100000, "nests JSON too deeply"),
        (b"[1, 2]", "--hints must be a JSON object, got [1, 2]"),
    ],
    ids=["non-utf8", "bad-json", "deep", "not-an-object"],
)
def test_a_hints_file_goes_through_the_checked_reader(capsys, tmp_path, content, said):
    doc, hints = tmp_path / "cache.json", tmp_path / "hints.json"
    doc.write_text(json.dumps(DOC))
    hints.write_bytes(content)
    assert said in _usage(capsys, ["detect", str(doc), "--hints", f"@{hints}"])
    assert "cannot read" in _usage(capsys, ["detect", str(doc), "--hints", f"@{tmp_path / 'missing.json'}"])


def test_a_hints_file_with_bom_and_utf8_is_read(capsys, tmp_path):
    doc, hints = tmp_path / "cache.json", tmp_path / "hints.json"
    doc.write_text(json.dumps(DOC))
    hints.write_bytes('\ufeff{"kv_cache_layout": "NHD"}'.encode())
    assert cli.main(["detect", str(doc), "--hints", f"@{hints}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "NL_X_TWO_NB_BS_NH_HS"


@pytest.mark.parametrize("extra", [[], ["--per-layer"], ["--json"]])
@pytest.mark.parametrize("where", ["flag", "file"])
def test_detect_with_an_unknown_engine_is_one_line_listing_the_engines(capsys, tmp_path, extra, where):
    doc = tmp_path / "cache.json"
    doc.write_text(json.dumps({**DOC, "engine": "nosuch"} if where == "file" else DOC))
    argv = ["detect", str(doc), *extra] + (["--engine", "nosuch"] if where == "flag" else [])
    line = _usage(capsys, argv)
    known = sorted({e for f in kvcore.formats() for e in f.engines} | set(registry.demos()))
    assert "vllm" in known
    assert line == f"kvcore: no installed plugin declares engine 'nosuch'; engines: {', '.join(known)} (`kvcore plugins` lists them)"


def test_the_python_api_still_raises_detection_error_naming_the_engines(tmp_path):
    import torch

    with pytest.raises(kvcore.DetectionError, match=r"^no installed plugin declares engine 'nosuch' \(engines they declare: .*vllm"):
        kvcore.detect([torch.zeros(2, 5, 16, 4, 64)], engine="nosuch")


# -- check: kernel / device filters that select nothing ----------------------------------------------


def test_check_kernel_filter_matching_no_kernel_is_a_usage_error(capsys):
    names = sorted({k.name for k in registry.kernels()})
    line = _usage(capsys, ["check", "vllm", "--kernel", "nosuch", "-q"])
    assert (
        line
        == f"kvcore check: --kernel 'nosuch' matches no registered kernel; kernels: {', '.join(names)} (name or name@device, globs allowed)"
    )
    assert "matches no registered kernel" in _usage(capsys, ["check", "vllm", "--kernel", "reference", "--kernel", "nosuch*", "--list"])


def test_check_device_filter_naming_no_device_type_is_a_usage_error(capsys):
    line = _usage(capsys, ["check", "vllm", "--device", "nosuch", "-q"])
    assert line.startswith("kvcore check: --device 'nosuch' is not a device type any kernel serves; device types: ")
    assert "cpu" in line and "(present here: cpu" in line


def test_check_filters_selecting_no_kernel_on_a_present_device_are_a_usage_error(capsys, monkeypatch):
    import torch

    from kvcore.testing import planner
    from kvcore.testing.checks import common

    # a machine with only a CPU (the planner holds its own reference to devices())
    monkeypatch.setattr(common, "devices", lambda: [torch.device("cpu")])
    if hasattr(planner, "devices"):
        monkeypatch.setattr(planner, "devices", lambda: [torch.device("cpu")])
    line = _usage(capsys, ["check", "vllm", "--device", "cuda", "--list"])
    assert "select no kernel on a device present here, so no transfer would be checked (devices here: cpu" in line


def test_check_filters_that_select_kernels_still_list_them(capsys):
    rc = cli.main(["check", "vllm", "--kernel", "native-*", "--fixture", "vllm-0.11-FLASHINFER-NHD", "--list"])
    out, err = capsys.readouterr()
    ids = out.splitlines()
    got = {i.split("::")[3] for i in ids}
    # native-cpu everywhere; native-cuda too where a GPU is present
    assert rc == 0 and "native-cpu@cpu" in got and got <= {"-", "native-cpu@cpu", "native-cuda@cuda"}


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--engine", "sglang", "--tokens", "0"], "--tokens: 0 is out of range; give an integer from 1 to 4194304"),
        (["--engine", "sglang", "--layers", "99999999999999999999"], "--layers: 99999999999999999999 is out of range"),
        (["--engine", "transformers", "--prompt-lengths", "3,x"], "--prompt-lengths: in '3,x': 'x' is not an integer"),
        (["--engine", "transformers", "--rtol", "nan"], "--rtol: nan is out of range"),
        (["--engine", "vllm", "--num-blocks", "2"], "--num-blocks: 2 is out of range; give an integer from 8 to 1048576"),
        (["--engine", "vllm", "--seed", "-1"], "--seed: -1 is out of range"),
    ],
)
def test_demo_numeric_options_are_bounded(capsys, argv, said):
    if argv[1] not in registry.demos():
        pytest.skip(f"the {argv[1]} plugin is not installed")
    line = _usage(capsys, ["demo", *argv])
    assert line.startswith(f"kvcore demo --engine {argv[1]}: error: argument ") and said in line, line

"""The command line never shows an internal error for a user's mistake (issue 17, item 8):
every malformed input is one line on stderr and exit 2; repeats are described once and
counted before anything is built; ``storage_offset_step`` is honoured wherever a repeat is."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcore
from kvcore import cli, tensor_description
from kvcore.tensor_description import MAX_TENSORS, UsageError, load_tensor_description

ENGINE = "clierr"


class _Plugin:
    """Answers engine ``clierr`` for a list of 5-D ``[2, NB, BS, NH, HS]`` tensors, None otherwise."""

    @kvcore.hookimpl
    def kvcore_register_formats(self, register):
        register(kvcore.KVFormat(name="NL_X_TWO_NB_BS_NH_HS", engines=[ENGINE]))

    @kvcore.hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != ENGINE:
            return None
        if not isinstance(kv_caches, list) or not all(isinstance(t, torch.Tensor) and t.dim() == 5 for t in kv_caches):
            raise kvcore.DetectionError("clierr: expected a list of 5-D tensors")
        return kvcore.resolve([kvcore.Candidate("NL_X_TWO_NB_BS_NH_HS", kv_caches)], engine=ENGINE)


@pytest.fixture(autouse=True)
def plugin():
    kvcore.registry.host()
    name = kvcore.register_plugin(_Plugin(), "clierr-plugin")
    yield
    kvcore.unregister_plugin(name)


def _detect(tmp_path, capsys, payload: bytes | str | object, *extra: str) -> tuple[int, str, str]:
    p = tmp_path / "cache.json"
    if isinstance(payload, bytes):
        p.write_bytes(payload)
    elif isinstance(payload, str):
        p.write_text(payload)
    else:
        p.write_text(json.dumps(payload))
    rc = cli.main(["detect", str(p), "--engine", ENGINE, *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_usage_error(rc: int, err: str) -> str:
    assert rc == 2, err
    assert "internal error" not in err and "Traceback" not in err and "frame #" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


HUGE = 2**70


@pytest.mark.parametrize(
    "leaf, said",
    [
        ({"shape": [2, HUGE, 16, 8, 128]}, "beyond 64 bits"),
        ({"shape": [2, 16, 16, 8, 128], "stride": [HUGE, 1, 1, 1, 1]}, "beyond 64 bits"),
        ({"shape": [2, 16, 16, 8, 128], "storage_offset": HUGE}, "64-bit"),
        ({"shape": [2**40, 2**40, 2]}, "64-bit byte offsets"),  # each size fits, the product does not
        ({"shape": [2, 4], "stride": [2**62, 1]}, "64-bit byte offsets"),  # the extent in bytes does not
        ({"shape": [2, 4], "storage_offset_step": HUGE, "repeat": 2}, "64-bit"),
        ({"shape": [2, 4], "repeat": HUGE}, "tensors"),
        ({"shape": [2, 4], "repeat": 1.5}, "repeat must be a positive integer"),
        ({"shape": [2.0, 4]}, "must be a list of integers"),
        ({"shape": "2x4"}, "must be a list of integers"),
    ],
)
def test_sizes_beyond_64_bits_and_bad_numbers_are_one_line_usage_errors(tmp_path, capsys, leaf, said):
    rc, out, err = _detect(tmp_path, capsys, {"dtype": "bfloat16", "kv_caches": [leaf]})
    assert said in _one_line_usage_error(rc, err) and out == ""


@pytest.mark.parametrize(
    "payload, said",
    [
        (b"\xff\xfe{}", "is not UTF-8 text (byte 0xff at offset 0)"),
        (b'{"kv_caches": [{"shape": [2], "dtype": "bf16\xe9"}]}', "is not UTF-8 text"),
        ("[" * 100_000 + "]" * 100_000, "nests JSON too deeply"),
        ('{"kv_caches": ' + "[" * 200 + '{"shape": [1], "dtype": "bf16"}' + "]" * 200 + "}", "nested more than 64 levels"),
        ("{not json", "not valid JSON"),
        ('{"engine": 3, "kv_caches": [{"shape": [2], "dtype": "bf16"}]}', "engine must be a string"),
    ],
)
def test_unreadable_files_are_one_line_usage_errors(tmp_path, capsys, payload, said):
    rc, _, err = _detect(tmp_path, capsys, payload)
    assert said in _one_line_usage_error(rc, err)


def test_a_utf8_file_with_a_byte_order_mark_is_read(tmp_path, capsys):
    doc = {"dtype": "bf16", "kv_caches": [{"shape": [2, 3, 4, 2, 8]}]}
    rc, out, err = _detect(tmp_path, capsys, b"\xef\xbb\xbf" + json.dumps(doc).encode(), "--json")
    assert rc == 0, err
    assert json.loads(out)["format"] == "NL_X_TWO_NB_BS_NH_HS"


def test_non_utf8_stdin_is_a_usage_error(monkeypatch, capsys):
    class Stdin:
        buffer = __import__("io").BytesIO(b'{"kv_caches": "\xff"}')

    monkeypatch.setattr(sys, "stdin", Stdin())
    rc = cli.main(["detect", "-", "--engine", ENGINE])
    assert "stdin is not UTF-8 text" in _one_line_usage_error(rc, capsys.readouterr().err)


def test_a_huge_repeat_is_refused_before_anything_is_built(monkeypatch, tmp_path, capsys):
    def no_tensors(*a, **kw):
        raise AssertionError("a tensor was built for a description that is refused")

    for fn in ("empty", "empty_strided", "as_strided"):
        monkeypatch.setattr(torch, fn, no_tensors)
    for doc in (
        {"dtype": "bf16", "kv_caches": {"shape": [2, 16, 16, 8, 128], "repeat": 100_000_000}},
        {"dtype": "bf16", "kv_caches": {"repeat": 100_000, "of": {"repeat": 100_000, "of": [{"shape": [2]}, {"shape": [2]}]}}},
        {"dtype": "bf16", "kv_caches": {"layers.{i}": {"repeat": MAX_TENSORS + 1, "of": {"shape": [2]}}}},
    ):
        with pytest.raises(UsageError, match=f"at most {MAX_TENSORS:,}"):
            load_tensor_description(doc, device="cpu")
    monkeypatch.undo()
    rc, _, err = _detect(tmp_path, capsys, {"dtype": "bf16", "kv_caches": {"shape": [2, 16, 16, 8, 128], "repeat": 100_000_000}})
    assert "100,000,000 tensors" in _one_line_usage_error(rc, err)


def test_a_repeat_is_described_once(monkeypatch):
    parsed = []
    real = tensor_description._parse_leaf
    monkeypatch.setattr(tensor_description, "_parse_leaf", lambda *a: parsed.append(a) or real(*a))
    kv, _, _ = load_tensor_description(
        {"dtype": "bf16", "kv_caches": {"repeat": 300, "of": [{"shape": [2, 3]}, {"shape": [2, 3]}]}}, "meta"
    )
    assert len(kv) == 300 and len(parsed) == 2  # two leaves parsed, 600 tensors built from them


def test_storage_offset_step_is_honoured_inside_repeat_of(tmp_path):
    pair = [
        {"shape": [4, 8], "storage": "pool", "storage_offset": 0, "storage_offset_step": 64},
        {"shape": [4, 8], "storage": "pool", "storage_offset": 32, "storage_offset_step": 64},
    ]
    kv, _, _ = load_tensor_description({"dtype": "uint8", "kv_caches": {"repeat": 3, "of": pair}}, "cpu")
    assert [[t.storage_offset() for t in layer] for layer in kv] == [[0, 32], [64, 96], [128, 160]]
    base = kv[0][0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for layer in kv for t in layer)
    # nested repeats count copies outer-major; a leaf's own repeat counts too
    kv, _, _ = load_tensor_description(
        {
            "dtype": "uint8",
            "kv_caches": {"repeat": 2, "of": {"repeat": 3, "of": {"shape": [2], "storage": "s", "storage_offset_step": 10}}},
        },
        "cpu",
    )
    assert [[t.storage_offset() for t in row] for row in kv] == [[0, 10, 20], [30, 40, 50]]
    kv, _, _ = load_tensor_description(
        {"dtype": "uint8", "kv_caches": {"l.{i}": {"shape": [2], "storage": "s", "storage_offset_step": 7, "repeat": 3}}}, "cpu"
    )
    assert {k: t.storage_offset() for k, t in kv.items()} == {"l.0": 0, "l.1": 7, "l.2": 14}


def test_a_step_without_a_repeat_is_not_silently_ignored():
    with pytest.raises(UsageError, match="storage_offset_step.*not repeated"):
        load_tensor_description({"dtype": "uint8", "kv_caches": [{"shape": [2], "storage_offset_step": 4}]}, "cpu")


# -- the whole class: random descriptions never crash the CLI ----------------------------------

_ints = st.one_of(st.integers(-3, 40), st.integers(2**62, 2**72), st.sampled_from([0, 1, 2**31, 2**63 - 1, 2**63]))
_junk = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=4), _ints)
_leaf = st.fixed_dictionaries(
    {"shape": st.lists(_ints, min_size=0, max_size=5)},
    optional={
        "stride": st.lists(_ints, max_size=5),
        "dtype": st.sampled_from(["bf16", "float32", "uint8", "int64", "complex64", "quint8", "", 3]),
        "storage": st.one_of(st.sampled_from(["a", "b"]), _junk),
        "storage_offset": _ints,
        "storage_offset_step": _ints,
        "repeat": st.one_of(st.integers(0, 5), st.integers(10**6, 10**12), _junk),
    },
)
_node = st.recursive(
    st.one_of(_leaf, _junk),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["a", "l.{i}", "b"]), inner, max_size=2),
        st.fixed_dictionaries({"repeat": st.one_of(st.integers(0, 4), st.integers(10**5, 10**9), _junk), "of": inner}),
    ),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(doc=st.fixed_dictionaries({"kv_caches": _node}, optional={"dtype": st.sampled_from(["bf16", "uint8"]), "hints": _junk}))
def test_random_descriptions_never_show_an_internal_error(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("desc") / "d.json"
    path.write_text(json.dumps(doc))
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["detect", str(path), "--engine", ENGINE, "--device", "meta"])
    text = err.getvalue()
    assert rc in (0, 1, 2) and "internal error" not in text, text
    if rc == 2:
        assert len(text.strip().splitlines()) == 1, text

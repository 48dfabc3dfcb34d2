"""``KVFormat``: the pydantic declaration a plugin registers; facts derive from the name."""

from __future__ import annotations

import json

import pydantic
import pytest

import kvcore
from kvcore import FormatError, KVFormat, Source


def _fa_hnd() -> KVFormat:
    return KVFormat(
        name="NL_X_TWO_NB_NH_BS_HS",
        engines=["vllm"],
        attention_backends=["FLASH_ATTN"],
        description="vLLM FlashAttention, HND",
        sources=[Source(engine="vllm", version="0.11.0", file="vllm/v1/attention/backends/flash_attn.py::get_kv_cache_shape")],
    )


def test_derived_facts_come_from_the_name():
    f = _fa_hnd()
    assert (f.kv_size, f.is_mla, f.container, f.is_hnd, f.fused_kv, f.fused_nbbs, f.two_major) == (
        2,
        False,
        "layer_list",
        True,
        False,
        False,
        True,
    )
    assert f.symbolic == "NL x [2, NB, NH, BS, HS]"
    assert f.concrete({"NL": 32, "NB": 2048, "NH": 8, "BS": 16, "HS": 128}) == "32 x [2, 2048, 8, 16, 128]"
    assert str(f) == "NL_X_TWO_NB_NH_BS_HS"
    assert f.syntax.axes == ("TWO", "NB", "NH", "BS", "HS")

    mla = KVFormat(name="NL_X_NBBS_ONE_HS")
    assert (mla.kv_size, mla.is_mla, mla.container, mla.is_hnd, mla.fused_kv, mla.fused_nbbs, mla.two_major) == (
        1,
        True,
        "layer_list",
        False,
        False,
        True,
        False,
    )
    assert KVFormat(name="TWO_X_NL_X_NB_BS_NH_HS").container == "kv_list"
    assert KVFormat(name="NB_NL_TWO_BS_NH_HS").container == "cross_layer"
    assert KVFormat(name="NL_X_TWO_X_NB_BS_NH_HS").container == "per_layer_tuple"
    assert KVFormat(name="NL_X_NB_BS_NH_CS").fused_kv


def test_json_dump_includes_labels_sources_and_derived_facts():
    d = json.loads(_fa_hnd().model_dump_json())
    assert d == {
        "name": "NL_X_TWO_NB_NH_BS_HS",
        "engines": ["vllm"],
        "attention_backends": ["FLASH_ATTN"],
        "description": "vLLM FlashAttention, HND",
        "sources": [{"engine": "vllm", "version": "0.11.0", "file": "vllm/v1/attention/backends/flash_attn.py::get_kv_cache_shape"}],
        "kv_size": 2,
        "is_mla": False,
        "container": "layer_list",
        "is_hnd": True,
        "fused_kv": False,
        "fused_nbbs": False,
        "two_major": True,
        "symbolic": "NL x [2, NB, NH, BS, HS]",
    }
    # the dump (without derived fields) loads back to an equal model
    back = KVFormat.model_validate({k: d[k] for k in ("name", "engines", "attention_backends", "description", "sources")})
    assert back == _fa_hnd()


def test_frozen():
    f = _fa_hnd()
    with pytest.raises(pydantic.ValidationError):
        f.name = "NL_X_NB_BS_HS"
    with pytest.raises(pydantic.ValidationError):
        f.sources[0].engine = "sglang"
    assert f.name == "NL_X_TWO_NB_NH_BS_HS"


def test_defaults():
    f = KVFormat(name="NL_X_NB_BS_HS")
    assert (f.engines, f.attention_backends, f.description, f.sources) == ([], [], "", [])


def test_bad_name_raises_format_error_naming_the_token():
    with pytest.raises(FormatError, match="'FOO'"):
        KVFormat(name="NL_X_FOO_NB_BS_HS")
    with pytest.raises(FormatError, match="'NB' is repeated"):
        KVFormat(name="NL_X_NB_NB_BS_HS", engines=["x"])
    # model_validate bypasses __init__; pydantic still refuses, with the same message
    with pytest.raises(pydantic.ValidationError, match="'FOO'"):
        KVFormat.model_validate({"name": "NL_X_FOO_NB_BS_HS"})
    with pytest.raises(FormatError, match="name"):
        KVFormat()


def test_unknown_fields_are_refused_not_dropped():
    # the old docstring example said source=...; a dropped field would lose the provenance
    with pytest.raises(FormatError, match="source"):
        KVFormat(name="NL_X_NB_BS_HS", source=Source(engine="vllm"))
    with pytest.raises(FormatError, match="engines"):
        KVFormat(name="NL_X_NB_BS_HS", engines="vllm")
    with pytest.raises(pydantic.ValidationError, match="versoin"):
        Source(engine="vllm", versoin="0.11")


def test_source_str():
    assert str(Source(engine="vllm", version="0.11.0", file="a.py")) == "vllm 0.11.0 a.py"
    assert str(Source(engine="sglang")) == "sglang"


def test_get_format_of_an_unregistered_name(core_only):
    with pytest.raises(FormatError, match="no plugin registers format 'NL_X_NB_BS_HS'"):
        kvcore.get_format("NL_X_NB_BS_HS")
    with pytest.raises(FormatError, match="'FOO'"):
        kvcore.get_format("NL_X_FOO_HS")
    f = _fa_hnd()
    assert kvcore.get_format(f) is f


def test_hashable_by_name_and_equal_by_value():
    a, b = _fa_hnd(), _fa_hnd()
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    other = KVFormat(name="NL_X_TWO_NB_NH_BS_HS")  # same name, other labels
    assert other != a and len({a, other}) == 2

"""The ``kvcore`` command line, run in-process through ``kvcore.cli.main``.

A test plugin (engine ``clitest``) registers one format, a detector and a demo, so these
tests do not depend on an engine plugin being installed."""

from __future__ import annotations

import io
import json
import sys
import types

import pytest
import torch

import kvcore
from kvcore import cli
from kvcore.registry import PluginInfo

ENGINE = "clitest"
FORMAT = "NL_X_NB_BS_ONE_ONE_HS"  # a valid name no engine plugin registers
DEMO_CALLS: list[list[str]] = []


class _Plugin:
    @kvcore.hookimpl
    def kvcore_register_formats(self, register):
        register(
            kvcore.KVFormat(
                name=FORMAT,
                engines=[ENGINE],
                attention_backends=["TEST_ATTN"],
                description="test layout",
                sources=[kvcore.Source(engine=ENGINE, version="9.9", file="engine/attn.py::shape")],
            )
        )

    @kvcore.hookimpl
    def kvcore_detect(self, kv_caches, engine, hints):
        if engine != ENGINE:
            return None
        first = kv_caches[0]
        if first.dim() == 2:
            return kvcore.Detection(format=None, excluded="Mamba state: not KV")
        if first.dim() == 3:
            return kvcore.Detection(format="NL_X_NB_BS_HS", kv_caches=kv_caches, note="latent rows")
        if first.dim() != 5 or first.shape[0] != 2:
            return None
        if first.stride(3) > first.stride(2):  # HND memory exposed as the logical NHD shape
            return kvcore.Detection(format="NL_X_TWO_NB_NH_BS_HS", kv_caches=[t.transpose(2, 3) for t in kv_caches], note="HND by strides")
        # a tensor in memory order: dim 2 is BS (NHD) or NH (HND allocated in physical order)
        nhd = kvcore.Candidate("NL_X_TWO_NB_BS_NH_HS", kv_caches, decided_by={"kv_cache_layout": "NHD"})
        hnd = kvcore.Candidate("NL_X_TWO_NB_NH_BS_HS", kv_caches, decided_by={"kv_cache_layout": "HND"})
        layout = hints.get("kv_cache_layout") or ("NHD" if first.shape[2] != first.shape[3] else None)
        cands = [c for c in (nhd, hnd) if layout in (None, c.decided_by["kv_cache_layout"])]
        return kvcore.resolve(cands, engine=ENGINE, deciding_hints=["kv_cache_layout"])

    @kvcore.hookimpl
    def kvcore_register_demos(self, register):
        def run(argv):
            DEMO_CALLS.append(list(argv))
            if "--boom" in argv:
                raise SystemExit(2)
            print("demo ran " + " ".join(argv))
            return 1 if "--fail" in argv else 0

        register(ENGINE, run, "a test demo")


@pytest.fixture(autouse=True)
def plugin():
    kvcore.registry.host()  # load the installed plugins first
    name = kvcore.register_plugin(_Plugin(), "clitest-plugin")
    DEMO_CALLS.clear()
    yield
    kvcore.unregister_plugin(name)


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- help -----------------------------------------------------------------------------------


def test_help_lists_every_command(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for c in ("plugins", "formats", "hints", "describe", "detect", "doctor", "demo", "bench", "check"):
        assert f"    {c}" in out
    assert "exit codes" in out
    rc, _, _ = run(capsys)
    assert rc == 2  # no command: the help, as a usage error


@pytest.mark.parametrize("command", ["plugins", "formats", "hints", "describe", "detect", "doctor"])
def test_each_command_has_a_description_and_examples(command, capsys):
    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0
    assert "examples:" in out or "example " in out
    assert f"kvcore {command}" in out


def test_bad_arguments_are_usage_errors(capsys):
    rc, _, err = run(capsys, "formats", "--no-such-flag")
    assert rc == 2 and "unrecognized arguments" in err
    rc, _, err = run(capsys, "no-such-command")
    assert rc == 2 and "invalid choice" in err


# -- plugins --------------------------------------------------------------------------------


def test_plugins_table_and_json(capsys):
    rc, out, _ = run(capsys, "plugins")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["plugin", "distribution", "status"]
    core = next(x for x in lines if x.startswith("kvcore "))
    assert "ok" in core and "register_kernels" in core
    mine = next(x for x in lines if x.startswith("clitest-plugin"))
    assert "(registered in code)" in mine and " 1 " in mine and "detect" in mine and "register_demos" in mine
    rc, out, _ = run(capsys, "plugins", "--json")
    data = {p["name"]: p for p in json.loads(out)}
    assert data["clitest-plugin"]["formats"] == [FORMAT]
    assert data["clitest-plugin"]["distribution"] is None and data["clitest-plugin"]["error"] is None
    assert "kvcore_detect" in data["clitest-plugin"]["hooks"]
    assert data["kvcore"]["distribution"] == "kvcore" and data["kvcore"]["version"] == kvcore.__version__
    assert "reference" in data["kvcore"]["kernels"]


def test_plugins_shows_failures_with_their_error(capsys, monkeypatch):
    real = kvcore.plugins()
    broken = PluginInfo(name="broken", distribution="kvcore-broken", version="0.0.1", error="import failed: ImportError: no module named x")
    monkeypatch.setattr(kvcore, "plugins", lambda: real + [broken])
    rc, out, err = run(capsys, "plugins")
    assert rc == 0
    row = next(x for x in out.splitlines() if x.startswith("broken"))
    assert "kvcore-broken 0.0.1" in row and "FAILED" in row and "ImportError: no module named x" in row
    assert "KVCORE_DISABLE_PLUGINS=broken" in err


# -- formats --------------------------------------------------------------------------------


def test_formats_table_has_shape_facts_engines_source_and_plugin(capsys):
    rc, out, _ = run(capsys, "formats", "--engine", ENGINE)
    assert rc == 0
    head, _, row = out.splitlines()[:3]
    assert head.split() == ["name", "shape", "kv", "facts", "engines", "/", "backends", "source", "plugins"]
    assert row.startswith(FORMAT)
    assert "NL x [NB, BS, 1, 1, HS]" in row
    assert "layer_list MLA -  " in row  # no head axis: neither NHD nor HND
    assert f"{ENGINE} / TEST_ATTN" in row
    assert f"{ENGINE} 9.9 engine/attn.py::shape" in row
    assert row.rstrip().endswith("clitest-plugin")


def test_formats_json_and_filters(capsys):
    rc, out, _ = run(capsys, "formats", "--json")
    data = {f["name"]: f for f in json.loads(out)}
    assert rc == 0 and len(data) == len(kvcore.formats())
    f = data[FORMAT]
    assert f["kv_size"] == 1 and f["is_mla"] and f["container"] == "layer_list" and not f["is_hnd"]
    assert f["sources"] == [{"engine": ENGINE, "version": "9.9", "file": "engine/attn.py::shape"}]
    assert f["plugin"] == "clitest-plugin" and f["symbolic"] == "NL x [NB, BS, 1, 1, HS]"
    rc, out, _ = run(capsys, "formats", "--json", "--engine", ENGINE.upper())
    assert [x["name"] for x in json.loads(out)] == [FORMAT]
    # an engine nothing declares is a usage error (exit 2, as `kvcore hints nope`), one line, nothing on stdout
    for argv in (("formats", "--json", "--engine", "nope"), ("formats", "--engine", "nope")):
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and out == "" and "no registered format names engine 'nope'" in err and ENGINE in err
    assert run(capsys, "hints", "nope")[0] == 2


def test_formats_of_an_engine_include_what_its_fixtures_detect_and_every_declaring_plugin(capsys):
    """``--engine E`` lists every layout E's detector can return: those declared for E and
    those E's fixtures say it returns (declared by another plugin)."""

    class Reuser:
        @kvcore.hookimpl
        def kvcore_register_fixtures(self, register):
            from kvcore.testing import FixtureCase

            register(FixtureCase("reuse", "reuser", FORMAT, lambda *a: ([], {}), lambda *a: None, sizes={}))

        @kvcore.hookimpl
        def kvcore_register_formats(self, register):
            register(kvcore.KVFormat(name="NL_X_NB_BS_HS", engines=["reuser"]))

    kvcore.register_plugin(Reuser(), name="reuser-plugin")
    try:
        rc, out, _ = run(capsys, "formats", "--json", "--engine", "reuser")
        assert rc == 0 and [f["name"] for f in json.loads(out)] == ["NL_X_NB_BS_HS", FORMAT]
        with pytest.raises(kvcore.PluginError, match="not hashable"):
            kvcore.register_plugin(types.SimpleNamespace(kvcore_register_formats=_Plugin().kvcore_register_formats), name="twin")

        class Twin:  # declares FORMAT exactly as the test plugin does
            kvcore_register_formats = _Plugin.kvcore_register_formats

        kvcore.register_plugin(Twin(), name="twin")
        rc, out, _ = run(capsys, "formats", "--json", "--engine", ENGINE)
        [f] = json.loads(out)
        assert f["plugins"] == ["clitest-plugin", "twin"] and f["plugin"] == "clitest-plugin"
    finally:
        for n in ("reuser-plugin", "twin"):
            if n in {p.name for p in kvcore.plugins()}:
                kvcore.unregister_plugin(n)


# -- hints ----------------------------------------------------------------------------------


class _Hints:
    @kvcore.hookimpl
    def kvcore_register_hints(self, register):
        register(
            kvcore.Hint(
                engine=ENGINE,
                name="kv_cache_layout",
                meaning="the test engine's head order",
                values=["NHD", "HND"],
                aliases=["layout"],
                default="NHD unless BS == NH",
                source="engine/attn.py::layout",
            )
        )
        register(kvcore.Hint(engine=ENGINE, name="block_size", meaning="tokens per block", type="int > 0"))


def test_hints_lists_an_engines_declared_hints_with_meaning_and_values(capsys):
    kvcore.register_plugin(_Hints(), name="clitest-hints")
    try:
        rc, out, _ = run(capsys, "hints", ENGINE)
        assert rc == 0
        assert "kv_cache_layout (also layout)" in out and "the test engine's head order" in out
        assert "accepts: NHD, HND" in out and "default: NHD unless BS == NH" in out and "source:  engine/attn.py::layout" in out
        assert "accepts: int > 0" in out
        rc, out, _ = run(capsys, "hints", ENGINE, "--json")
        rows = json.loads(out)
        # the engine's own hints in declaration order, then kvcore's generic tensor_order (every engine accepts it)
        assert [r["name"] for r in rows] == ["kv_cache_layout", "block_size", "tensor_order"] and rows[0]["plugin"] == "clitest-hints"
        assert rows[2]["plugin"] == "kvcore" and rows[2]["values"] == ["allocated", "physical"]
        assert kvcore.hints(ENGINE)[0][1].values == ["NHD", "HND"]
        rc, out, _ = run(capsys, "hints")
        assert rc == 0 and any(line.split()[:2] == [ENGINE, "3"] for line in out.splitlines())
        rc, out, err = run(capsys, "hints", "no-such-engine")
        assert rc == 2 and out == "" and "no plugin declares hints for engine 'no-such-engine'" in err and ENGINE in err
    finally:
        kvcore.unregister_plugin("clitest-hints")
    assert kvcore.hints(ENGINE) == []


def test_a_bad_hint_declaration_is_a_plugin_error(capsys):
    class Bad:
        @kvcore.hookimpl
        def kvcore_register_hints(self, register):
            register({"name": "x"})

    with pytest.raises(kvcore.PluginError, match="takes a kvcore.Hint"):
        kvcore.register_plugin(Bad(), name="badhints")
    with pytest.raises(kvcore.PluginError, match="invalid kvcore.Hint 'x'"):
        kvcore.Hint(engine=ENGINE, name="x", meaning="")


# -- describe -------------------------------------------------------------------------------


def test_describe_llama_sizes(capsys):
    rc, out, _ = run(
        capsys, "describe", "NL_X_TWO_NB_BS_NH_HS", "--sizes", "NL=32,NB=2048,BS=16,NH=8,HS=128", "--dtype", "bfloat16", "--json"
    )
    d = json.loads(out)
    assert rc == 0
    assert d["symbolic"] == "NL x [2, NB, BS, NH, HS]"
    assert d["concrete"] == "32 x [2, 2048, 16, 8, 128]"
    assert d["facts"] == {
        "kv_size": 2,
        "is_mla": False,
        "container": "layer_list",
        "is_hnd": False,
        "fused_kv": False,
        "fused_nbbs": False,
        "two_major": True,
        "blocked_scale": False,
    }
    assert d["elements"] == 32 * 2 * 2048 * 16 * 8 * 128
    assert d["bytes"] == 4 * 2**30 and d["bytes_per_layer"] == 128 * 2**20
    assert [a["token"] for a in d["axes"]] == ["TWO", "NB", "BS", "NH", "HS"]
    assert [a["size"] for a in d["axes"]] == [2, 2048, 16, 8, 128]
    rc, out, _ = run(capsys, "describe", "NL_X_TWO_NB_BS_NH_HS", "--sizes", "NL=32,NB=2048,BS=16,NH=8,HS=128", "--dtype", "bf16")
    assert "concrete   32 x [2, 2048, 16, 8, 128]" in out and "4.0 GiB" in out and "128.0 MiB" in out


def test_describe_derives_pbs_and_cs_and_reports_missing_sizes(capsys):
    rc, out, _ = run(capsys, "describe", "TWO_X_NL_X_NBBS_NH_HS", "--sizes", "NL=4,NB=10,BS=16,NH=2,HS=64", "--json")
    assert rc == 0 and json.loads(out)["concrete"] == "2 x 4 x [160, 2, 64]"
    rc, out, _ = run(capsys, "describe", "NL_X_NB_NH_BS_CS", "--sizes", "nl=4,nb=10,bs=16,nh=2,hs=64", "--json")
    d = json.loads(out)
    assert d["concrete"] == "4 x [10, 2, 16, 128]" and d["facts"]["fused_kv"] and d["facts"]["is_hnd"]
    rc, out, _ = run(capsys, "describe", "NL_X_NB_BS_HS", "--sizes", "NL=61", "--json")
    d = json.loads(out)
    assert d["concrete"] == "61 x [NB, BS, HS]" and d["missing_sizes"] == ["BS", "HS", "NB"] and "elements" not in d


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn", "uint8", "int8"])
def test_describe_derives_split_head_sizes_from_the_dtype(capsys, dtype):
    """Review item 14: a split-K name (HSC chunks of HSE elements) gets HSE = 16 bytes /
    element size (vLLM's x) from --dtype, HSC = HS / HSE, for every element size; the
    bytes agree with the unsplit name; the multi-plane name splits only its K plane."""
    esz = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    x = 16 // esz
    sizes = "NL=2,NB=8,BS=16,NH=4,HS=128"
    rc, out, _ = run(capsys, "describe", "NL_X_NB_NH_HSC_BS_HSE", "--sizes", sizes, "--dtype", dtype, "--json")
    d = json.loads(out)
    assert rc == 0 and d["concrete"] == f"2 x [8, 4, {128 // x}, 16, {x}]" and "missing_sizes" not in d
    rc, out, _ = run(capsys, "describe", "NL_X_NB_NH_HS_BS", "--sizes", sizes, "--dtype", dtype, "--json")
    assert json.loads(out)["bytes"] == d["bytes"] == 2 * 8 * 4 * 128 * 16 * esz
    rc, out, _ = run(capsys, "describe", "K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS", "--sizes", sizes, "--dtype", dtype)
    assert rc == 0 and f"concrete   K: 2 x [8, 4, {128 // x}, 16, {x}] + V: 2 x [8, 4, 128, 16]" in out


def test_describe_derives_whole_and_part_sizes_and_says_what_is_missing(capsys):
    def concrete(name, sizes):
        rc, out, _ = run(capsys, "describe", name, "--sizes", sizes, "--json")
        assert rc == 0
        d = json.loads(out)
        return d["concrete"], d.get("missing_sizes")

    assert concrete("NL_X_NB_NH_HSC_BS_HSE", "NL=1,NB=2,BS=16,NH=4,HSC=16,HSE=8") == ("1 x [2, 4, 16, 16, 8]", None)  # HS = 128
    assert concrete("NL_X_NB_NH_HSC_BS_HSE", "NL=1,NB=2,BS=16,NH=4,HS=128,HSC=32") == ("1 x [2, 4, 32, 16, 4]", None)
    assert concrete("NL_X_NB_NH_BSC_HS_BSE", "NL=1,NB=2,BS=16,NH=4,HS=64,BSE=4") == ("1 x [2, 4, 4, 64, 4]", None)
    assert concrete("NL_X_NB_NH_BSC_HS_BSE", "NL=1,NB=2,BS=16,NH=4,HS=64,BSC=8") == ("1 x [2, 4, 8, 64, 2]", None)
    assert concrete("NL_X_NB_NH_HSC_BS_HSE", "NL=1,NB=2,BS=16,NH=4,HS=128")[1] == ["HSC", "HSE"]
    rc, out, _ = run(capsys, "describe", "NL_X_NB_NH_HSC_BS_HSE", "--sizes", "NL=1,NB=2,BS=16,NH=4,HS=128")
    assert "HSE (elements per head chunk: give HSE=, or --dtype to derive it as 16 bytes / element size, vLLM's x)" in out
    rc, out, _ = run(capsys, "describe", "--help")
    flat = " ".join(out.split())  # argparse wraps the help
    assert "HSE = 16 bytes / element size with --dtype (vLLM's x), HSC = HS/HSE, BSC = BS/BSE" in flat
    assert "K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS --sizes" in flat and "HSC/HSE a head's elements split in chunks" in flat


def test_describe_shows_sources_of_a_registered_format(capsys):
    rc, out, _ = run(capsys, "describe", FORMAT)
    assert rc == 0
    assert "(not registered" not in out
    assert "plugin     clitest-plugin" in out and f"sources    {ENGINE} 9.9 engine/attn.py::shape" in out
    rc, out, _ = run(capsys, "describe", "NB_NL_NH_BS_TWO_HS")
    assert rc == 0 and "(not registered by any plugin)" in out and "NB x" not in out
    rc, out, _ = run(capsys, "describe", "NL_X_NB_BS_ONE_HS_ONE", "--json")
    d = json.loads(out)
    assert rc == 0 and d["registered"] is False and FORMAT in d["similar"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["NL_X_FOO_NB_BS_HS"], "unknown token 'FOO'"),
        (["NL_X_TWO_NB_BS_NH_HS_TWO"], "TWO"),
        (["NL_X_NB_BS_HS", "--sizes", "NL=3,XX=4"], "--sizes key 'XX'"),
        (["NL_X_NB_BS_HS", "--sizes", "NL=three"], "not an integer"),
        (["NL_X_NB_BS_HS", "--sizes", "NL=0"], "must be positive"),
        (["NL_X_NB_BS_HS", "--sizes", "NL"], "KEY=VALUE"),
        (["NL_X_NB_BS_HS", "--dtype", "float99"], "unknown dtype"),
        (["NL_X_NB_NH_HSC_BS_HSE", "--sizes", "HS=128,HSC=10,HSE=8"], "HSC=10 x HSE=8 = 80, but HS=128"),
        (["NL_X_NB_NH_HSC_BS_HSE", "--sizes", "HS=100", "--dtype", "bfloat16"], "HS=100 is not a multiple of HSE=8 (16 bytes"),
        (["NL_X_NB_NH_HSC_BS_HSE", "--sizes", "HS=128,HSC=12"], "HS=128 is not a multiple of HSC=12"),
        (["NL_X_NB_NH_BSC_HS_BSE", "--sizes", "BS=16,BSE=3"], "BS=16 is not a multiple of BSE=3"),
        (["K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS", "--sizes", "HS=128,K.HSE=6"], "K.HS=128 is not a multiple of K.HSE=6"),
    ],
)
def test_describe_bad_input_exits_2_with_the_reason(argv, message, capsys):
    rc, out, err = run(capsys, "describe", *argv)
    assert rc == 2 and out == "" and message in err


# -- detect ---------------------------------------------------------------------------------


def _write(tmp_path, doc) -> str:
    p = tmp_path / "cache.json"
    p.write_text(json.dumps(doc))
    return str(p)


HND_DOC = {
    "engine": ENGINE,
    "dtype": "bfloat16",
    "kv_caches": {
        "model.layers.{i}.self_attn.attn": {
            # memory (2, NB, NH, BS, HS), exposed as (2, NB, BS, NH, HS)
            "shape": [2, 2048, 16, 8, 128],
            "stride": [33554432, 16384, 128, 2048, 1],
            "repeat": 32,
        }
    },
}


def test_detect_a_llama_cache_from_a_description(tmp_path, capsys):
    rc, out, _ = run(capsys, "detect", _write(tmp_path, HND_DOC), "--json")
    d = json.loads(out)
    assert rc == 0
    assert d["format"] == "NL_X_TWO_NB_NH_BS_HS" and d["concrete"] == "32 x [2, 2048, 8, 16, 128]"
    assert (d["num_layers"], d["num_blocks"], d["block_size"], d["num_heads"], d["head_size"], d["kv_size"]) == (32, 2048, 16, 8, 128, 2)
    assert d["dtype"] == "bfloat16" and d["is_hnd"] and d["engine"] == ENGINE
    assert d["layer_names"][0] == "model.layers.0.self_attn.attn" and d["layer_names"][31] == "model.layers.31.self_attn.attn"
    assert d["bytes_per_layer"] == 128 * 2**20
    rc, out, _ = run(capsys, "detect", _write(tmp_path, HND_DOC))
    assert rc == 0 and "32 x [2, 2048, 8, 16, 128]" in out and "HND" in out


@pytest.mark.parametrize("device", ["cpu", "meta", "auto"])
def test_detect_devices_keep_layers_distinct(tmp_path, capsys, device):
    rc, out, _ = run(capsys, "detect", _write(tmp_path, HND_DOC), "--json", "--device", device)
    d = json.loads(out)
    assert rc == 0 and d["num_layers"] == 32 and d["device"] == ("meta" if device == "meta" else "cpu")


def test_detect_reads_stdin_and_merges_hints(monkeypatch, capsys):
    doc = {"kv_caches": [{"shape": [2, 4, 8, 8, 16], "dtype": "float16"}, {"shape": [2, 4, 8, 8, 16], "dtype": "float16"}]}
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(doc)))
    rc, out, err = run(capsys, "detect", "-", "--engine", ENGINE, "--json")
    d = json.loads(out)
    assert rc == 1 and d["error"] == "AmbiguousLayoutError"  # BS == NH, contiguous: NHD or HND?
    assert d["hints"] == ["kv_cache_layout"] and set(d["candidates"]) == {"NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS"}
    assert "kv_cache_layout" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(doc)))
    rc, out, _ = run(capsys, "detect", "-", "--engine", ENGINE, "--hints", '{"kv_cache_layout": "NHD"}', "--json")
    assert rc == 0 and json.loads(out)["format"] == "NL_X_TWO_NB_BS_NH_HS"


def test_detect_nothing_recognises_it(tmp_path, capsys):
    doc = {"kv_caches": [{"shape": [3, 4, 8, 8, 16], "dtype": "bfloat16"}]}
    rc, out, err = run(capsys, "detect", _write(tmp_path, doc), "--engine", ENGINE)
    assert rc == 1 and out == ""
    assert "no kvcore plugin recognises" in err and "shape=[3, 4, 8, 8, 16]" in err


def test_detect_per_layer_groups_a_hybrid(tmp_path, capsys):
    doc = {
        "engine": ENGINE,
        "dtype": "bfloat16",
        "kv_caches": [
            {"shape": [2, 4, 8, 2, 16]},
            {"shape": [4, 8, 64]},
            {"shape": [4, 100], "dtype": "float32"},
            {"shape": [2, 4, 8, 2, 16]},
        ],
    }
    rc, out, _ = run(capsys, "detect", _write(tmp_path, doc), "--per-layer", "--json")
    d = json.loads(out)
    assert rc == 0 and d["excluded_layers"] == [2]
    groups = {g["format"]: g for g in d["groups"]}
    assert groups["NL_X_TWO_NB_BS_NH_HS"]["layer_ids"] == [0, 3] and groups["NL_X_NB_BS_HS"]["layer_ids"] == [1]
    rc, out, _ = run(capsys, "detect", _write(tmp_path, doc), "--per-layer")
    assert "group 0: layers [0, 3]" in out and "not KV (excluded): layers [2]" in out


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"kv_caches": [{"shape": [2, 3], "dtype": "bfloat16", "strides": [3, 1]}]}, "unknown key(s) ['strides']"),
        ({"kv_caches": [{"shape": [2, 3]}]}, "no dtype"),
        ({"kv_caches": [{"shape": [2, 3], "stride": [3], "dtype": "bf16"}]}, "has 1 entries but shape"),
        ({"kv_caches": [{"shape": [2, 3], "stride": [-3, 1], "dtype": "bf16"}]}, "negative strides"),
        ({"kv_caches": {"layer": {"shape": [2, 3], "dtype": "bf16", "repeat": 2}}}, "put '{i}' in the name"),
        ({"kv_caches": [{"shape": [2, 3], "dtype": "bf16", "repeat": 0}]}, "repeat must be a positive integer"),
        ({"kv_caches": []}, "empty list"),
        ({"kv_caches": [3]}, "expected a tensor"),
        ({"kv_caches": [{"shape": [2, 3], "dtype": "complex64"}]}, "unknown dtype"),
        ({"kv_caches": [], "extra": 1}, "unknown top-level key(s) ['extra']"),
    ],
)
def test_detect_bad_descriptions_exit_2(tmp_path, capsys, doc, message):
    rc, out, err = run(capsys, "detect", _write(tmp_path, doc), "--engine", ENGINE)
    assert rc == 2 and out == "" and message in err


def test_detect_usage_errors(tmp_path, capsys):
    rc, _, err = run(capsys, "detect", str(tmp_path / "missing.json"), "--engine", ENGINE)
    assert rc == 2 and "cannot read" in err
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    rc, _, err = run(capsys, "detect", str(p), "--engine", ENGINE)
    assert rc == 2 and "not valid JSON" in err
    doc = {"kv_caches": [{"shape": [2, 4, 8, 2, 16], "dtype": "bf16"}]}
    rc, _, err = run(capsys, "detect", _write(tmp_path, doc))
    assert rc == 2 and "no engine" in err
    rc, _, err = run(capsys, "detect", _write(tmp_path, doc), "--engine", ENGINE, "--hints", "[1]")
    assert rc == 2 and "--hints must be a JSON object" in err


def test_tensor_descriptions_build_views_of_shared_storage():
    doc = {
        "dtype": "bfloat16",
        "kv_caches": [
            {
                "shape": [4, 8, 2, 32],
                "stride": [512, 64, 32, 1],
                "storage": "pool",
                "storage_offset": 16,
                "storage_offset_step": 4096,
                "repeat": 3,
            }
        ],
    }
    kv, engine, hints = cli.load_tensor_description(doc, device="cpu")
    assert engine is None and hints == {}
    assert len(kv) == 3
    base = kv[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in kv)
    assert [t.storage_offset() for t in kv] == [16, 4112, 8208]
    assert all(t.stride() == (512, 64, 32, 1) and t.dtype == torch.bfloat16 for t in kv)
    assert kv[0].untyped_storage().nbytes() >= (8208 + 3 * 512 + 7 * 64 + 32 + 31 + 1) * 2
    # nested repeat of a per-layer pair, and bare lists
    kv, _, _ = cli.load_tensor_description(
        {"repeat": 2, "of": [{"shape": [3, 4], "dtype": "uint8"}, {"shape": [3, 4], "dtype": "uint8"}]}, device="meta"
    )
    assert len(kv) == 2 and len(kv[0]) == 2 and kv[1][1].device.type == "meta"


# -- doctor ---------------------------------------------------------------------------------


def test_doctor_reports_versions_devices_kernels(capsys):
    from kvcore.kernels import select_kernel

    rc, out, _ = run(capsys, "doctor", "--json")
    d = json.loads(out)
    assert rc == 0
    assert d["torch"] == torch.__version__ and d["kvcore"] == kvcore.__version__
    assert d["python"].count(".") == 2
    assert d["devices"][0]["type"] == "cpu" and d["devices"][0]["count"] >= 1
    assert {k["name"] for k in d["kernels"]} >= {"reference"}
    cpu = d["serving"]["cpu"]
    assert cpu["kernel"] == select_kernel("cpu", FORMAT).name and cpu["why"]
    assert set(d["compilers"]) >= {"c++", "nvcc", "ninja"}
    assert any(p["name"] == "clitest-plugin" for p in d["plugins"])
    rc, out, _ = run(capsys, "doctor")
    assert rc == 0 and "serving" in out and "compilers" in out and f"torch      {torch.__version__}" in out


def test_doctor_has_a_row_for_every_registered_kernel_and_the_device_types_they_claim(capsys):
    """Review item 12: every registered kernel has a row (the Triton kernel of kvcore-xpu
    included, though no XPU is here), and every device type a kernel claims has a serving
    row saying which kernels would serve it."""
    rc, out, _ = run(capsys, "doctor", "--json")
    d = json.loads(out)
    registered = {k.name for k in kvcore.registry.kernels()}
    assert {k["name"] for k in d["kernels"]} == registered
    claimed = {t for k in kvcore.registry.kernels() for t in k.device_types if t != "meta"}
    assert set(d["serving"]) == claimed
    rc, text, _ = run(capsys, "doctor")
    for name in registered:
        assert any(line.split()[:1] == [name] for line in text.splitlines() if line.startswith("  ")), name
    for dev in claimed:
        assert any(line.startswith(f"  {dev} ") for line in text.splitlines()), dev
    if "xpu" in {p.name for p in kvcore.plugins() if p.error is None}:
        assert "triton-xpu" in registered and "triton-xpu" in d["serving"]["xpu"]["why"]


def test_an_unknown_forced_kernel_names_the_registered_ones(capsys, monkeypatch):
    """Review item 12: KVCORE_KERNEL naming no kernel says so and lists every registered
    kernel (a transfer raises it; doctor shows it for the device); a kernel that exists but
    does not serve the device says that instead."""
    registered = sorted({k.name for k in kvcore.registry.kernels()})
    lay = kvcore.build_layout("NL_X_TWO_NB_BS_NH_HS", [torch.zeros(2, 4, 4, 2, 8)])
    monkeypatch.setenv("KVCORE_KERNEL", "nosuch")
    want = f"KVCORE_KERNEL=nosuch: no kernel of that name is registered (registered kernels: {', '.join(registered)})"
    for call in (lambda: kvcore.gather(lay, [1]), lambda: kvcore.scatter(lay, [1], torch.zeros(2, 1, 1, 16))):
        with pytest.raises(kvcore.TransferError) as ei:
            call()
        assert str(ei.value).startswith(want) and "Unset KVCORE_KERNEL" in str(ei.value)
    rc, out, _ = run(capsys, "doctor", "--json")
    assert json.loads(out)["serving"]["cpu"]["why"].startswith(want)
    monkeypatch.setenv("KVCORE_KERNEL", "native-cuda")
    with pytest.raises(kvcore.TransferError, match="KVCORE_KERNEL=native-cuda does not serve device type 'cpu' .*kernels that serve"):
        kvcore.gather(lay, [1])


def test_doctor_wraps_long_lines_without_breaking_paths(capsys, monkeypatch):
    """Review item 13: long explanations wrap at 100 columns under their label; a path (with
    hyphens, longer than a line) is never broken, so it can be copied."""
    from kvcore import kernels

    path = "/opt/some-very-long/build-directory-with-hyphens/" + "x" * 90 + "/kvcore_native-cpu-torch2.13"
    real = kernels.kernel_report

    def report():
        rows = real()
        rows[0] = {**rows[0], "why": f"built at {path} (a long explanation of the kernel, " + "and more words " * 12 + ")"}
        return rows

    monkeypatch.setattr(kernels, "kernel_report", report)
    monkeypatch.setenv("KVCORE_TEST_LONG_PATH", path)
    monkeypatch.setenv("KVCORE_TEST_OTHER", "y" * 40)
    rc, out, _ = run(capsys, "doctor")
    assert rc == 0
    lines = out.splitlines()
    assert sum(path in line for line in lines) == 2  # whole, in the kernel row and in env
    for line in lines:
        if len(line) > 100:  # only a token longer than a line may pass the width, alone on its line
            assert len(line.split()) <= 2 and any(path in tok for tok in line.split()), line
    assert any(line.startswith("env        ") for line in lines)


# -- demo, bench, check ---------------------------------------------------------------------


def test_demo_dispatches_with_the_remaining_arguments(capsys):
    rc, out, _ = run(capsys, "demo", "--engine", ENGINE, "--num-blocks", "8", "--json")
    assert rc == 0 and DEMO_CALLS == [["--num-blocks", "8", "--json"]] and "demo ran --num-blocks 8 --json" in out
    rc, _, _ = run(capsys, "demo", "--fail", "--engine", ENGINE)
    assert rc == 1 and DEMO_CALLS[-1] == ["--fail"]
    rc, _, _ = run(capsys, "demo", "--engine", ENGINE, "--boom")
    assert rc == 2
    rc, _, _ = run(capsys, "demo", "--engine", ENGINE, "--help")  # the demo's own help
    assert DEMO_CALLS[-1] == ["--help"]


def test_demo_listing_and_unknown_engine(capsys):
    rc, out, _ = run(capsys, "demo", "--list")
    assert rc == 0 and f"{ENGINE}" in out and "a test demo" in out and "[plugin clitest-plugin]" in out
    for flag in ("--help", "-h"):  # review item 15: a usage line, options and runnable examples
        rc, out, _ = run(capsys, "demo", flag)
        assert rc == 0 and out.startswith("usage: kvcore demo [--engine NAME] [--list] [-h] [DEMO ARGS ...]\n")
        assert "examples:" in out and ENGINE in out and "-h, --help" in out
        examples = out.split("examples:\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert len(examples) >= 4 and all(e.strip().startswith("kvcore demo") for e in examples)
        assert any("--pd" in e for e in examples) and any(e.split("#")[0].strip().endswith("--help") for e in examples)
    rc, out, err = run(capsys, "demo", "--engine", "no-such")
    assert rc == 2 and "no demo named 'no-such'" in err and ENGINE in err


def test_bench_and_check_dispatch_lazily(capsys, monkeypatch):
    seen = {}
    fake = types.ModuleType("kvcore.bench")
    fake.add_arguments = lambda p: p.add_argument("--tokens", type=int, default=1)
    fake.run = lambda args: seen.setdefault("tokens", args.tokens) and 0
    monkeypatch.setitem(sys.modules, "kvcore.bench", fake)
    rc, _, _ = run(capsys, "bench", "--tokens", "7")
    assert rc == 0 and seen == {"tokens": 7}
    rc, _, err = run(capsys, "bench", "--nope")
    assert rc == 2 and "unrecognized arguments" in err

    real = cli._optional_module
    monkeypatch.setattr(cli, "_optional_module", lambda name: None if name == "kvcore.testing.check" else real(name))
    rc, out, err = run(capsys, "check", "vllm")
    assert rc == 2 and out == "" and "kvcore.testing.check, which is not installed" in err


def test_unexpected_errors_become_exit_1(capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("kaput")

    monkeypatch.setattr(cli, "cmd_doctor", boom)
    monkeypatch.delenv("KVCORE_DEBUG", raising=False)
    rc, _, err = run(capsys, "doctor")
    assert rc == 1 and "internal error: RuntimeError: kaput" in err


def test_detect_json_honours_fp8_fnuz(tmp_path, capsys):
    """A ROCm fp8 cache described from a log: the dtype hint names FNUZ, and the layout says so."""
    hints = {"vllm_version": "0.24", "attention_backend": "FLASHINFER", "kv_cache_layout": "NHD", "cache_dtype": "fp8"}
    doc = {"engine": "vllm", "hints": {**hints, "dtype": "float8_e4m3fnuz"}, "kv_caches": [{"shape": [3, 2, 16, 2, 64], "dtype": "uint8"}]}
    rc, out, _ = run(capsys, "detect", _write(tmp_path, doc), "--json")
    d = json.loads(out)
    assert rc == 0 and (d["format"], d["dtype"], d["storage_dtype"]) == ("NL_X_NB_TWO_BS_NH_HS", "float8_e4m3fnuz", "uint8")
    # without the dtype, a description says nothing of the platform: ROCm's fp8 is never assumed
    doc["hints"] = hints
    rc, out, _ = run(capsys, "detect", _write(tmp_path, doc), "--json")
    d = json.loads(out)
    assert rc == 1 and d["error"] == "AmbiguousLayoutError" and set(d["hints"]) == {"dtype", "device_type"}


def test_detect_per_layer_of_a_mapping_reports_names(tmp_path, capsys):
    doc = {
        "engine": ENGINE,
        "dtype": "bfloat16",
        "kv_caches": {"b.layers.1": {"shape": [2, 4, 8, 2, 16]}, "a.layers.0": {"shape": [4, 100], "dtype": "float32"}},
    }
    rc, out, _ = run(capsys, "detect", _write(tmp_path, doc), "--per-layer", "--json")
    d = json.loads(out)
    # positions in the mapping's own order, and the names
    assert rc == 0 and d["excluded_layers"] == [1] and d["excluded_layer_names"] == ["a.layers.0"]
    assert d["groups"][0]["layer_ids"] == [0] and d["groups"][0]["layer_names"] == ["b.layers.1"]

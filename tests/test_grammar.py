"""The layout grammar: every LMCache ``EngineKVFormat`` name parses, renders and yields the
facts of LMCache's ``EngineKVFormat`` members (the enum and ``FormatFacts`` helpers of
``csrc/engine_kv_format.h``, LMCache 0.5.6); malformed names raise FormatError naming
the token."""

from __future__ import annotations

import pytest

import kvcore
from kvcore.errors import FormatError
from kvcore.grammar import TOKENS, parse, render_concrete, render_symbolic

# name -> (symbolic template as §1.2 renders it, kv_size, is_mla, container, is_hnd,
#          fused_kv, fused_nbbs, two_major)
#
# Facts come from §1.3's "facts set true" table. Two deliberate kvcore readings:
# * kv_size counts the K and V planes of kvcore's staging layout [kv_size, NL, T, NH*HS]:
#   fused K|V formats (CS, and the deprecated ..._TWO_HS #10/#11) hold K and V, so kv_size
#   is 2 where LMCache's kernel descriptor says 1 (§1.2 "Kernels treat it as kv_size==1";
#   §7.2 lists that very inconsistency). Their fusion is the fused_kv fact (is_fused_packed).
# * fused_nbbs is true for #4: §1.3 notes the C++ row says false "although the format folds
#   NB·BS" and the descriptor's derived fact is true; kvcore derives it from the name.
LL, KVL, C, T = "layer_list", "kv_list", "cross_layer", "per_layer_tuple"
MEMBERS = {
    # 0..17: csrc/engine_kv_format.h (newest), §1.2
    "NB_NL_TWO_BS_NH_HS": ("[NB, NL, 2, BS, NH, HS]", 2, False, C, False, False, False, False),
    "NL_X_TWO_NB_BS_NH_HS": ("NL x [2, NB, BS, NH, HS]", 2, False, LL, False, False, False, True),
    "NL_X_NB_TWO_BS_NH_HS": ("NL x [NB, 2, BS, NH, HS]", 2, False, LL, False, False, False, False),
    "NL_X_NB_BS_HS": ("NL x [NB, BS, HS]", 1, True, LL, False, False, False, False),
    "TWO_X_NL_X_NBBS_NH_HS": ("2 x NL x [PBS, NH, HS]", 2, False, KVL, False, False, True, False),
    "NL_X_NBBS_ONE_HS": ("NL x [PBS, 1, HS]", 1, True, LL, False, False, True, False),
    "NL_X_TWO_NB_NH_BS_HS": ("NL x [2, NB, NH, BS, HS]", 2, False, LL, True, False, False, True),
    "NL_X_NB_TWO_NH_BS_HS": ("NL x [NB, 2, NH, BS, HS]", 2, False, LL, True, False, False, False),
    "NB_NL_TWO_NH_BS_HS": ("[NB, NL, 2, NH, BS, HS]", 2, False, C, True, False, False, False),
    "TWO_X_NL_X_NB_BS_NH_HS": ("2 x NL x [NB, BS, NH, HS]", 2, False, KVL, False, False, False, False),
    "NL_X_NB_NH_BS_TWO_HS": ("NL x [NB, NH, BS, 2, HS]", 2, False, LL, True, True, False, False),
    "NL_X_NB_BS_NH_TWO_HS": ("NL x [NB, BS, NH, 2, HS]", 2, False, LL, False, True, False, False),
    "NL_X_NB_NH_BS_CS": ("NL x [NB, NH, BS, CS]", 2, False, LL, True, True, False, False),
    "NL_X_NB_BS_NH_CS": ("NL x [NB, BS, NH, CS]", 2, False, LL, False, True, False, False),
    "NL_X_NB_BSV_BSS": ("NL x [NB, BSxVALS, BSxSCALES]", 1, True, LL, False, False, False, False),
    "NL_X_TWO_NB_NH_ONE_BS_HS": ("NL x [2, NB, NH, 1, BS, HS]", 2, False, LL, True, False, False, True),
    "NL_X_TWO_X_NB_BS_NH_HS": ("NL x 2 x [NB, BS, NH, HS]", 2, False, T, False, False, False, False),
    "NL_X_NP_X_NB_BS_ONE_HS": ("NL x NP x [NB, BS, 1, HS]", 1, True, T, False, False, False, False),
    # branch-only names (§1.2 "Seen only on branches")
    "NB_NL_NH_BS_CS": ("[NB, NL, NH, BS, CS]", 2, False, C, True, True, False, False),
    "NB_NL_BS_NH_CS": ("[NB, NL, BS, NH, CS]", 2, False, C, False, True, False, False),
    # independent components: kv_size 1 (§1.2) but with real heads, so not MLA
    "NL_X_NB_BS_NH_HS": ("NL x [NB, BS, NH, HS]", 1, False, LL, False, False, False, False),
    # the name value 17 had in an earlier revision (§1.2 #17 notes)
    "NL_X_TWO_X_NB_BS_HS": ("NL x 2 x [NB, BS, HS]", 2, False, T, False, False, False, False),
}

_LABEL_TO_TOKEN = {t.label: name for name, t in TOKENS.items()}


def _unrender(symbolic: str) -> str:
    """The inverse of render_symbolic, written independently: labels back to tokens."""
    *levels, inner = symbolic.split(" x ")
    assert inner.startswith("[") and inner.endswith("]")
    axes = [_LABEL_TO_TOKEN[a] for a in inner[1:-1].split(", ")]
    return "_X_".join([_LABEL_TO_TOKEN[lv] for lv in levels] + ["_".join(axes)])


@pytest.mark.parametrize("name", list(MEMBERS))
def test_every_member_parses_renders_and_round_trips(name):
    symbolic, *_ = MEMBERS[name]
    s = parse(name)
    assert s.name == name
    assert "_X_".join(list(s.list_levels) + ["_".join(s.axes)]) == name
    assert render_symbolic(name) == symbolic
    assert s.symbolic() == symbolic
    assert _unrender(symbolic) == name
    assert kvcore.parse_format(name) == s


@pytest.mark.parametrize("name", list(MEMBERS))
def test_every_member_facts_match_the_reference(name):
    _, kv_size, is_mla, container, is_hnd, fused_kv, fused_nbbs, two_major = MEMBERS[name]
    s = parse(name)
    got = (s.kv_size, s.is_mla, s.container, s.is_hnd, s.fused_kv, s.fused_nbbs, s.two_major)
    assert got == (kv_size, is_mla, container, is_hnd, fused_kv, fused_nbbs, two_major)


def test_facts_of_names_beyond_the_enum():
    # two-major over a fused slot axis; HND with the element axis not innermost (a
    # transposed V cache, [NB, NH, HS, BS]); K|V fused only when TWO sits right outside HS
    assert parse("NL_X_TWO_NBBS_NH_HS").two_major
    assert not parse("NL_X_NBBS_TWO_NH_HS").two_major
    assert parse("NL_X_NB_NH_HS_BS").is_hnd
    assert not parse("NL_X_NB_BS_TWO_NH_HS").fused_kv
    assert not parse("NL_X_NB_BS_NH_HS_TWO").fused_kv
    assert parse("NB_BS_NH_HS").container == "cross_layer"


def test_blocked_scale_and_plane_facts():
    assert parse("NL_X_NB_BSV_BSS").blocked_scale
    assert not parse("NL_X_NB_BS_HS").blocked_scale
    s = parse("NL_X_NP_X_NB_BS_ONE_HS")
    assert s.list_levels == ("NL", "NP") and s.axes == ("NB", "BS", "ONE", "HS")
    assert s.axis("ONE") == 2 and s.axis("TWO") is None and s.has("NP")


@pytest.mark.parametrize(
    "name, sizes, expected",
    [
        ("NL_X_TWO_NB_BS_NH_HS", {"NL": 32, "NB": 2048, "BS": 16, "NH": 8, "HS": 128}, "32 x [2, 2048, 16, 8, 128]"),
        ("NL_X_TWO_NB_NH_BS_HS", {"NL": 80, "NB": 2048, "BS": 16, "NH": 8, "HS": 128}, "80 x [2, 2048, 8, 16, 128]"),
        ("TWO_X_NL_X_NBBS_NH_HS", {"NL": 32, "PBS": 65536, "NH": 8, "HS": 128}, "2 x 32 x [65536, 8, 128]"),
        ("NL_X_NBBS_ONE_HS", {"NL": 61, "PBS": 4096, "HS": 576}, "61 x [4096, 1, 576]"),
        ("NB_NL_TWO_BS_NH_HS", {"NL": 32, "NB": 1000, "BS": 16, "NH": 8, "HS": 128}, "[1000, 32, 2, 16, 8, 128]"),
        ("NL_X_NB_BS_NH_CS", {"NL": 4, "NB": 10, "BS": 16, "NH": 2, "CS": 256}, "4 x [10, 16, 2, 256]"),
        ("NL_X_NB_BSV_BSS", {"NL": 61, "NB": 100, "BS": 64, "VALS": 576, "SCALES": 8}, "61 x [100, 64x576, 64x8]"),
        ("NL_X_NP_X_NB_BS_ONE_HS", {"NL": 3, "NP": 2, "NB": 7, "BS": 128, "HS": 512}, "3 x 2 x [7, 128, 1, 512]"),
        ("NL_X_TWO_X_NB_BS_NH_HS", {"NL": 3, "NB": 7, "BS": 128, "NH": 1, "HS": 64}, "3 x 2 x [7, 128, 1, 64]"),
        # a missing size keeps its label
        ("NL_X_TWO_NB_BS_NH_HS", {"NL": 32, "HS": 128}, "32 x [2, NB, BS, NH, 128]"),
        ("NL_X_NB_BSV_BSS", {"NB": 100}, "NL x [100, BSxVALS, BSxSCALES]"),
    ],
)
def test_concrete_render(name, sizes, expected):
    assert render_concrete(name, sizes) == expected
    assert parse(name).concrete(sizes) == expected


@pytest.mark.parametrize(
    "name, token",
    [
        ("NL_X_FOO_NB_BS_HS", "'FOO'"),  # unknown token
        ("nl_x_nb_bs_hs", "'nl'"),  # tokens are upper case
        ("NL_X_NB_NB_BS_HS", "'NB'"),  # repeated axis
        ("NL_X_NL_NB_BS_HS", "'NL'"),  # NL both a list level and an axis
        ("NL_X_NB_BS_NH", "no element axis"),  # no element axis
        ("NL_X_TWO_NB_BS_NH_CS", "TWO and CS"),  # two K/V axes
        ("NL_X_TWO_TWO_NB_BS_HS", "'TWO'"),  # two K/V axes, the same token twice
        ("TWO_X_NL_X_TWO_NB_BS_HS", "'TWO'"),  # a K/V list level and a K/V axis
        ("NL_X_NBBS_NB_HS", "'NB'"),  # NBBS with NB
        ("NL_X_NBBS_BS_NH_HS", "'BS'"),  # NBBS with BS
        ("NL_X_", "'_X_'"),  # dangling _X_
        ("NL_X_X_NB_BS_HS", "'_X_'"),  # _X_ with nothing before it
        ("X_NL_X_NB_BS_HS", "'_X_'"),
        ("NL__NB_BS_HS", "empty token"),
        ("NL_X_NB_BS_HS_", "empty token"),
        ("NB_X_NL_BS_HS", "'NB'"),  # NB cannot be a list level
        ("NL_NB_X_BS_HS", "'NL_NB'"),  # a list level is one token
        ("NL_X_NB_BS_BSV", "'BSV'"),  # BSV without BSS
        ("NL_X_NB_HS", "NB without BS"),
        ("NL_X_BS_NH_HS", "no block axis"),
        ("TWO_X_NB_BS_HS", "'TWO'"),  # a K/V list without the layer list
        ("NP_X_NL_X_NB_BS_HS", "'NP_X_NL'"),  # unsupported nesting
    ],
)
def test_malformed_names_raise_format_error_naming_the_token(name, token):
    with pytest.raises(FormatError) as ei:
        parse(name)
    msg = str(ei.value)
    assert token in msg
    assert repr(name) in msg  # says which name


@pytest.mark.parametrize("bad", ["", None, 42, ["NL_X_NB_BS_HS"], b"NL_X_NB_BS_HS"])
def test_non_string_names_raise_format_error(bad):
    with pytest.raises(FormatError, match="non-empty string"):
        parse(bad)


def test_format_error_is_a_kvcore_error_and_a_value_error():
    with pytest.raises(kvcore.KVCoreError):
        parse("NL_X_FOO_HS")
    with pytest.raises(ValueError):
        parse("NL_X_FOO_HS")

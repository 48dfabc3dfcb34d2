"""scripts/lmcache_facade_check.py: the import rewrite that runs LMCache's own tests
against kvcore.compat.lmcache (no LMCache code here: the snippets are written for this test)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("lmcache_facade_check", Path(__file__).parent.parent / "scripts" / "lmcache_facade_check.py")
check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(check)

SOURCE = """import torch
from lmcache import device_ops, torch_device_type
from lmcache.utils import EngineType
from lmcache.v1.gpu_connector import utils as U
from lmcache.v1.gpu_connector.kv_format import (
    detect_format,
    get_spec,
)
import lmcache.lmcache_native as native
from lmcache.v1.kv_layer_groups import KVLayerGroupsManager as Mgr


def test_x(monkeypatch):
    from lmcache.v1.gpu_connector import utils
    monkeypatch.setattr("lmcache.v1.gpu_connector.kv_format.detectors.vllm.torch_device_type", "cuda")
    x = "lmcache.v1.kv_layer_groups.thing"
"""


def test_rewrite_maps_every_lmcache_import_and_keeps_line_numbers():
    out = check.rewrite(SOURCE)
    lines = out.splitlines()
    assert len(lines) == len(SOURCE.splitlines())
    assert lines[0] == "import torch"
    assert lines[1] == "import kvcore.compat.lmcache as device_ops; from lmcache_facade_host import torch_device_type"
    assert lines[2] == "from kvcore.compat.lmcache import EngineType"
    assert lines[3] == "import kvcore.compat.lmcache as U"
    assert lines[4] == "from kvcore.compat.lmcache import detect_format; from kvcore.compat.lmcache import get_spec"
    assert lines[5:8] == ["", "", ""]  # the rest of the multi-line import, blank
    assert lines[8] == "import kvcore.compat.lmcache as native"
    assert (
        lines[9] == "import lmcache_facade_host; Mgr = lmcache_facade_host.out_of_scope('lmcache.v1.kv_layer_groups.KVLayerGroupsManager')"
    )
    assert lines[13] == "    import kvcore.compat.lmcache as utils"  # nested imports too, indentation kept
    assert '"kvcore.compat.lmcache.torch_device_type"' in lines[14]  # a monkeypatch target: the facade's platform statement
    assert '"lmcache.v1.kv_layer_groups.thing"' in lines[15]  # an unmapped module's string stays
    compile(out, "rewritten", "exec")


def test_rewrite_refuses_a_bare_package_import():
    with pytest.raises(SystemExit, match="without 'as'"):
        check.rewrite("import lmcache.lmcache_native\n")


def test_deliberate_patterns_name_tests():
    assert check._classify("test_kv_format_specs.py::test_scalar_geometry[NL_X_NB_BS_NH_CS]").startswith("packed K|V")
    assert check._classify("test_kv_format_specs.py::test_scalar_geometry[NL_X_NB_BS_HS]") is None
    assert check._classify("test_blocks_first_detection.py::test_non_tight_inner_dims_rejected").startswith("detection")
    assert check._classify("test_kv_format_detection.py::test_vllm_mla") is None  # a rank-3 latent of any width: no difference
    # issue 24: what the facade now answers as LMCache 0.5.6 does is no documented difference any more
    for gone in (
        "test_kv_format_detection.py::test_vllm_mla_tuple_unequal_widths",
        "test_kv_format_detection.py::test_vllm_flash_attn_hnd",
        "test_kv_format_detection.py::test_vllm_rbln_native_singleton_axis[hint0]",
        "test_kv_format_detection.py::test_sglang_unified_mla_keeps_single_latent_plane",
        "test_kv_format_detection.py::test_sglang_mha_mp_rejects_non_divisible_page_buffer",
    ):
        assert check._classify(gone) is None, gone

"""The top layers (the command line, the LMCache facade, the benchmarks) are packages of
small modules with one job each (issue 25): none over 800 lines, kvcore imported at module
top (never inside a function), and every name their single-module versions exported still
importable from the same dotted path."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import kvcore

ROOT = Path(kvcore.__file__).parent
PACKAGES = ("cli", "compat/lmcache", "bench", "distributed")
MAX_LINES = 800


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py"))


def test_the_packages_are_there():
    assert len(_modules()) >= 38


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_module_is_small(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_kvcore_is_imported_at_module_top_only(path):
    tree = ast.parse(path.read_text())
    inside = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kvcore":
                    inside.append(f"{fn.name}: from {node.module}")
                elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "kvcore" for a in node.names):
                    inside.append(f"{fn.name}: import {', '.join(a.name for a in node.names)}")
    assert inside == []


#: names importable from each path when it was one module (public API, and the private names
#: tests, scripts and plugins reach for)
BEFORE = {
    "kvcore.cli": (
        "main build_parser load_tensor_description parse_sizes UsageError run_demo DEMO_HELP EXIT_OK EXIT_FAIL EXIT_USAGE "
        "cmd_plugins cmd_formats cmd_hints cmd_describe cmd_detect cmd_doctor _devices _optional_module _run _version "
        "_load_plugins_capturing _format_dict _format_facts _read_json _parse_hints _layout_dict _print_layout _complete_sizes "
        "_serving_kernel _DISPATCH _print_json _table _fill _err _human_bytes _Formatter"
    ),
    "kvcore.compat.lmcache": (
        "torch_device_type logger LMCACHE_FORMATS LAYERWISE_CONNECTORS _hints _prepare _engine _as_lmcache _fmt _layout "
        "_layer_layout _params_for _attention_backends _LMCACHE_ALLOCATORS _LMCACHE_ENGINE _BLOCKED_SCALE_RECORDS _SPEC_CLASSES "
        "_memory_ordered_views _trtllm_pool _vllm_device _plane_tuples _lmcache_reading _DESC_FIELDS _VLLM_NON_MLA _VLLM_MLA "
        "GeometryError FormatError DetectionError"
    ),
    "kvcore.bench": (
        "add_arguments run main CASES Case Row SmallRow bench_case bench_small format_table format_small make_cache random_fill "
        "block_slots random_slots quantised_table shared_planes QUICK BLOCK_SIZES TOKENS MAX_TOKENS MAX_BLOCK_SIZE MAX_REPEATS "
        "_setup _L2_ROTATE_BYTES _graph_times _median_times _sample_times _timer _case_bytes _payload_per_token _meta asdict "
        "AMX_FORMAT AMX_TILES"
    ),
    "kvcore.distributed": (
        "send recv release_staging HEADER_BYTES STATUS_BYTES CTL_BYTES PROTOCOL MAGIC FAST SLOW DEFAULT_CHUNK_BYTES "
        "DEFAULT_CHUNK_BYTES_CPU _isend _irecv _post _wait _poll _PeerLost _group _Group _GROUPS _channel _Channel _CHANNELS "
        "_Agreement _STATS _side _Side _wire _Wire _chunk_tokens _message _ctl_record _read _mismatch _check_values _gate_host "
        "_emulate _drain _surface _cuda _CUDA _Program _program _send _recv _send_slow _recv_slow _send_fast_host _recv_fast_host "
        "_send_fast_dev _recv_fast_dev _HOST_RINGS _host_ring _Ring _timeout _F_MAGIC _F_MODE _OP_SEND _OP_RECV"
    ),
}


@pytest.mark.parametrize("path", sorted(BEFORE))
def test_every_name_stays_importable_from_its_path(path):
    mod = importlib.import_module(path)
    names = BEFORE[path].split() + list(getattr(mod, "__all__", ()))
    assert [n for n in names if not hasattr(mod, n)] == []


def test_the_facades_platform_statement_is_the_one_detection_reads(monkeypatch):
    import kvcore.compat.lmcache as L
    from kvcore.compat.lmcache import hints

    monkeypatch.setattr(L, "torch_device_type", "cpu")
    assert hints.torch_device_type == "cpu" and L.torch_device_type == "cpu"
    assert hints._vllm_device([]) == "cpu"
    monkeypatch.undo()
    assert hints.torch_device_type is None and L.torch_device_type is None


def _resolve(dotted: str):
    """The object a dotted name names (its longest importable module prefix, then
    attributes), or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for a in parts[i:]:
            obj = getattr(obj, a, None)
        return obj
    return None


def test_every_name_the_facade_modules_cite_exists():
    """Each facade module's docstrings cite kvcore names (``kvcore.x.y``, ``:func:`name```):
    every one resolves, in kvcore or in the facade."""
    import kvcore.compat.lmcache as L

    missing = []
    for info in pkgutil.iter_modules(L.__path__):
        mod = importlib.import_module(f"{L.__name__}.{info.name}")
        src = inspect.getsource(mod)
        cited = set(re.findall(r"\bkvcore(?:\.[A-Za-z_][A-Za-z0-9_]*)+", src))
        cited |= set(re.findall(r":(?:func|class|data|exc|mod):`~?([A-Za-z_][A-Za-z0-9_.]*)`", src))
        for name in (n.rstrip(".") for n in cited):
            if _resolve(name) is None and getattr(L, name, None) is None and getattr(mod, name, None) is None:
                missing.append(f"{info.name}: {name}")
    assert missing == []


def test_setting_a_name_of_the_p2p_package_sets_it_where_it_is_used(monkeypatch):
    """Tests and scripts interpose the point-to-point primitives and the group lookup by
    setting them on ``kvcore.distributed``, as when it was one module."""
    from kvcore import distributed
    from kvcore.distributed import api, transport

    real_isend, real_group = transport._isend, api._group
    sent = []
    monkeypatch.setattr(distributed, "_isend", lambda t, peer, group, tag: sent.append((peer, tag)))
    monkeypatch.setattr(distributed, "_group", lambda group, peer, what: ("g", "pg"))
    assert transport._isend is distributed._isend and api._group is distributed._group
    assert transport._post(True, torch.zeros(1), 3, None, 7) is None and sent == [(3, 7)]
    monkeypatch.undo()
    assert transport._isend is real_isend and api._group is real_group and distributed._isend is real_isend

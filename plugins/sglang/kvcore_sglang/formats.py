"""Every layout SGLang allocates, as a kvcore format (the name is the shape template).

Facts: SGLang's ``python/sglang/srt/mem_cache/`` sources (wheels 0.5.3 and 0.5.23) and
LMCache 0.5.6's SGLang detection (``kv_format/detection.py``).

Device pools are token-granular: one row per token slot, ``size + page_size`` rows, the
extra page (slot 0's page) absorbing dummy writes of padded tokens.

The DSA/NSA indexer pool is the blocked-scale format ``NL_X_NB_BSV_BSS`` (per page: all
tokens' fp8 values, then all tokens' fp32 scales). vLLM's DeepSeek-V3.2 indexer cache has
the same bytes and kvcore-vllm declares the same name; a name is one layout, so this
plugin declares it too (identically: the core's spec reads it, given the scale width,
:mod:`kvcore_sglang.indexer`), and it works whether or not kvcore-vllm is installed.
"""

from __future__ import annotations

from typing import Any

from kvcore import KVFormat, Source

__all__ = ["FORMATS", "INDEXER_FORMAT", "MEMORY_POOL", "HOST_MHA", "HOST_MLA"]

MEMORY_POOL = "python/sglang/srt/mem_cache/memory_pool.py"
HOST_MHA_053 = "python/sglang/srt/mem_cache/memory_pool_host.py::MHATokenToKVPoolHost.init_kv_buffer"
HOST_MHA = "python/sglang/srt/mem_cache/pool_host/mha.py::MHATokenToKVPoolHost.init_kv_buffer"
HOST_MLA = "python/sglang/srt/mem_cache/pool_host/mla.py::MLATokenToKVPoolHost.init_kv_buffer"
HOST_MLA_053 = "python/sglang/srt/mem_cache/memory_pool_host.py::MLATokenToKVPoolHost.init_kv_buffer"

INDEXER_FORMAT = "NL_X_NB_BSV_BSS"
#: LMCache's unified SGLang connector, which registers SGLang's buffers one paged component per entry
LMCACHE_UNIFIED = Source(
    engine="sglang", version="LMCache 0.5.6", file="lmcache/integration/sglang/unified_lmcache_mp_connector.py::_to_wire_block_tensor"
)


def _src(version: str, file: str) -> Source:
    return Source(engine="sglang", version=version, file=file)


def _format(**fields: Any) -> KVFormat:
    """A format SGLang allocates (``engines=["sglang"]``)."""
    return KVFormat(engines=["sglang"], **fields)


#: SGLang HiCache host pools per ``--hicache-mem-layout`` (``init_kv_buffer``): the MHA pool's
#: format, the MLA pool's (None: no MLA pool of that layout) and the releases that have the layout.
_HOST_LAYOUTS: tuple[tuple[str, str, str | None, tuple[str, ...]], ...] = (
    ("layer_first", "TWO_NL_NBBS_NH_HS", "NL_NBBS_ONE_HS", ("0.5.3", "0.5.23")),
    ("page_first", "TWO_NBBS_NL_NH_HS", "NBBS_NL_ONE_HS", ("0.5.3", "0.5.23")),
    ("page_first_direct", "TWO_NB_NL_BS_NH_HS", "NB_NL_BS_ONE_HS", ("0.5.3", "0.5.23")),
    ("page_head", "TWO_NB_NH_BS_NL_HS", None, ("0.5.23",)),
)
#: how ``init_kv_buffer`` names each axis of a host pool's shape (an MLA pool's last axis is its
#: ``kv_cache_dim``)
_HOST_AXES = {"TWO": "2", "ONE": "1", "NBBS": "size", "NB": "page_num", "BS": "page_size", "NL": "NL", "NH": "NH", "HS": "HS"}
#: the pool sources per release, MHA and MLA
_HOST_SOURCES = {"MHA": {"0.5.3": HOST_MHA_053, "0.5.23": HOST_MHA}, "MLA": {"0.5.3": HOST_MLA_053, "0.5.23": HOST_MLA}}


def _host_format(kind: str, layout: str, name: str, releases: tuple[str, ...]) -> KVFormat:
    """The format of an SGLang HiCache ``kind`` (``MHA`` / ``MLA``) host pool of ``--hicache-mem-layout``
    ``layout``: its name is the pool's shape, ``(2, NL, size, NH, HS)`` for MHA ``layer_first``."""
    axes = [_HOST_AXES[t] for t in name.split("_")]
    if kind == "MLA":
        axes[-1] = "kv_cache_dim"
    default = " (the default --hicache-mem-layout)" if kind == "MHA" and layout == "page_first" else ""
    return _format(
        name=name,
        attention_backends=[f"{kind}TokenToKVPoolHost {layout}"],
        description=f"SGLang HiCache {kind} host pool, {layout}{default}: ({', '.join(axes)})",
        sources=[_src(r, _HOST_SOURCES[kind][r]) for r in releases],
    )


FORMATS: list[KVFormat] = [
    # -- device pools ------------------------------------------------------------------
    _format(
        name="TWO_X_NL_X_NBBS_NH_HS",
        attention_backends=["MHATokenToKVPool"],
        description="SGLang MHA device pool, NHD token rows: k_buffer[l], v_buffer[l] each (size + page_size, NH, HS)",
        sources=[
            _src("0.5.3", f"{MEMORY_POOL}::MHATokenToKVPool._create_buffers"),
            _src("0.5.23", f"{MEMORY_POOL}::MHATokenToKVPool._kv_buffer_shapes / _create_buffers_normal"),
        ],
    ),
    _format(
        name="TWO_X_NL_X_NB_BS_NH_HS",
        attention_backends=["MHATokenToKVPool"],
        description="SGLang MHA device pool, NHD, token rows split into pages by a page_size hint (views)",
        sources=[
            _src("0.5.3", f"{MEMORY_POOL}::MHATokenToKVPool._create_buffers"),
            _src("0.5.23", f"{MEMORY_POOL}::MHATokenToKVPool._create_buffers_normal"),
        ],
    ),
    _format(
        name="TWO_X_NL_X_NB_NH_BS_HS",
        attention_backends=["MHATokenToKVPool (SGLANG_USE_HND_KVCACHE)"],
        description="SGLang MHA device pool, HND page rows: k_buffer[l], v_buffer[l] each (num_pages, NH, page_size, HS)",
        sources=[_src("0.5.23", f"{MEMORY_POOL}::MHATokenToKVPool._kv_buffer_shapes (use_hnd)")],
    ),
    _format(
        name="NL_X_NBBS_ONE_HS",
        attention_backends=["MLATokenToKVPool"],
        description="SGLang MLA device pool: kv_buffer[l] (size + page_size, 1, kv_lora_rank + qk_rope_head_dim)",
        sources=[
            _src("0.5.3", f"{MEMORY_POOL}::MLATokenToKVPool.__init__"),
            _src("0.5.23", f"{MEMORY_POOL}::MLATokenToKVPool._create_buffers"),
        ],
    ),
    _format(
        name="NL_X_NB_BS_ONE_HS",
        attention_backends=["MLATokenToKVPool"],
        description="SGLang MLA device pool, token rows split into pages by a page_size hint (views)",
        sources=[_src("0.5.23", f"{MEMORY_POOL}::MLATokenToKVPool._create_buffers")],
    ),
    _format(
        name="TWO_NL_NB_BS_NH_HS",
        attention_backends=["AscendTokenToKVPool"],
        description="SGLang Ascend (NPU) MHA device pool: one cross-layer tensor (2, NL, size // page_size + 1, page_size, NH, HS)",
        sources=[_src("0.5.3", f"{MEMORY_POOL}::AscendTokenToKVPool._create_buffers")],
    ),
    # -- LMCache's unified per-component views of SGLang's buffers (kv_list_layout="unified") -----
    _format(
        name="NL_X_NB_BS_NH_HS",
        attention_backends=["MHATokenToKVPool (LMCache unified views)"],
        description="SGLang MHA buffers as LMCache's unified connector registers them: one list entry per K or V component, "
        "[NB, page_size, NH, HS]",
        sources=[
            _src("0.5.23", f"{MEMORY_POOL}::MHATokenToKVPool._create_buffers_normal (k_buffer, v_buffer)"),
            LMCACHE_UNIFIED,
        ],
    ),
    _format(
        name="NL_X_NB_BS_HS",
        attention_backends=["MLATokenToKVPool (LMCache unified views)"],
        description="SGLang MLA kv_buffer as LMCache's unified connector registers it: [NB, page_size, D] per layer",
        sources=[
            _src("0.5.23", f"{MEMORY_POOL}::MLATokenToKVPool._create_buffers"),
            LMCACHE_UNIFIED,
        ],
    ),
    # -- MHA pools whose V has its own head size (v_head_dim != head_dim): K and V planes --
    *[
        _format(
            name=f"K=NL_X_{t}+V=NL_X_{t}",
            attention_backends=["MHATokenToKVPool (v_head_dim)"],
            description=f"SGLang MHA device pool with V head size v_head_dim != head_dim: k_buffer[l], v_buffer[l] as {what}, "
            "one plane each (staged apart)",
            sources=[
                _src("0.5.3", f"{MEMORY_POOL}::MHATokenToKVPool._create_buffers (v_buffer (size + page_size, head_num, v_head_dim))"),
                _src("0.5.23", f"{MEMORY_POOL}::MHATokenToKVPool._kv_buffer_shapes"),
            ],
        )
        for t, what in (
            ("NBBS_NH_HS", "NHD token rows"),
            ("NB_BS_NH_HS", "NHD token rows split into pages by a page_size hint"),
            ("NB_NH_BS_HS", "HND page rows (SGLANG_USE_HND_KVCACHE)"),
        )
    ],
    # -- HiCache host pools (one pinned tensor, the layer axis inside it) -----------------
    *[_host_format("MHA", layout, mha, releases) for layout, mha, _mla, releases in _HOST_LAYOUTS],
    *[_host_format("MLA", layout, mla, releases) for layout, _mha, mla, releases in _HOST_LAYOUTS if mla],
    # -- the DSA/NSA indexer pool (also vLLM's DeepSeek-V3.2 indexer layout) ------------------
    _format(
        name=INDEXER_FORMAT,
        attention_backends=["NSATokenToKVPool", "DSATokenToKVPool"],
        description="SGLang DSA/NSA indexer keys: per layer uint8 (num_pages, page_size * 132), a page's fp8 keys then its fp32 scales",
        sources=[
            _src("0.5.3", f"{MEMORY_POOL}::NSATokenToKVPool.__init__"),
            _src("0.5.23", "python/sglang/srt/mem_cache/index_key_cache.py::IndexKeyCache"),
        ],
    ),
]

#: host pool formats by ``--hicache-mem-layout`` value, MHA then MLA
HOST_FORMATS: dict[str, tuple[str, str | None]] = {layout: (mha, mla) for layout, mha, mla, _ in _HOST_LAYOUTS}

"""Allocate KV caches exactly as vLLM does, per version, and view them as vLLM's attention does.

Independent of :mod:`kvcore_vllm.rules` on purpose: these functions restate vLLM's own
code (shapes from ``get_kv_cache_shape``, stride orders from
``get_kv_cache_stride_order``, 0.33 strides from ``compute_layout_strides``), so tests
that detect their output check the rules against vLLM, not against themselves.

* per-layer era (0.11-0.26): ``raw = torch.zeros(page_size_bytes * num_blocks,
  dtype=torch.int8)`` -> ``raw.view(dtype)`` -> ``.view(shape permuted by the stride
  order)`` -> ``.permute(inverse order)`` (vLLM 0.11.0
  ``vllm/v1/worker/gpu_model_runner.py::_allocate_kv_cache_tensors`` l.3758 and
  ``::_reshape_kv_cache_tensors`` l.3797); fp8 cache dtypes are stored as uint8
  (``STR_DTYPE_TO_TORCH_DTYPE``).
* cross-layer (0.13-0.2x, ``cross_layer=True``): one int8 buffer for all layers, logical
  shape ``(L,) + backend_shape`` permuted by the 6-D stride order, per-layer views
  ``permuted[i]`` (``vllm/v1/worker/kv_connector_model_runner_mixin.py::allocate_uniform_kv_caches``).
* 0.33: one int8 buffer, ``torch.as_strided`` 5-D ``[L, B, H, N, C]`` (C in bytes) by the
  ``KVCacheLayout`` permutation, per-layer 4-D views ``view_5d[l].view(dtype)``
  (``vllm/v1/kv_cache_interface.py::create_kv_cache_views``,
  ``::compute_layout_strides``); ``byte_views=True`` keeps them int8.
* TPU Pallas (<= 0.13): ``torch.zeros((NB, BS, 2*NH, ceil128(HS)))`` per layer
  (``tpu_model_runner``).

:func:`kv_view` builds the engine-side ``[NB, BS, NH, HS]`` view of one layer's K or V the
way the backend's forward splits it (``unbind(0)``, ``unbind(1)``,
``transpose(1, 2).split(head_size, -1)``, ``chunk(2, dim=2)``, ``split_kv_cache``...).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore import GeometryError
from kvcore.testing import FixtureCase
from kvcore_vllm.hints import BACKEND_FAMILY, era_of
from kvcore_vllm.specs import BLOCKED_SCALE_RECORDS

__all__ = ["allocate", "kv_view", "blocked_views", "VllmKVCaches", "fixture_cases", "LAYOUT_ORDERS", "MLA_HEAD_SIZE"]

MLA_HEAD_SIZE = 576
FP8_DS_MLA_BYTES = 656
NVFP4_DS_MLA_BYTES = 352
INDEXER_BYTES = 132

#: vLLM 0.33 ``KVCacheLayout``: physical order of the logical ``[L, B, H, N, C]`` axes.
LAYOUT_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}

#: 6-D cross-layer stride orders over ``(L,) + backend_shape`` (engine_layouts.md §1.13).
_CROSS_ORDERS = {
    ("0.13", "FLASH_ATTN", "NHD"): (2, 0, 1, 3, 4, 5),
    ("0.13", "FLASH_ATTN", "HND"): (2, 4, 0, 1, 3, 5),
    ("0.13", "FLASHINFER", "NHD"): (1, 0, 2, 3, 4, 5),
    ("0.13", "FLASHINFER", "HND"): (1, 2, 4, 0, 3, 5),
    ("0.24", "FLASH_ATTN", "NHD"): (1, 0, 2, 3, 4, 5),
    ("0.24", "FLASH_ATTN", "HND"): (1, 4, 0, 2, 3, 5),
    ("0.26", "FLASH_ATTN", "NHD"): (1, 0, 3, 2, 4),
}

_STORAGE = {"fp8": torch.uint8, "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8, "fp8_ds_mla": torch.uint8, "nvfp4_ds_mla": torch.uint8}
_FP8_ELEMENT = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class VllmKVCaches(dict):
    """``dict[layer_name, Tensor]`` as vLLM's runner keeps it, plus ``meta``: how it was
    allocated (version, backend, layout, element dtype...) so :func:`kv_view` can view it."""

    meta: dict[str, Any]


def _family(backend: str) -> str:
    b = backend.upper()
    if b == "INDEXER":
        return "INDEXER"
    if b not in BACKEND_FAMILY:
        raise GeometryError(f"unknown vLLM attention backend {backend!r}; use one of {', '.join(BACKEND_FAMILY)} or INDEXER")
    return BACKEND_FAMILY[b]


def _kv_shape(era: str, fam: str, nb: int, bs: int, nh: int, hs: int, cache_dtype: str) -> tuple[int, ...]:
    """``get_kv_cache_shape`` per era and backend family (engine_layouts.md §1.3-§1.11)."""
    if fam == "MLA":
        width = FP8_DS_MLA_BYTES if cache_dtype == "fp8_ds_mla" else NVFP4_DS_MLA_BYTES if cache_dtype == "nvfp4_ds_mla" else hs
        return (nb, bs, width)
    if fam == "INDEXER":
        return (nb, bs, INDEXER_BYTES)
    if fam == "PALLAS":
        return (nb, bs, 2 * nh, -(-hs // 128) * 128)
    if fam == "ROCM_ATTN":
        return (2, nb, bs, nh, hs)  # rocm_attn.py::RocmAttentionBackend.get_kv_cache_shape
    if fam == "CPU":
        if era == "0.11":
            return (2, nb, bs * nh * hs)
        if era == "0.13":
            return (2, nb, nh, bs, hs)
        return (nb, nh, bs, 2 * hs)
    if era == "0.26":
        return (nb, nh, bs, 2 * hs)
    if era in ("0.11", "0.13") and fam in ("FLASH_ATTN", "FLEX_ATTENTION"):
        return (2, nb, bs, nh, hs)
    return (nb, 2, bs, nh, hs)


def _stride_order(era: str, fam: str, layout: str, rank: int) -> tuple[int, ...]:
    """``get_kv_cache_stride_order`` per era, backend family and NHD/HND."""
    ident = tuple(range(rank))
    if fam in ("MLA", "INDEXER", "PALLAS", "CPU", "ROCM_ATTN"):
        return ident  # no stride-order override: memory follows the logical shape
    if era == "0.26":
        return (0, 2, 1, 3) if layout == "NHD" else ident
    if era == "0.24" and fam == "FLEX_ATTENTION":
        return (0, 2, 1, 3, 4)
    if layout == "HND":
        if fam == "TRITON_ATTN" or fam == "FLEX_ATTENTION":
            raise GeometryError(f"vLLM {era} {fam} has no HND stride order (it allocates NHD only)")
        return (0, 1, 3, 2, 4)
    return ident


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return tuple(inv)


def _esz(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def allocate(
    version: str,
    backend: str,
    layout: str = "NHD",
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.bfloat16,
    device: Any = "cpu",
    cache_dtype: str = "auto",
    cross_layer: bool = False,
    mamba_hybrid: bool = False,
    byte_views: bool = False,
    block_padding: int = 0,
    layer_name: str = "model.layers.{i}.self_attn.attn",
) -> VllmKVCaches:
    """Allocate a vLLM KV cache (see the module docstring for each version's path).

    Args:
        version: a vLLM version (``"0.11.0"``, ``"0.24"``, ``"0.33.0"``...).
        backend: vLLM's backend name (``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``,
            ``FLEX_ATTENTION``, ``FLASHMLA``, ``CPU_ATTN``, ``TORCH_SDPA``, ``PALLAS``...),
            or ``INDEXER`` for the DeepSeek-V3.2 indexer cache (uint8, 132 B per token).
        layout: ``NHD``/``HND`` (<= 0.26) or a 0.33 ``KVCacheLayout`` member.
        num_layers, num_blocks, block_size, num_kv_heads, head_size: geometry (MLA:
            num_kv_heads 1, head_size 576).
        dtype: the model dtype (``cache_dtype="auto"``) or the element dtype to store.
        cache_dtype: vLLM's ``--kv-cache-dtype`` (``fp8*`` and ``*_ds_mla`` store uint8).
        cross_layer: 0.13-0.2x cross-layer buffer (one int8 buffer, per-layer views).
        mamba_hybrid: <= 0.2x attention layers of a Mamba hybrid: a ``(2, NB, ...)`` tensor is
            restrided in place to stride ``(hidden, 2*hidden, ...)`` so a block's K and V sit
            together (0.11 ``gpu_model_runner.py::_update_hybrid_attention_mamba_layout``).
        byte_views: 0.33 only: keep the per-layer views int8 (C in bytes).
        block_padding: extra bytes per page (MLA / indexer / 0.33: a dim-0 padded pool).
    Returns:
        :class:`VllmKVCaches` keyed ``model.layers.{i}.self_attn.attn``.
    Raises:
        GeometryError: an unknown backend/layout, or a combination vLLM does not allocate.
    """
    era = era_of(version)
    fam = _family(backend)
    lay = layout.upper()
    storage = _STORAGE.get(cache_dtype, dtype)
    element = _FP8_ELEMENT.get(cache_dtype, storage)
    esz = _esz(storage)
    names = [layer_name.format(i=i) for i in range(num_layers)]
    out = VllmKVCaches()
    out.meta = dict(
        era=era, family=fam, backend=backend.upper(), layout=lay, head_size=head_size, num_kv_heads=num_kv_heads,
        block_size=block_size, storage=storage, element=element, cache_dtype=cache_dtype, byte_views=byte_views,
    )  # fmt: skip
    if era == "0.33":
        return _allocate_v033(
            out, names, fam, lay, num_blocks, block_size, num_kv_heads, head_size, storage, device, cache_dtype, byte_views, block_padding
        )
    if lay not in ("NHD", "HND"):
        raise GeometryError(f"vLLM {version} knows layouts NHD and HND, not {layout!r}")
    shape = _kv_shape(era, fam, num_blocks, block_size, num_kv_heads, head_size, cache_dtype)
    if (fam == "ROCM_ATTN" or (fam == "CPU" and era == "0.11")) and (head_size * esz) % 16:
        raise GeometryError(
            f"vLLM 0.11 TORCH_SDPA stores K in 16-byte chunks (split_kv_cache x = 16 // element_size): "
            f"head_size {head_size} of {storage} is not a multiple of {16 // esz}"
        )
    if fam == "PALLAS":
        for n in names:
            out[n] = torch.zeros(shape, dtype=storage, device=device)
        return out
    if fam in ("MLA", "INDEXER"):
        page = block_size * shape[-1] * esz + block_padding
        if page % esz:
            raise GeometryError(f"block_padding {block_padding} is not a whole number of {storage} elements")
        for n in names:
            raw = torch.zeros(page * num_blocks, dtype=torch.int8, device=device)
            out[n] = torch.as_strided(raw.view(storage), shape, (page // esz, shape[-1], 1))
        return out
    order = _stride_order(era, fam, lay, len(shape))
    per_layer = 1
    for s in shape:
        per_layer *= s
    if cross_layer:
        key = (era, "FLASH_ATTN" if fam == "FLEX_ATTENTION" else fam, lay)
        if key not in _CROSS_ORDERS:
            raise GeometryError(f"vLLM {version} {backend} has no cross-layer stride order for {lay}")
        order6 = _CROSS_ORDERS[key]
        full = (num_layers, *shape)
        raw = torch.zeros(per_layer * num_layers * esz, dtype=torch.int8, device=device)
        permuted = raw.view(storage).view(tuple(full[i] for i in order6)).permute(*_inverse(order6))
        for i, n in enumerate(names):
            out[n] = permuted[i]
        return out
    for n in names:
        raw = torch.zeros(per_layer * esz, dtype=torch.int8, device=device)
        t = raw.view(storage).view(tuple(shape[i] for i in order)).permute(*_inverse(order))
        if mamba_hybrid and t.shape[0] == 2:
            hidden = per_layer // (2 * t.shape[1])
            t = t.as_strided(t.shape, (hidden, 2 * hidden, *t.stride()[2:]))
        out[n] = t
    return out


def _allocate_v033(out, names, fam, lay, nb, bs, nh, hs, storage, device, cache_dtype, byte_views, padding):
    lay = _ALIASES.get(lay, lay)
    if lay not in LAYOUT_ORDERS:
        raise GeometryError(f"vLLM 0.33 KVCacheLayout is one of {', '.join(LAYOUT_ORDERS)} (or NHD/HND), not {lay!r}")
    if fam == "CPU" and lay != "LBHNC":
        raise GeometryError("vLLM 0.33 CPU_ATTN supports only LBHNC (cpu_attn.py l.82)")
    if fam == "FLEX_ATTENTION" and lay != "LBNHC":
        raise GeometryError("vLLM 0.33 FLEX_ATTENTION supports only LBNHC (flex_attention.py l.130)")
    esz = _esz(storage)
    if fam == "MLA":
        heads, c = (
            1,
            (FP8_DS_MLA_BYTES if cache_dtype == "fp8_ds_mla" else NVFP4_DS_MLA_BYTES if cache_dtype == "nvfp4_ds_mla" else hs * esz),
        )
    elif fam == "INDEXER":
        heads, c = 1, INDEXER_BYTES
    elif fam == "ROCM_ATTN":
        if lay not in ("LBHNC", "LHBNC"):
            raise GeometryError("vLLM 0.33 ROCM_ATTN supports LHBNC and LBHNC (engine_layouts.md §1.12)")
        heads, c = 2, nh * hs * esz  # customize_spec: num_head_slots=2 (K, V), C = NH*HS*dtype
    else:
        heads, c = nh, 2 * hs * esz
    L = len(names)
    shape = (L, nb, heads, bs, c)
    order = LAYOUT_ORDERS[lay]
    page = heads * bs * c
    padded = page + padding if padding else None
    grid_end = max(order.index(0), order.index(1)) + 1
    strides = [0] * 5
    cur = 1
    for idx, dim in reversed(tuple(enumerate(order))):
        if padded is not None and idx == grid_end - 1:
            cur = max(cur, padded)
        strides[dim] = cur
        cur = strides[dim] * shape[dim]
    total = max(sum((n - 1) * s for n, s in zip(shape, strides)) + 1, 1)
    raw = torch.zeros(total, dtype=torch.int8, device=device)
    view5 = torch.as_strided(raw, shape, tuple(strides), 0)
    for i, n in enumerate(names):
        v = view5[i]
        out[n] = v if byte_views else v.view(storage)
    return out


def _layers(kv_caches: Any) -> list[torch.Tensor]:
    if isinstance(kv_caches, dict):
        from kvcore.detection import normalize_container

        return list(normalize_container(kv_caches)[0])
    return list(kv_caches)


def kv_view(
    kv_caches: Any,
    layer: int,
    kv: int,
    *,
    version: str | None = None,
    backend: str | None = None,
    layout: str | None = None,
    head_size: int | None = None,
    dtype: torch.dtype | None = None,
    hints: dict | None = None,
) -> torch.Tensor:
    """One layer's K (``kv=0``) or V (``kv=1``) as vLLM's attention forward sees it:
    ``[NB, BS, NH, HS]`` (MLA: ``[NB, BS, 1, HS]``, kv 0 only; the 0.11 CPU K view is
    ``[NB, BS, NH, HS/x, x]``), in the element dtype; writing into it writes the cache.

    Arguments default to ``hints`` (the detection hints: vllm_version, attention_backend,
    head_size, cache_dtype, dtype), then to the ``meta`` that :func:`allocate` attached.

    Raises:
        GeometryError: an unknown combination, missing facts, or kv 1 of an MLA cache.
    """
    meta = dict(getattr(kv_caches, "meta", {}))
    h = dict(hints or {})
    version = version or h.get("vllm_version")
    backend = backend or h.get("attention_backend")
    if not (version or "era" in meta) or not (backend or "family" in meta):
        raise GeometryError("kv_view needs the vLLM version and backend (arguments, hints, or a cache from allocate())")
    era = era_of(version) if version else meta["era"]
    fam = _family(backend) if backend else meta["family"]
    hs = head_size or h.get("head_size") or meta.get("head_size")
    if dtype is None and h:
        cd = h.get("cache_dtype") or "auto"
        dtype = _FP8_ELEMENT.get(cd) or (h.get("dtype") if cd == "auto" else None)
    element = dtype or meta.get("element")
    t = _layers(kv_caches)[layer]
    if era == "0.33" and t.dtype == torch.int8 and meta.get("storage", torch.int8) != torch.int8:
        t = t.view(meta["storage"])
    if hs is None:  # not given: what the shape says (packed K|V halves; Pallas: the padded width)
        if fam == "CPU" and era == "0.11":
            raise GeometryError("kv_view of vLLM 0.11 TORCH_SDPA needs head_size (and block_size): (2, NB, BS*NH*HS) cannot tell")
        packed = (era in ("0.26", "0.33") and fam not in ("MLA", "INDEXER", "ROCM_ATTN")) or (fam == "CPU" and era == "0.24")
        hs = t.shape[-1] // 2 if packed else t.shape[-1]
    blocked_mla = (
        fam == "MLA" and t.dtype == torch.uint8 and t.shape[-1] in BLOCKED_SCALE_RECORDS and meta.get("cache_dtype") == "fp8_ds_mla"
    )
    if fam == "INDEXER" or blocked_mla:
        raise GeometryError(
            f"a blocked-scale page ({t.shape[-1]} B records: a block's values, then its scales) has no per-token view; "
            "use kvcore_vllm.fixtures.blocked_views(kv_caches, layer)"
        )
    if fam == "MLA":
        if kv != 0:
            raise GeometryError("an MLA latent cache has no V plane (kv_size 1): use kv=0")
        if t.dim() == 4:
            t = t.squeeze(1)  # MLAAttention.bind_kv_cache
        v = t.unsqueeze(2)
    elif fam == "PALLAS":
        v = t[:, :, kv::2, :hs]  # write_to_kv_cache: cat([k, v], -1).reshape(-1, 2H, D): k0, v0, k1, v1...
    elif fam == "ROCM_ATTN" and era == "0.33":
        nh = meta.get("num_kv_heads") or h.get("num_kv_heads") or t.shape[-1] // hs
        v = t[:, kv].unflatten(-1, (nh, t.shape[-1] // nh))  # the K (V) head slot: [NB, BS, NH*HS]
    elif fam == "ROCM_ATTN":
        nb, bs, nh = t.shape[1], t.shape[2], t.shape[3]
        x = 16 // t.element_size()
        if kv == 0:  # PagedAttention.split_kv_cache
            v = t[0].view(nb, nh, hs // x, bs, x).permute(0, 3, 1, 2, 4)
        else:
            v = t[1].view(nb, nh, hs, bs).permute(0, 3, 1, 2)
    elif fam == "CPU" and era == "0.11":
        nb = t.shape[1]
        bs = meta.get("block_size") or h.get("block_size")
        nh = meta.get("num_kv_heads") or t.shape[2] // (bs * hs)
        if kv == 0:
            x = 16 // t.element_size()
            v = t[0].view(nb, nh, hs // x, bs, x).permute(0, 3, 1, 2, 4)  # split_kv_cache: K (B, H, D/x, N, x)
        else:
            v = t[1].view(nb, nh, hs, bs).permute(0, 3, 1, 2)  # V (B, H, D, N)
    elif fam == "CPU" and era == "0.13":
        v = t.unbind(0)[kv].transpose(1, 2)
    elif fam == "CPU" and era == "0.33":
        b, h, n, c = t.shape
        v = t.view(b, h, 2 * n, c // 2).chunk(2, dim=2)[kv].transpose(1, 2)  # cpu_attn.py l.420-425
    elif era in ("0.26", "0.33") or (fam == "CPU" and era == "0.24"):
        v = t.transpose(1, 2).split(hs, dim=-1)[kv]  # FlashAttentionImpl.forward
    elif era in ("0.11", "0.13") and fam in ("FLASH_ATTN", "FLEX_ATTENTION"):
        v = t.unbind(0)[kv]
    else:
        v = t.unbind(1)[kv]
    if element is not None and element != v.dtype and _esz(element) == v.element_size():
        v = v.view(element)
    return v


def blocked_views(kv_caches: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two views of one layer's blocked-scale page (DeepSeek-V3.2 indexer ``(NB, BS, 132)``,
    nvfp4 352 B records): ``values [NB, BS, V]`` and ``scales [NB, BS, S]`` -- per block all
    BS tokens' value bytes, then all BS tokens' scale bytes (vLLM 0.11
    ``deepseek_v2.py::DeepseekV32IndexerCache``; widths from lmcache_kv_format.md §6.4).

    Raises:
        GeometryError: the record width is not a known blocked-scale record.
    """
    t = _layers(kv_caches)[layer]
    if t.dim() == 4:
        t = t.squeeze(1)
    nb, bs, w = t.shape
    if w not in BLOCKED_SCALE_RECORDS:
        raise GeometryError(f"record width {w} is not a blocked-scale record ({sorted(BLOCKED_SCALE_RECORDS)})")
    sb = BLOCKED_SCALE_RECORDS[w]
    v = w - sb
    values = torch.as_strided(t, (nb, bs, v), (t.stride(0), v, 1), t.storage_offset())
    scales = torch.as_strided(t, (nb, bs, sb), (t.stride(0), sb, 1), t.storage_offset() + bs * v)
    return values, scales


# -- conformance fixtures ------------------------------------------------------------

_SMALL = dict(num_layers=2, num_blocks=6, block_size=16, num_heads=3, head_size=16)
_MLA_SMALL = dict(num_layers=2, num_blocks=5, block_size=4, num_heads=1, head_size=MLA_HEAD_SIZE)

#: (version, backend, layout, cross_layer, format) -- the matrix the plugin supports.
MATRIX: tuple[tuple[str, str, str, bool, str], ...] = (
    ("0.11.0", "FLASH_ATTN", "NHD", False, "NL_X_TWO_NB_BS_NH_HS"),
    ("0.11.0", "FLASH_ATTN", "HND", False, "NL_X_TWO_NB_NH_BS_HS"),
    ("0.11.0", "FLEX_ATTENTION", "NHD", False, "NL_X_TWO_NB_BS_NH_HS"),
    ("0.11.0", "FLASHINFER", "NHD", False, "NL_X_NB_TWO_BS_NH_HS"),
    ("0.11.0", "FLASHINFER", "HND", False, "NL_X_NB_TWO_NH_BS_HS"),
    ("0.11.0", "TRITON_ATTN", "NHD", False, "NL_X_NB_TWO_BS_NH_HS"),
    ("0.11.0", "FLASHMLA", "NHD", False, "NL_X_NB_BS_HS"),
    ("0.11.0", "TORCH_SDPA", "HND", False, "NL_X_TWO_NB_NH_HS_BS"),
    ("0.11.0", "PALLAS", "NHD", False, "NL_X_NB_BS_NH_TWO_HS"),
    ("0.11.0", "ROCM_ATTN", "NHD", False, "NL_X_TWO_NB_NH_HS_BS"),
    ("0.13.0", "FLASH_ATTN", "NHD", True, "NB_NL_TWO_BS_NH_HS"),
    ("0.13.0", "FLASH_ATTN", "HND", True, "NB_NH_NL_TWO_BS_HS"),
    ("0.13.0", "FLASHINFER", "NHD", True, "NB_NL_TWO_BS_NH_HS"),
    ("0.13.0", "FLASHINFER", "HND", True, "NB_TWO_NH_NL_BS_HS"),
    ("0.13.0", "CPU_ATTN", "HND", False, "NL_X_TWO_NB_NH_BS_HS"),
    ("0.24.0", "FLASH_ATTN", "NHD", False, "NL_X_NB_TWO_BS_NH_HS"),
    ("0.24.0", "FLASH_ATTN", "HND", False, "NL_X_NB_TWO_NH_BS_HS"),
    ("0.24.0", "FLASH_ATTN", "NHD", True, "NB_NL_TWO_BS_NH_HS"),
    ("0.24.0", "FLASH_ATTN", "HND", True, "NB_NH_NL_TWO_BS_HS"),
    ("0.24.0", "FLEX_ATTENTION", "NHD", False, "NL_X_NB_BS_TWO_NH_HS"),
    ("0.24.0", "TRITON_ATTN", "NHD", False, "NL_X_NB_TWO_BS_NH_HS"),
    ("0.24.0", "CPU_ATTN", "HND", False, "NL_X_NB_NH_BS_CS"),
    ("0.26.0", "FLASH_ATTN", "NHD", False, "NL_X_NB_BS_NH_CS"),
    ("0.26.0", "FLASH_ATTN", "HND", False, "NL_X_NB_NH_BS_CS"),
    ("0.26.0", "FLASH_ATTN", "NHD", True, "NB_NL_BS_NH_CS"),
    ("0.26.0", "CPU_ATTN", "HND", False, "NL_X_NB_NH_BS_CS"),
    ("0.33.0", "FLASH_ATTN", "LBNHC", False, "NL_X_NB_BS_NH_CS"),
    ("0.33.0", "FLASH_ATTN", "LBHNC", False, "NL_X_NB_NH_BS_CS"),
    ("0.33.0", "FLASH_ATTN", "LHBNC", False, "NL_X_NH_NB_BS_CS"),
    ("0.33.0", "FLASH_ATTN", "BLHNC", False, "NB_NL_NH_BS_CS"),
    ("0.33.0", "FLASH_ATTN", "BLNHC", False, "NB_NL_BS_NH_CS"),
    ("0.33.0", "FLASH_ATTN", "BHLNC", False, "NB_NH_NL_BS_CS"),
    ("0.33.0", "FLASHMLA", "LBNHC", False, "NL_X_NB_BS_HS"),
    ("0.33.0", "FLASHMLA", "BLNHC", False, "NB_NL_BS_HS"),
    ("0.33.0", "CPU_ATTN", "LBHNC", False, "NL_X_NB_NH_TWO_BS_HS"),
    ("0.33.0", "ROCM_ATTN", "LBHNC", False, "NL_X_NB_TWO_BS_NH_HS"),
    ("0.33.0", "ROCM_ATTN", "LHBNC", False, "NL_X_TWO_NB_BS_NH_HS"),
)


def case_name(version: str, backend: str, layout: str, cross: bool) -> str:
    return f"vllm-{era_of(version)}-{backend}-{layout}" + ("-cross" if cross else "")


def _hints(version: str, backend: str, layout: str, cache_dtype: str, element: torch.dtype, fam: str) -> dict:
    h: dict[str, Any] = {"vllm_version": version, "attention_backend": backend, "cache_dtype": cache_dtype}
    if fam not in ("MLA", "INDEXER"):
        h["kv_cache_layout"] = layout
    if fam == "CPU":
        h["device_type"] = "cpu"
    if fam == "PALLAS":
        h["device_type"] = "tpu"
    if cache_dtype == "auto":
        h["dtype"] = element
    return h


def _make(version: str, backend: str, layout: str, cross: bool):
    fam = _family(backend)

    def make(sizes: dict, dtype: torch.dtype, device: Any):
        cache_dtype = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}.get(dtype, "auto")
        if fam == "PALLAS":
            cache_dtype = "auto"  # TPU stores real float8 dtypes (engine_layouts.md §1.11)
        kv = allocate(
            version, backend, layout,
            num_layers=sizes["num_layers"], num_blocks=sizes["num_blocks"], block_size=sizes["block_size"],
            num_kv_heads=sizes["num_heads"], head_size=sizes["head_size"], dtype=dtype, device=device,
            cache_dtype=cache_dtype, cross_layer=cross, block_padding=int(sizes.get("block_padding") or 0),
        )  # fmt: skip
        h = _hints(version, backend, layout, cache_dtype, dtype, fam)
        h["head_size"] = sizes["head_size"]
        h["block_size"] = sizes["block_size"]
        h["num_kv_heads"] = sizes["num_heads"]
        return kv, h

    return make


def fixture_cases() -> list[FixtureCase]:
    """One :class:`kvcore.testing.FixtureCase` per row of :data:`MATRIX`."""
    out = []
    for version, backend, layout, cross, fmt in MATRIX:
        fam = _family(backend)
        sizes = dict(_MLA_SMALL if fam == "MLA" else _SMALL)
        dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
        cons: dict[str, Any] = {}
        if fam == "CPU" and era_of(version) == "0.11":
            dtypes = (torch.bfloat16, torch.float16, torch.float32)  # TORCH_SDPA: fp16/bf16/fp32 (engine_layouts.md §1.9)
            cons["head_size_multiple"] = 8  # K is stored in 16-byte chunks: head_size * element_size % 16 == 0
        if fam == "FLASH_ATTN" and era_of(version) in ("0.11", "0.13"):
            cons["block_size_multiple"] = 16  # FlashAttention requires block_size % 16 == 0
        if fam == "ROCM_ATTN" and era_of(version) != "0.33":
            cons["block_size_multiple"] = 16  # rocm_attn.py: "Block size must be a multiple of 16"
            cons["head_size_multiple"] = 16  # split_kv_cache: 16-byte K chunks for every element size
        out.append(
            FixtureCase(
                name=case_name(version, backend, layout, cross),
                engine="vllm",
                format=fmt,
                make=_make(version, backend, layout, cross),
                kv_view=lambda kv, layer, k, hints=None: kv_view(kv, layer, k, hints=hints),
                sizes=sizes,
                dtypes=dtypes,
                supports_padding=fam == "MLA" or era_of(version) == "0.33",
                source=f"vllm {version} {backend} {layout}" + (" cross-layer" if cross else ""),
                size_constraints=cons,
            )
        )
    out.append(_indexer_case())
    return out


def _indexer_case() -> FixtureCase:
    """The DeepSeek-V3.2 lightning-indexer K cache: ``(NB, BS, 132)`` uint8 per layer, each
    block holding all BS tokens' 128 fp8 key bytes, then their BS fp32 scales (vLLM 0.11
    ``mla/indexer.py``, ``models/deepseek_v2.py::DeepseekV32IndexerCache``). The oracle is the
    pair of segment views from :func:`blocked_views`: a token's staged row is its 128 value
    bytes followed by its 4 scale bytes."""

    def make(sizes: dict, dtype: torch.dtype, device: Any):
        kv = allocate(
            "0.11.0", "INDEXER", "NHD",
            num_layers=sizes["num_layers"], num_blocks=sizes["num_blocks"], block_size=sizes["block_size"],
            num_kv_heads=1, head_size=INDEXER_BYTES, dtype=torch.uint8, device=device, cache_dtype="auto",
        )  # fmt: skip
        return kv, {"vllm_version": "0.11.0", "attention_backend": "FLASHMLA_SPARSE", "block_size": sizes["block_size"]}

    def view(kv_caches: Any, layer: int, kv: int, hints: dict | None = None):
        if kv != 0:
            raise GeometryError("the indexer cache is key-only: kv must be 0")
        values, scales = blocked_views(kv_caches, layer)
        return values.unsqueeze(2), scales.unsqueeze(2)

    return FixtureCase(
        name="vllm-0.11-INDEXER",
        engine="vllm",
        format="NL_X_NB_BSV_BSS",
        make=make,
        kv_view=view,
        sizes=dict(num_layers=2, num_blocks=4, block_size=16, num_heads=1, head_size=INDEXER_BYTES),
        dtypes=(torch.uint8,),
        source="vllm 0.11.0 vllm/model_executor/models/deepseek_v2.py::DeepseekV32IndexerCache",
        size_constraints={"fixed": ("num_heads", "head_size")},
    )

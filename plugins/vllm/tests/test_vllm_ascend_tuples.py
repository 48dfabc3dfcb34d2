"""vllm-ascend's tuple entries are attention caches, never Mamba state (issue 24, "silently
dropped"): the container is the engine's statement. vllm-ascend builds every attention
entry a tuple -- ``(k, v)``, DeepSeek-V3.2 ``(k, v, dsa_k)``, sparse C8 ``(k, v, dsa_k,
dsa_k_scale)`` (v0.18.0), ``(k_cache,)`` and SFA indexer ``(indexer_k, indexer_scale)``
(v0.23.0) -- and a Mamba layer's state a list (``kv_caches[layer_name] = state_tensors``).
Allocation: :func:`kvcore_vllm.pairs.allocate_ascend_tuples` (vllm-ascend's raw int8 buffers
viewed per slot)."""

from __future__ import annotations

import pytest
import torch
from kvcore_vllm.pairs import (
    DSA_C8_PLANES,
    DSA_PLANES,
    INDEXER_KEYS,
    INDEXER_PLANES,
    ONE_PLANE,
    PAIRS_MLA_PLANES,
    allocate_ascend_tuples,
)

import kvcore


def _fill(kv):
    for li, tup in enumerate(kv.values()):
        for p, t in enumerate(tup):
            flat = t.view(torch.uint8) if t.element_size() == 1 else t.view(-1)
            if t.element_size() == 1:
                flat.copy_(((torch.arange(flat.numel()) + 37 * li + 11 * p) % 251).view(flat.shape).to(torch.uint8))
            else:
                flat.copy_((torch.arange(flat.numel()) % 997 + 1000 * li + 100 * p).to(t.dtype))
    return kv


@pytest.mark.parametrize(
    "kind, fmt, roles",
    [
        ("dsa", DSA_PLANES, ("KV", "KPE", "IK")),
        ("dsa_c8", DSA_C8_PLANES, ("KV", "KPE", "IK", "IKS")),
        ("one", ONE_PLANE, ("KV",)),
    ],
)
def test_tuples_are_kv_planes_and_gather_the_engines_values(kind, fmt, roles):
    kv = _fill(allocate_ascend_tuples(kind, num_layers=3, num_blocks=5, block_size=16, widths=(512, 64, 128)))
    lay = kvcore.detect(kv, "vllm")
    assert lay.format.name == fmt
    assert (lay.num_layers, lay.num_blocks, lay.block_size) == (3, 5, 16)
    assert lay.layer_names == tuple(kv)
    slots = torch.tensor([0, 17, 79, -1, 33])
    staged = kvcore.gather(lay, slots)
    if not isinstance(staged, dict):  # one KV plane stages classically: [1, NL, T, HS]
        assert lay.classic_staging and staged.shape == (1, 3, 5, 512)
        staged = {"KV": staged[0]}
    assert set(staged) == set(roles)
    for p, role in enumerate(roles):
        for li, tup in enumerate(kv.values()):
            t = tup[p]
            for i, s in enumerate(slots.tolist()):
                if s < 0:
                    assert torch.count_nonzero(staged[role][li, i].view(torch.uint8)) == 0
                    continue
                assert torch.equal(staged[role][li, i].view(torch.uint8), t[s // 16, s % 16, 0].view(torch.uint8))
    # and per layer: every layer is KV, none is dropped as Mamba state
    per = kvcore.detect_per_layer(list(kv.values()), "vllm")
    assert [x.format.name for x in per] == [fmt] * 3


def test_dsa_c8_planes_keep_their_own_dtypes():
    kv = allocate_ascend_tuples("dsa_c8", num_layers=2, num_blocks=4, block_size=8, widths=(512, 64, 128))
    lay = kvcore.detect(kv, "vllm")
    assert lay.staging_shapes(3) == {"KV": (2, 3, 512), "KPE": (2, 3, 64), "IK": (2, 3, 128), "IKS": (2, 3, 1)}
    bufs = lay.allocate_staging(3)
    assert (bufs["KV"].dtype, bufs["IK"].dtype, bufs["IKS"].dtype) == (torch.bfloat16, torch.int8, torch.float16)


def test_the_same_tensors_in_a_list_are_mamba_state_as_vllm_ascend_keeps_it():
    kv = allocate_ascend_tuples("dsa", num_layers=2, num_blocks=4, block_size=8, widths=(512, 64, 128))
    as_lists = [list(t) for t in kv.values()]
    assert kvcore.detect_per_layer(as_lists, "vllm") == [None, None]
    with pytest.raises(kvcore.DetectionError, match="Mamba state"):
        kvcore.detect(as_lists, "vllm")
    # and with the tuples kept, the same bytes are KV
    assert kvcore.detect(list(kv.values()), "vllm").format.name == DSA_PLANES


def test_two_dtype_tuples_are_indexer_or_fa_quant_and_kv_cache_spec_decides():
    kv = allocate_ascend_tuples("indexer", num_layers=2, num_blocks=4, block_size=8, widths=(128,))
    with pytest.raises(kvcore.AmbiguousLayoutError) as e:
        kvcore.detect(kv, "vllm")
    assert e.value.hints == ["kv_cache_spec"] and "Mamba" not in str(e.value)
    lay = kvcore.detect(kv, "vllm", {"kv_cache_spec": "indexer"})
    assert lay.format.name == INDEXER_PLANES and lay.staging_shapes(5) == {"K": (2, 5, 128), "KS": (2, 5, 1)}
    # an fa-quant MLA layer: int8 nope beside a bf16 rope (vllm-ascend modelslim_config.py::get_kv_quant_dtype)
    nope, rope = torch.zeros(4, 8, 1, 512, dtype=torch.int8), torch.zeros(4, 8, 1, 64, dtype=torch.bfloat16)
    lay = kvcore.detect([(nope, rope)], "vllm", {"kv_cache_spec": "mla"})
    assert lay.format.name == PAIRS_MLA_PLANES and lay.staging_shapes(2) == {"KV": (1, 2, 512), "KPE": (1, 2, 64)}
    one = allocate_ascend_tuples("one", num_layers=2, num_blocks=4, block_size=8, widths=(128,), key_dtype=torch.bfloat16)
    assert kvcore.detect(one, "vllm", {"kv_cache_spec": "indexer"}).format.name == INDEXER_KEYS


def test_tuples_that_break_vllm_ascends_shape_are_refused_not_dropped():
    bad = [(torch.zeros(4, 8, 2, 32), torch.zeros(4, 8, 2, 8), torch.zeros(4, 8, 2, 16))]  # two heads: no DSA layer has them
    with pytest.raises(kvcore.DetectionError, match=r"\(num_blocks, block_size, 1, width\)"):
        kvcore.detect(bad, "vllm")
    ragged = [(torch.zeros(4, 8, 1, 32), torch.zeros(4, 16, 1, 8), torch.zeros(4, 8, 1, 16))]
    with pytest.raises(kvcore.DetectionError, match="one \\(num_blocks, block_size\\) per layer"):
        kvcore.detect(ragged, "vllm")
    kv = allocate_ascend_tuples("dsa", num_layers=2, num_blocks=4, block_size=8, widths=(32, 8, 16))
    with pytest.raises(kvcore.DetectionError, match="block_size=16"):
        kvcore.detect(kv, "vllm", {"block_size": 16})
    with pytest.raises(kvcore.DetectionError, match="kv_cache_spec='mamba'"):
        kvcore.detect(kv, "vllm", {"kv_cache_spec": "mamba"})

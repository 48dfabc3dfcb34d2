"""LMDeploy's block orders per backend and release (``get_k_block_shape``): :data:`RULES`, and
the readings of a block tensor they allow."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcore import DetectionError
from kvcore_lmdeploy.hints import LMDeployHints
from kvcore_lmdeploy.release_window import _INF, _span


@dataclass(frozen=True)
class Rule:
    """One backend's block shape over a span of releases.

    Attributes:
        backend: ``PytorchEngineConfig.device_type``.
        order: ``NHD``, ``HND``, ``NZ``, or None for a shape this plugin does not describe.
        lo, hi: the releases ``[lo, hi)``.
        socs: the Ascend chips it holds for (``soc_family``), None for every chip.
        shape: the block shape, as LMDeploy writes it.
        source: file and function.
    """

    backend: str
    order: str | None
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    socs: frozenset[str] | None
    shape: str
    source: str


_OB = "lmdeploy/pytorch/backends/{}/op_backend.py::{}.get_k_block_shape"
#: every backend's block shape per release, read in the released wheels (SOURCES.md)
RULES: tuple[Rule, ...] = (
    Rule("cuda", "NHD", (0, 6, 0), _INF, None, "(block_size, num_heads, head_size)", _OB.format("cuda", "CudaOpsBackend")),
    Rule("camb", "HND", (0, 7, 0), _INF, None, "(num_heads, block_size, head_size)", _OB.format("dlinfer/camb", "CambOpsBackend")),
    Rule(
        "maca",
        "HND",
        (0, 6, 2),
        (0, 6, 4),
        None,
        "(num_heads, block_size, head_size) (0.6.2)",
        _OB.format("dlinfer/maca", "MacaOpsBackend"),
    ),
    Rule(
        "maca",
        None,
        (0, 6, 4),
        (0, 10, 0),
        None,
        "split K (num_heads, head_size // 16, block_size, 16), V (num_heads, block_size, head_size) (0.6.4-0.9.2)",
        _OB.format("dlinfer/maca", "MacaOpsBackend"),
    ),
    Rule(
        "maca", "NHD", (0, 10, 0), _INF, None, "(block_size, num_heads, head_size) (0.10.2+)", _OB.format("dlinfer/maca", "MacaOpsBackend")
    ),
    Rule(
        "ascend",
        None,
        (0, 6, 0),
        (0, 7, 0),
        None,
        "(block_size, num_heads * head_size) (0.6.0-0.6.5)",
        _OB.format("dlinfer/ascend", "AscendOpsBackend"),
    ),
    Rule(
        "ascend",
        "NHD",
        (0, 7, 0),
        (0, 8, 0),
        None,
        "(block_size, num_heads, head_size) (0.7.3)",
        _OB.format("dlinfer/ascend", "AscendOpsBackend"),
    ),
    Rule(
        "ascend",
        "NHD",
        (0, 8, 0),
        _INF,
        frozenset({"910"}),
        "(block_size, num_heads, head_size) on Ascend910*",
        _OB.format("dlinfer/ascend", "AscendOpsBackend"),
    ),
    Rule(
        "ascend",
        "NZ",
        (0, 8, 0),
        (0, 11, 1),
        frozenset({"310P"}),
        "((num_heads * head_size + 15) // 16, block_size, 16) on Ascend310P* (0.8.0-0.11.0)",
        _OB.format("dlinfer/ascend", "AscendOpsBackend"),
    ),
)


def _backends(ref: torch.Tensor, h: LMDeployHints, allowed: Sequence[str] | None, what: str, why: str) -> list[str]:
    """The backends (``device_type``) that may have allocated ``ref``: the hint, else the
    tensor's torch device (a ``cuda`` tensor is the CUDA backend's -- MACA's are ``cuda``
    tensors too, so MACA needs the hint --, ``npu`` Ascend's, ``mlu`` Cambricon's), else
    (a CPU copy, the host swap cache) every backend whose blocks a 4-D tensor can be.
    ``allowed`` narrows them (fp8: cuda; int quantisation: cuda, ascend); a hint or a
    device outside it is a DetectionError (``what`` / ``why`` word it)."""
    dev = ref.device.type
    implied = {"cuda": ("cuda", "maca"), "npu": ("ascend",), "mlu": ("camb",)}.get(dev)
    if h.device_type is not None:
        if implied is not None and h.device_type not in implied:
            raise DetectionError(
                f"lmdeploy: hint device_type={h.device_type!r} but the tensors are on a {dev} device, which LMDeploy's "
                f"{' / '.join(implied)} backend fills"
            )
        found = [h.device_type]
    elif h.soc_version is not None:
        if implied is not None and "ascend" not in implied:
            raise DetectionError(
                f"lmdeploy: hint soc_version={h.soc_version!r} names an Ascend chip, but the tensors are on a {dev} device"
            )
        found = ["ascend"]
    elif implied is not None:
        found = [implied[0]]
    else:
        found = ["cuda", "camb", "ascend"]
    if allowed is not None:
        bad = [b for b in found if b not in allowed]
        if bad and (h.device_type is not None or implied is not None or h.soc_version is not None):
            raise DetectionError(f"lmdeploy: {what}: device_type={bad[0]!r} does not {why}")
        found = [b for b in found if b in allowed]
    return found


def _readings(
    ref: torch.Tensor,
    h: LMDeployHints,
    window: tuple[tuple[int, ...], tuple[int, ...]],
    *,
    allowed: Sequence[str] | None = None,
    what: str = "this cache",
    why: str = "",
) -> list[tuple[str, dict[str, Any]]]:
    """``(order, decided_by)`` of every block order the possible backends allocate in the
    releases of ``window`` (and on the ``soc_version`` chip): :data:`RULES`. Orders of one
    backend that depend on the chip or the release carry ``soc_version`` /
    ``lmdeploy_version`` in ``decided_by``.

    Raises:
        DetectionError: a backend the hints name allocates nothing described in those
            releases (MACA's split K, Ascend's flattened blocks, a 310P after 0.11.0, ...).
    """
    soc = h.soc()
    out: list[tuple[str, dict[str, Any]]] = []
    missing: list[str] = []
    for b in _backends(ref, h, allowed, what, why):
        rules = [r for r in RULES if r.backend == b and r.lo < window[1] and window[0] < r.hi]
        on_chip = [r for r in rules if soc is None or r.socs is None or soc in r.socs]
        if not on_chip:
            if rules:
                missing.append(f"device_type={b!r}: LMDeploy {_span(*window)}'s {b} backend does not run soc_version={h.soc_version!r}")
            else:
                missing.append(f"device_type={b!r}: LMDeploy {_span(*window)} has no {b} backend")
            continue
        described = [r for r in on_chip if r.order is not None]
        if not described:
            r = on_chip[0]
            missing.append(
                f"device_type={b!r}: LMDeploy {_span(*window)} allocates {r.shape} blocks ({r.source}), not described by kvcore-lmdeploy"
            )
            continue
        orders = list(dict.fromkeys(r.order for r in described))
        for order in orders:
            dec: dict[str, Any] = {"device_type": b}
            if len(orders) > 1:
                mine = [r for r in described if r.order == order]
                if soc is None and any(r.socs is not None for r in described):
                    dec["soc_version"] = "Ascend310P" if order == "NZ" else "Ascend910"
                dec["lmdeploy_version"] = ", ".join(_span(max(r.lo, window[0]), min(r.hi, window[1])) for r in mine)
            if (order, dec) not in out:
                out.append((order, dec))
    if not out:
        raise DetectionError("lmdeploy: " + "; ".join(missing))
    return out

"""Helpers every check family uses: the devices present, forcing a kernel, seeds, making and
detecting a fixture's cache, filling it with codes through the engine's view, slot mappings,
sentinel staging buffers, and comparing staged rows with the oracle's."""

from __future__ import annotations

import contextlib
import os
import random
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvcore.detection import detect
from kvcore.errors import KVCoreError
from kvcore.layout import KVLayout
from kvcore.testing import oracle
from kvcore.testing.fixtures import FixtureCase
from kvcore.testing.results import CheckFailure, CheckSkip


def devices() -> list[torch.device]:
    """Every device present: the CPU, then each accelerator torch sees."""
    out = [torch.device("cpu")]
    if torch.cuda.is_available():
        out.append(torch.device("cuda", 0))
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        out.append(torch.device("xpu", 0))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append(torch.device("mps"))
    return out


@contextlib.contextmanager
def forced_kernel(name: str | None) -> Iterator[None]:
    """Route every transfer in the block to kernel ``name`` (``KVCORE_KERNEL``)."""
    old = os.environ.get("KVCORE_KERNEL")
    if name:
        os.environ["KVCORE_KERNEL"] = name
    else:
        os.environ.pop("KVCORE_KERNEL", None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVCORE_KERNEL", None)
        else:
            os.environ["KVCORE_KERNEL"] = old


def _seed(*parts: Any) -> int:
    return zlib.crc32("|".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


def _esize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _widest(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    return max(dtypes, key=lambda d: (_esize(d), d.is_floating_point))


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _sizes_str(sizes: dict) -> str:
    short = {"num_layers": "NL", "num_blocks": "NB", "block_size": "BS", "num_heads": "NH", "head_size": "HS"}
    return ", ".join(f"{short.get(k, k)}={v}" for k, v in sizes.items())


def _make(case: FixtureCase, sizes: dict, dtype: torch.dtype, device: torch.device) -> tuple[Any, dict]:
    try:
        kv, hints = case.make(dict(sizes), dtype, device)
    except Exception as e:  # noqa: BLE001
        raise CheckFailure(
            f"fixture {case.name}: make({_sizes_str(sizes)}, {_dname(dtype)}, {device}) raised {type(e).__name__}: {e}"
        ) from None
    return kv, dict(hints or {})


def _detect(case: FixtureCase, kv: Any, hints: dict, what: str = "") -> KVLayout:
    try:
        layout = detect(kv, case.engine, hints)
    except KVCoreError as e:
        raise CheckFailure(f"detect(engine={case.engine!r}, hints={hints}){what} raised {type(e).__name__}: {e}") from None
    if layout.format.name != case.format:
        raise CheckFailure(
            f"detect(engine={case.engine!r}, hints={hints}){what} returned {layout.format.name} "
            f"({layout.describe()}); the fixture says the engine allocated {case.format}"
        )
    return layout


def _encoding(layout: KVLayout) -> oracle.Encoding:
    return oracle.Encoding(
        layout.num_layers, layout.kv_size, layout.page_buffer_size, layout.num_heads, layout.head_size, layout.element_size
    )


def _planes(case: FixtureCase, kv: Any, layout: KVLayout, hints: dict) -> list[list[oracle.Plane]]:
    try:
        pl = oracle.planes(lambda c, layer, k: case.view(c, layer, k, hints), kv, layout.num_layers, layout.kv_size)
    except Exception as e:  # noqa: BLE001
        raise CheckFailure(f"fixture {case.name}: kv_view raised {type(e).__name__}: {e}") from None
    for layer, row in enumerate(pl):
        for k, v in enumerate(row):
            a, b, nh, hs = v.shape
            if a * b != layout.page_buffer_size or nh != layout.num_heads or hs != layout.head_size:
                raise CheckFailure(
                    f"fixture {case.name}: kv_view(layer={layer}, kv={k}) is [{a}, {b}, {nh}, {hs}]; the contract is "
                    f"[NB, BS, NH, *elem] (or [PBS, 1, NH, *elem]) = {layout.page_buffer_size} slots, {layout.num_heads} heads, "
                    f"{layout.head_size} elements per head for this layout"
                )
    return pl


def _filled(case: FixtureCase, kv: Any, layout: KVLayout, hints: dict) -> tuple[list[list[torch.Tensor]], oracle.Encoding]:
    """Fill the cache with codes through the engine's view, and prove the views disjoint."""
    pl = _planes(case, kv, layout, hints)
    enc = _encoding(layout)
    oracle.fill_codes(pl, enc)
    for layer, row in enumerate(pl):
        for k, v in enumerate(row):
            if not torch.equal(v.unsigned(), enc.plane(layer, k, v.shape)):
                raise CheckFailure(
                    f"fixture {case.name}: after writing every plane through kv_view, layer {layer} kv {k} does not read back "
                    "its own values: two kv_view planes overlap, so the fixture's oracle is not a layout"
                )
    return pl, enc


def _slots(layout: KVLayout, seed: int, *, count: int = 24, negatives: int = 2) -> torch.Tensor:
    """A shuffled slot mapping: first and last slot included, unique, with -1 padding rows."""
    n = layout.page_buffer_size
    rng = random.Random(seed)
    pick = {0, n - 1}
    others = list(range(1, n - 1))
    rng.shuffle(others)
    pick.update(others[: max(0, min(count, n) - 2)])
    slots = list(pick)
    rng.shuffle(slots)
    for i in range(negatives):
        slots.insert(min(len(slots), 1 + 3 * i), -1)
    return torch.tensor(slots, dtype=torch.int64)


def _sentinel_like(layout: KVLayout, t: int, layers=None, byte: int = 0xA5) -> torch.Tensor:
    out = torch.empty(layout.staging_shape(t, layers), dtype=layout.dtype, device=layout.device)
    if out.numel():
        out.view(torch.uint8).fill_(byte)
    return out


def _staged(out: torch.Tensor) -> torch.Tensor:
    u = oracle.to_unsigned(oracle.int_view(out)).cpu()
    return u if u.dim() == 4 else u.unsqueeze(1)


def _expect_gather(enc: oracle.Encoding, layers: Sequence[int], slots: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    rows = enc.rows(layers, slots)
    keep = (slots >= 0).view(1, 1, -1, 1)
    return torch.where(keep, rows, before)


def _compare(what: str, actual: torch.Tensor, expected: torch.Tensor, layers, slots, layout: KVLayout, enc) -> None:
    mm = oracle.first_mismatch(actual, expected, layers=layers, slots=slots, head_size=layout.head_size, enc=enc, width=layout.element_size)
    if mm is not None:
        raise CheckFailure(f"{what}: {mm.describe(layout.kv_size)}", mm.as_dict())


def _kname(kernel: Any, device: torch.device) -> str:
    return f"{kernel.name}@{device.type}"


def _kernel_guard(kernel: Any, layout: KVLayout) -> None:
    sup = getattr(kernel, "supports", None)
    if sup is not None and not sup(layout.stride_table()):
        raise CheckSkip(f"kernel {kernel.name} declines this stride table (supports() is false); another kernel serves it")


def _change_where(snap: oracle.Snapshot, pl, enc) -> str:
    """Where the cache differs from ``snap``, in (layer, K/V, slot, head, element) terms
    when the engine addresses the changed byte. Leaves the cache restored to ``snap``."""
    ch = snap.first_change()
    after = _copies(pl)
    snap.restore()
    mm = oracle.plane_mismatch(pl, after, enc)
    if mm is not None:
        return mm.describe(len(pl[0]))
    if ch is None:
        return "no byte changed"
    i, off, was, now = ch
    return f"byte {off} of storage {i} (outside every (layer, K/V, slot, head) the engine addresses) changed 0x{was:02x} -> 0x{now:02x}"


def _copies(pl: list[list[oracle.Plane]]) -> list[list[oracle.Plane]]:
    return [[v.clone() for v in row] for row in pl]


def _describe_value(v: Any) -> str:
    """Shapes and dtypes, never values: ``Tensor[2, 4, 8] float32``, tuples of them, else a short repr."""
    if isinstance(v, torch.Tensor):
        return f"Tensor{list(v.shape)} {_dname(v.dtype)}"
    if isinstance(v, (tuple, list)):
        inner = ", ".join(_describe_value(x) for x in list(v)[:4]) + (", ..." if len(v) > 4 else "")
        return f"{type(v).__name__}({inner})"
    return f"{type(v).__name__} {v!r:.60}"

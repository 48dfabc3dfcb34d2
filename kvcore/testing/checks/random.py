"""``agrees_with_reference``: on random geometries, dtypes and slot mappings (hypothesis,
seeded), a kernel's gather and scatter are byte-identical to the reference kernel's."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcore import registry
from kvcore.detection import detect
from kvcore.errors import GeometryError, KVCoreError
from kvcore.kernels.reference import REFERENCE
from kvcore.testing import oracle
from kvcore.testing.checks.common import (
    _dname,
    _seed,
    _sentinel_like,
    _sizes_str,
    _staged,
    forced_kernel,
)
from kvcore.testing.fixtures import FixtureCase
from kvcore.testing.results import CheckFailure, CheckSkip
from kvcore.transfer import gather, scatter

_SHAPE_KEYS = ("num_layers", "num_blocks", "block_size", "num_heads", "head_size")


def _random_sizes(case: FixtureCase, draw_int: Callable[[int, int], int], draw_from: Callable[[Sequence], Any]) -> dict:
    c = case.size_constraints
    fmt = registry.get_format(case.format)
    s = dict(case.sizes)
    s["num_layers"] = draw_int(1, 3)
    s["num_blocks"] = draw_int(2, 5)
    if "block_size_choices" in c:
        s["block_size"] = draw_from(list(c["block_size_choices"]))
    elif "block_size_multiple" in c:
        s["block_size"] = int(c["block_size_multiple"]) * draw_int(1, 2)
    else:
        s["block_size"] = draw_from([1, 2, 3, 4, 8, 16])
    if fmt.syntax.has("NH") and "num_heads" not in c.get("fixed", ()):
        s["num_heads"] = draw_from(list(c["num_heads_choices"])) if "num_heads_choices" in c else draw_int(1, 4)
    if "head_size" not in c.get("fixed", ()):
        if "head_size_choices" in c:
            s["head_size"] = draw_from(list(c["head_size_choices"]))
        elif "head_size_multiple" in c:
            s["head_size"] = int(c["head_size_multiple"]) * draw_int(1, 3)
        else:
            s["head_size"] = draw_from([1, 2, 3, 8, 16, 24, 64])
    for k in c.get("fixed", ()):
        s[k] = case.sizes[k]
    return s


def check_agrees_with_reference(case: FixtureCase, device: torch.device, kernel: Any, examples: int) -> str:
    if kernel.name == REFERENCE.name:
        raise CheckSkip("this is the reference kernel")
    state = {"ran": 0, "declined": 0, "last": None}

    def one(sizes: dict, dtype: torch.dtype, picks: list[int], seed: int) -> None:
        try:
            kv, hints = case.make(dict(sizes), dtype, device)
        except GeometryError:
            return
        state["last"] = f"{_sizes_str(sizes)}, {_dname(dtype)}"
        try:
            layout = detect(kv, case.engine, hints)  # a degenerate geometry may read as an equivalent format
        except KVCoreError as e:
            raise CheckFailure(
                f"the engine's allocation for {_sizes_str(sizes)} is not detected ({type(e).__name__}: {e}); "
                "if the engine never allocates it, the fixture's make should raise GeometryError (or declare size_constraints)"
            ) from None
        sup = getattr(kernel, "supports", None)
        if sup is not None and not sup(layout.stride_table()):
            state["declined"] += 1
            return
        n = layout.page_buffer_size
        slots = torch.tensor(sorted(set(p % (n + 1) - 1 for p in picks), key=lambda x: (x * 7919 + seed) % 104729), dtype=torch.int64)
        gen = torch.Generator().manual_seed(seed)
        for st in oracle.Snapshot([kv, layout.kv_caches]).views:
            st.copy_(torch.randint(0, 256, st.shape, generator=gen, dtype=torch.uint8).to(st.device))
        base = oracle.Snapshot([kv, layout.kv_caches])
        outs = []
        for name in (kernel.name, REFERENCE.name):
            with forced_kernel(name):
                outs.append(gather(layout, slots, _sentinel_like(layout, len(slots))))
        if not torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8)):
            a, b = _staged(outs[0]), _staged(outs[1])
            mm = oracle.first_mismatch(
                a, b, layers=list(range(layout.num_layers)), slots=slots, head_size=layout.head_size, enc=None, width=layout.element_size
            )
            raise CheckFailure(
                f"gather differs from the reference for {state['last']}, slots {slots.tolist()}: {mm.describe(layout.kv_size)}",
                mm.as_dict(),
            )
        src = torch.empty(layout.staging_shape(len(slots)), dtype=dtype, device=layout.device)
        if src.numel():
            src.view(torch.uint8).copy_(torch.randint(0, 256, src.view(torch.uint8).shape, generator=gen, dtype=torch.uint8).to(src.device))
        after = []
        for name in (kernel.name, REFERENCE.name):
            base.restore()
            with forced_kernel(name):
                scatter(layout, slots, src)
            after.append(oracle.Snapshot([kv, layout.kv_caches]))
        d = after[0].same_as(after[1])
        if d is not None:
            raise CheckFailure(
                f"scatter differs from the reference for {state['last']}, slots {slots.tolist()}: byte {d[1]} of storage {d[0]} is "
                f"0x{d[3]:02x}, the reference wrote 0x{d[2]:02x}"
            )
        state["ran"] += 1

    try:
        import hypothesis
        from hypothesis import strategies as st
    except ImportError:  # pragma: no cover - hypothesis is a test extra
        rng = random.Random(_seed(case.name, kernel.name))
        for _ in range(examples):
            sizes = _random_sizes(case, rng.randint, rng.choice)
            one(sizes, rng.choice(list(case.dtypes)), [rng.randint(0, 400) for _ in range(rng.randint(0, 12))], rng.randint(0, 2**30))
    else:

        @hypothesis.settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(hypothesis.HealthCheck),
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate, hypothesis.Phase.shrink],
        )
        @hypothesis.given(data=st.data())
        def prop(data):
            sizes = _random_sizes(case, lambda a, b: data.draw(st.integers(a, b)), lambda xs: data.draw(st.sampled_from(xs)))
            dtype = data.draw(st.sampled_from(list(case.dtypes)))
            picks = data.draw(st.lists(st.integers(0, 400), max_size=12))
            one(sizes, dtype, picks, data.draw(st.integers(0, 2**30)))

        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):  # hypothesis reports to stdout
            prop()
    if state["ran"] == 0 and state["declined"]:
        raise CheckSkip(f"kernel {kernel.name} declines this format's stride tables (supports() is false); another kernel serves them")
    if state["ran"] == 0:
        raise CheckFailure(
            f"no random geometry was accepted by fixture {case.name}'s make (GeometryError each time); check size_constraints"
        )
    return f"{state['ran']} random geometries"

"""No public name of ``kvcore`` shadows one of its modules.

``kvcore.hints``, ``kvcore.formats`` and ``kvcore.plan`` are functions (stable API); when a
module of the same name existed, ``import kvcore.hints as h`` gave the function and
``kvcore.hints.tensor_order_hint`` crashed a plugin at load.
"""

from __future__ import annotations

import importlib
import pkgutil

import kvcore


def _submodules() -> set[str]:
    return {m.name for m in pkgutil.iter_modules(kvcore.__path__)}


def test_no_public_attribute_is_also_a_submodule_name():
    public = set(kvcore.__all__) | {n for n in dir(kvcore) if not n.startswith("_")}
    clashes = []
    for name in sorted(public & _submodules()):
        if not isinstance(getattr(kvcore, name), type(kvcore)):
            clashes.append(name)
    assert not clashes, f"public kvcore names shadowing a submodule: {clashes}"


def test_importing_every_submodule_keeps_the_public_functions():
    before = {n: getattr(kvcore, n) for n in kvcore.__all__}
    for name in sorted(_submodules()):
        if name.startswith("_"):
            continue
        importlib.import_module(f"kvcore.{name}")
    after = {n: getattr(kvcore, n) for n in kvcore.__all__}
    assert after == before


def test_the_stable_functions_are_functions_and_their_modules_import():
    for name in ("hints", "formats", "plugins", "plan"):
        assert callable(getattr(kvcore, name)) and not isinstance(getattr(kvcore, name), type(kvcore))
    import kvcore.format_decl as fd
    import kvcore.hint_decl as hd
    import kvcore.layout_plan as lp

    assert fd.KVFormat is kvcore.KVFormat and hd.Hint is kvcore.Hint and lp.LayoutPlan is kvcore.LayoutPlan
    assert kvcore.tensor_order_hint("tinyllm").name == "tensor_order"

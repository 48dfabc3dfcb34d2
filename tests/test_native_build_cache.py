"""The first-use native build (issue 13, issue 17 item 4): keyed by a hash of the sources'
contents and the flags, built in a temporary folder and renamed into place under a file
lock, "compiling" said only when compiling, checkouts sharing the cache never rebuilding
each other's library, and two processes building at once both loading one build.

The builds here compile a tiny Python extension through :func:`kvcore.kernels._build.
cached_extension` -- the code path of kvcore's own op library -- so they take seconds."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcore.kernels import _build

pytestmark = pytest.mark.skipif(_build._missing_tools() is not None, reason="no C++ compiler or ninja here")

SOURCE = textwrap.dedent(
    """
    #include <Python.h>
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(VALUE); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
    static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "NAME", nullptr, -1, methods};
    PyMODINIT_FUNC PyInit_NAME(void) { return PyModule_Create(&mod); }
    """
)

BUILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from kvcore.kernels import _build
    name, src, root, value = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    mod, path, compiled = _build.cached_extension(
        name, [src], flags={"extra_cflags": ["-O1", f"-DVALUE={value}"]}, root=root, what="the test extension"
    )
    print(json.dumps({"answer": mod.answer(), "path": str(path), "compiled": compiled}))
    """
)


def _source(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / f"{name}.cpp"
    p.write_text(SOURCE.replace("NAME", name))
    return p


def _start(name: str, src: Path, root: Path, value: int = 42) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", BUILD, name, str(src), str(root), str(value)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(p: subprocess.Popen) -> tuple[dict, str]:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def test_two_processes_building_at_once_share_one_build(tmp_path):
    src, root = _source(tmp_path / "checkout", "kvtest_race"), tmp_path / "cache"
    procs = [_start("kvtest_race", src, root) for _ in range(2)]
    results = [_finish(p) for p in procs]
    assert [r["answer"] for r, _ in results] == [42, 42]
    assert len({r["path"] for r, _ in results}) == 1
    assert sorted(r["compiled"] for r, _ in results) == [False, True]  # one compiled, the other waited and loaded it
    said = [err for _, err in results]
    assert sum("kvcore: compiling the test extension" in e for e in said) == 1
    done = [line for e in said for line in e.splitlines() if line.startswith("kvcore: compiled the test extension: done in ")]
    assert len(done) == 1 and done[0].endswith(" s") and float(done[0].split("done in ")[1][:-2]) >= 0
    assert sum("kvcore: waiting for another process" in e for e in said) <= 1
    entries = sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))
    assert entries == [Path(results[0][0]["path"]).name]  # no temporary or half-built folder left
    # a later process only loads: no compiler run, no message
    r, err = _finish(_start("kvtest_race", src, root))
    assert (r["answer"], r["compiled"]) == (42, False) and "compiling" not in err and "waiting" not in err


def test_checkouts_sharing_the_cache_never_rebuild_each_others_library(tmp_path):
    root = tmp_path / "cache"
    a = _source(tmp_path / "checkout-a", "kvtest_share")
    b = _source(tmp_path / "checkout-b", "kvtest_share")  # same contents, another path
    first, _ = _finish(_start("kvtest_share", a, root))
    second, err = _finish(_start("kvtest_share", b, root))
    assert first["compiled"] and not second["compiled"] and first["path"] == second["path"] and "compiling" not in err
    # other contents or other flags are another key (test_the_key_is_the_contents_and_flags_not_the_paths)


def test_the_key_is_the_contents_and_flags_not_the_paths(tmp_path):
    a = _source(tmp_path / "a", "kvtest_key")
    b = _source(tmp_path / "b", "kvtest_key")
    k = _build.cache_key("kvtest_key", [a], flags={"extra_cflags": ["-O3"]})
    assert k == _build.cache_key("kvtest_key", [b], flags={"extra_cflags": ["-O3"]})
    assert k != _build.cache_key("kvtest_key", [b], flags={"extra_cflags": ["-O2"]})
    b.write_text(b.read_text() + " ")
    assert k != _build.cache_key("kvtest_key", [b], flags={"extra_cflags": ["-O3"]})
    # kvcore's own library: keyed by the csrc contents, the flags and the versions
    assert _build.build_dir(False).name.startswith("kvcore_native_cpu-torch")


def test_an_interrupted_build_leaves_nothing_that_is_loaded_later(tmp_path, monkeypatch):
    """A compile that fails leaves no cache entry (its temporary folder is removed) and
    the next attempt builds again."""
    src, root = _source(tmp_path / "checkout", "kvtest_broken"), tmp_path / "cache"
    src.write_text("this is not C++")
    with pytest.raises(Exception):  # noqa: B017 - the compiler's own error
        _build.cached_extension("kvtest_broken", [src], root=root, what="the test extension")
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []
    # a stale entry without its library (an older layout) is replaced, not loaded
    good = _source(tmp_path / "good", "kvtest_stale")
    flags = {"extra_cflags": ["-DVALUE=5"]}
    stale = root / _build.cache_key("kvtest_stale", [good], flags=flags)
    stale.mkdir()
    (stale / "build.ninja").write_text("stale")
    mod, path, compiled = _build.cached_extension("kvtest_stale", [good], flags=flags, root=root)
    assert compiled and path == stale and mod.answer() == 5
    assert (stale / "build.ninja").read_text() != "stale"
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == [stale.name]

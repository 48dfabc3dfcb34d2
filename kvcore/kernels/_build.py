"""Build and load kvcore's native op library (``csrc/``) on first use.

The C++ CPU op (and, where torch has CUDA and ``nvcc`` is found, the CUDA op) are
compiled with :func:`torch.utils.cpp_extension.load` (ninja) into a cache directory keyed
by a hash of what decides the binary -- the sources' and headers' contents (not their
paths), the compiler flags, the compiler, the torch and CUDA versions and the Python ABI:
``$KVCORE_BUILD_DIR/<key>`` (default ``~/.cache/kvcore/native/<key>``). So checkouts that
share the cache share one build, and a checkout whose sources differ builds its own.

A build happens in a temporary folder next to the cache entry and is renamed into place
in one step (``os.rename``), under a file lock per key: a second process that asks while
the first compiles waits for it and loads its library; a crash mid-build leaves no
half-built entry. A process that finds the entry imports the library directly (no ninja
run, no lock, no message); "compiling ..." and, when it succeeded, "... done in N s" are
printed on stderr only when compiling.
Nothing is downloaded and no isolated build environment is made: the installed torch's
headers are used.

``KVCORE_NATIVE=0`` disables the native kernels (the torch reference kernel serves).
A failed build never breaks ``import kvcore``: it is logged once as a warning, the
reference kernel serves, and :func:`status` (shown by ``kvcore doctor``) says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("kvcore.native")

CSRC = Path(__file__).resolve().parent.parent.parent / "csrc"
ABI_VERSION = 5
_CPU_SOURCES = ("kvcore_cpu.cpp", "kvcore_copy.cpp")
_CUDA_SOURCES = ("kvcore_cuda.cu", "kvcore_copy.cu")
_HEADERS = ("kvcore_ops.h", "kvcore_copy.h", "kvcore_device.cuh", "kvcore_tile.h")


@dataclass
class BuildStatus:
    """What the native build did: ``loaded`` (the op library is usable), ``cuda`` (its
    CUDA ops are compiled in), ``reason`` (why not, or where it came from)."""

    attempted: bool = False
    loaded: bool = False
    cuda: bool = False
    reason: str = "not built yet (builds on first transfer)"
    path: str | None = None
    log: list[str] = field(default_factory=list)


_STATUS = BuildStatus()
MODULE = None  # the built Python module: ``transfer(gather, ...)`` without the dispatcher
_LOCK = threading.Lock()


def disabled() -> bool:
    return os.environ.get("KVCORE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def _want_cuda() -> tuple[bool, str]:
    if os.environ.get("KVCORE_NATIVE_CUDA", "1").strip().lower() in ("0", "false", "no", "off"):
        return False, "CUDA op disabled by KVCORE_NATIVE_CUDA=0"
    if torch.version.cuda is None:
        return False, f"this torch ({torch.__version__}) has no CUDA"
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if not home or not (Path(home) / "bin" / "nvcc").exists():
        return False, "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    return True, f"nvcc at {home}"


def _flags(with_cuda: bool) -> dict[str, list[str]]:
    """The compiler flags of the op library (part of the cache key)."""
    flags = {
        "extra_cflags": ["-O3", "-fopenmp"] + (["-DKVCORE_WITH_CUDA"] if with_cuda else []),
        "extra_ldflags": ["-fopenmp"],
        "extra_cuda_cflags": [],
    }
    if with_cuda:
        flags["extra_cuda_cflags"] = [
            "-O3",
            "-gencode=arch=compute_90,code=sm_90",
            "-gencode=arch=compute_90,code=compute_90",
            "--expt-relaxed-constexpr",
        ]
    return flags


def cache_key(name: str, sources: Sequence[Path], depends: Sequence[Path] = (), flags: dict | None = None, with_cuda: bool = False) -> str:
    """``<name>-torch<version>-cuda<version>-<hash>``: the hash covers the sources' and
    ``depends``' contents (not their paths: two checkouts of the same code share a key),
    ``flags``, the compiler (``$CXX``), the torch/CUDA versions, the Python ABI, the
    machine and :data:`ABI_VERSION`."""
    h = hashlib.sha256()
    for p in list(sources) + list(depends):
        h.update(Path(p).name.encode() + b"\0")
        h.update(Path(p).read_bytes())
    meta = {
        "name": name,
        "flags": flags or {},
        "cxx": os.environ.get("CXX", "c++"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if with_cuda else None,
        "python": sys.implementation.cache_tag,
        "machine": platform.machine(),
        "abi": ABI_VERSION,
    }
    h.update(json.dumps(meta, sort_keys=True).encode())
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda if with_cuda else 'none'}"
    return f"{name}-{tag}-{h.hexdigest()[:16]}".replace("+", "_")


def _key(with_cuda: bool) -> str:
    name = "kvcore_native_cuda" if with_cuda else "kvcore_native_cpu"
    return cache_key(name, _sources(with_cuda), [CSRC / h for h in _HEADERS], _flags(with_cuda), with_cuda)


def _sources(with_cuda: bool) -> list[Path]:
    return [CSRC / s for s in _CPU_SOURCES + (_CUDA_SOURCES if with_cuda else ())]


def cache_root() -> Path:
    """``$KVCORE_BUILD_DIR``, else ``~/.cache/kvcore/native``."""
    root = os.environ.get("KVCORE_BUILD_DIR")
    return Path(root) if root else Path.home() / ".cache" / "kvcore" / "native"


def build_dir(with_cuda: bool) -> Path:
    return cache_root() / _key(with_cuda)


def _missing_tools() -> str | None:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not on PATH)"
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja)"
    return None


def load() -> BuildStatus:
    """Build (first time) and load the op library; idempotent, thread-safe. Never raises."""
    with _LOCK:
        if _STATUS.attempted:
            return _STATUS
        _STATUS.attempted = True
        if disabled():
            _STATUS.reason = "disabled by KVCORE_NATIVE=0"
            return _STATUS
        if hasattr(torch.ops, "kvcore") and _has_ops():
            _STATUS.loaded, _STATUS.reason = True, "already loaded in this process (ops only)"
            _STATUS.cuda = torch._C._dispatch_has_kernel_for_dispatch_key("kvcore::gather", "CUDA")
            return _STATUS
        if not (CSRC / _CPU_SOURCES[0]).exists():
            _STATUS.reason = f"the C++ sources are not installed ({CSRC} is missing)"
            _warn()
            return _STATUS
        missing = _missing_tools()
        if missing:
            _STATUS.reason = missing
            _warn()
            return _STATUS
        with_cuda, cuda_why = _want_cuda()
        _STATUS.log.append(cuda_why)
        try:
            _STATUS.path = str(_build(with_cuda))
        except Exception as e:  # noqa: BLE001 - a failed build must never break kvcore
            first = str(e).strip().splitlines()
            msg = first[-1] if first else type(e).__name__
            if with_cuda:
                _STATUS.log.append(f"CUDA build failed ({msg}); retrying CPU only")
                try:
                    _STATUS.path = str(_build(False))
                    with_cuda = False
                except Exception as e2:  # noqa: BLE001
                    lines = str(e2).strip().splitlines()
                    _STATUS.reason = f"build failed: {lines[-1] if lines else type(e2).__name__}"
                    _warn()
                    return _STATUS
            else:
                _STATUS.reason = f"build failed: {msg}"
                _warn()
                return _STATUS
        if not _has_ops() or int(torch.ops.kvcore.abi_version()) != ABI_VERSION:
            _STATUS.reason = "the built library does not define the kvcore ops of this version"
            _warn()
            return _STATUS
        _STATUS.loaded = True
        _STATUS.cuda = with_cuda
        _STATUS.reason = f"built from csrc/ at {_STATUS.path}" + ("" if with_cuda else f" (CPU only: {cuda_why})")
        return _STATUS


def _has_ops() -> bool:
    try:
        torch.ops.kvcore.gather  # noqa: B018
        torch.ops.kvcore.abi_version  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def _build(with_cuda: bool) -> Path:
    global MODULE
    name = "kvcore_native_cuda" if with_cuda else "kvcore_native_cpu"
    MODULE, path, _ = cached_extension(
        name,
        _sources(with_cuda),
        depends=[CSRC / h for h in _HEADERS],
        include_paths=[CSRC],
        flags=_flags(with_cuda),
        with_cuda=with_cuda,
        what="the native transfer kernels",
    )
    return path


def _announce(msg: str) -> None:
    # a first build takes about a minute: say so where a person sees it (logging is usually unconfigured)
    print(f"kvcore: {msg}", file=sys.stderr, flush=True)


def cached_extension(
    name: str,
    sources: Sequence[Path],
    *,
    depends: Sequence[Path] = (),
    include_paths: Sequence[Path] = (),
    flags: dict | None = None,
    with_cuda: bool = False,
    root: Path | None = None,
    what: str = "a native extension",
) -> tuple[Any, Path, bool]:
    """Import the torch C++ extension ``name`` built from ``sources``, compiling it first
    when no build with the same :func:`cache_key` is in the cache.

    Returns:
        ``(module, cache entry, compiled)``: ``compiled`` is False when the library came
        from the cache (built by this or another process or checkout).
    Raises:
        whatever the compiler raises (the caller decides how to report it).
    """
    from torch.utils import cpp_extension

    flags = dict(flags or {})
    key = cache_key(name, sources, depends, flags, with_cuda)
    root = root or cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: build under the temp dir instead
        root = Path(tempfile.gettempdir()) / "kvcore-native"
        root.mkdir(parents=True, exist_ok=True)
    final = root / key
    lib = final / f"{name}{cpp_extension.LIB_EXT}"
    if lib.exists():
        return _import_extension(name, lib), final, False
    with _exclusive(root / f".{key}.lock", lambda: _announce(f"waiting for another process compiling {what} into {final}...")):
        if lib.exists():  # the process we waited for built it
            return _import_extension(name, lib), final, False
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.building-", dir=root))
        try:
            _announce(f"compiling {what} into {final} (first use only; about a minute)...")
            started = time.monotonic()
            module = cpp_extension.load(
                name=name,
                sources=[str(s) for s in sources],
                extra_cflags=list(flags.get("extra_cflags", [])),
                extra_cuda_cflags=list(flags.get("extra_cuda_cflags", [])) or None,
                extra_ldflags=list(flags.get("extra_ldflags", [])),
                extra_include_paths=[str(p) for p in include_paths],
                build_directory=str(tmp),
                is_python_module=True,
                verbose=os.environ.get("KVCORE_BUILD_VERBOSE", "") not in ("", "0"),
            )
            _publish(tmp, final)
            _announce(f"compiled {what}: done in {time.monotonic() - started:.0f} s")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when published
        return module, final, True


def _import_extension(name: str, path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the extension {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished build into place in one rename; an entry left without its library
    (an old layout, an interrupted copy) is moved aside first."""
    os.chmod(tmp, 0o755)  # mkdtemp made it private; the entry is for every process that shares the cache
    if final.exists():
        aside = final.with_name(f".{final.name}.stale-{os.getpid()}")
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(tmp, final)


@contextlib.contextmanager
def _exclusive(lock: Path, on_wait: Any) -> Iterator[None]:
    """An exclusive file lock (POSIX ``flock``: released when the process dies); where
    there is none, no lock (the rename still keeps entries whole)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_WARNED = False


def _warn() -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        log.warning("kvcore: native kernels unavailable (%s); the torch reference kernel serves", _STATUS.reason)


def status() -> BuildStatus:
    """The build status without building."""
    return _STATUS

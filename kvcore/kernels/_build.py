"""Build and load kvcore's native op library (``csrc/``) on first use.

The C++ CPU op (and, where torch has CUDA and ``nvcc`` is found, the CUDA op) are
compiled with :func:`torch.utils.cpp_extension.load` (ninja) into a cache directory
keyed by the torch version, the CUDA version and a hash of the sources:
``$KVCORE_BUILD_DIR`` or ``~/.cache/kvcore/native/<key>``. Nothing is downloaded and no
isolated build environment is made: the installed torch's headers are used. A later
import finds the built library and only loads it (well under a second).

``KVCORE_NATIVE=0`` disables the native kernels (the torch reference kernel serves).
A failed build never breaks ``import kvcore``: it is logged once as a warning, the
reference kernel serves, and :func:`status` (shown by ``kvcore doctor``) says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("kvcore.native")

CSRC = Path(__file__).resolve().parent.parent.parent / "csrc"
ABI_VERSION = 3
_CPU_SOURCES = ("kvcore_cpu.cpp", "kvcore_copy.cpp")
_CUDA_SOURCES = ("kvcore_cuda.cu", "kvcore_copy.cu")
_HEADERS = ("kvcore_ops.h", "kvcore_copy.h")


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


def _key(with_cuda: bool) -> str:
    h = hashlib.sha256()
    for name in _CPU_SOURCES + _HEADERS + (_CUDA_SOURCES if with_cuda else ()):
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(Path(__file__).read_bytes())
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda if with_cuda else 'none'}"
    return f"{tag}-{h.hexdigest()[:16]}".replace("+", "_")


def build_dir(with_cuda: bool) -> Path:
    root = os.environ.get("KVCORE_BUILD_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvcore" / "native"
    return base / _key(with_cuda)


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
    from torch.utils import cpp_extension

    d = build_dir(with_cuda)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: build under the temp dir instead
        import tempfile

        d = Path(tempfile.gettempdir()) / "kvcore-native" / d.name
        d.mkdir(parents=True, exist_ok=True)
    sources = [str(CSRC / s) for s in _CPU_SOURCES + (_CUDA_SOURCES if with_cuda else ())]
    name = "kvcore_native_cuda" if with_cuda else "kvcore_native_cpu"
    kw = {}
    if with_cuda:
        kw["extra_cuda_cflags"] = [
            "-O3",
            "-gencode=arch=compute_90,code=sm_90",
            "-gencode=arch=compute_90,code=compute_90",
            "--expt-relaxed-constexpr",
        ]
    # a first build takes about a minute: say so where a person sees it (logging is usually unconfigured)
    print(f"kvcore: compiling the native transfer kernels into {d} (first use only; about a minute)...", file=sys.stderr, flush=True)
    global MODULE
    MODULE = cpp_extension.load(
        name=name,
        sources=sources,
        extra_cflags=["-O3", "-fopenmp"] + (["-DKVCORE_WITH_CUDA"] if with_cuda else []),
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(CSRC)],
        build_directory=str(d),
        is_python_module=True,
        verbose=os.environ.get("KVCORE_BUILD_VERBOSE", "") not in ("", "0"),
        **kw,
    )
    return d


_WARNED = False


def _warn() -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        log.warning("kvcore: native kernels unavailable (%s); the torch reference kernel serves", _STATUS.reason)


def status() -> BuildStatus:
    """The build status without building."""
    return _STATUS

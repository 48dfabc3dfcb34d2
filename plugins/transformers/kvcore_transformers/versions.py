"""Which transformers versions this plugin supports, and the check that says so.

The range was verified by reading each version's sources (``cache_utils.py`` and
``generation/continuous_batching/``) and by running the demo and tests against the
installed release. transformers is never imported at plugin load: the plugin loads with
every ``import kvcore``, and importing transformers costs seconds.
"""

from __future__ import annotations

import re
from importlib import metadata

from kvcore import DetectionError

__all__ = ["SUPPORTED_RANGE", "PAGED_RANGE", "installed_version", "check_version", "parse_version"]

#: transformers versions whose DynamicCache / StaticCache this plugin reads: 4.53
#: (``key_cache`` / ``value_cache`` lists; transformers 4.53.3 ``cache_utils.py::DynamicCache``)
#: through 5.24 (``cache.layers[i].keys / .values``; 5.24.0 ``cache_utils.py::DynamicLayer``).
SUPPORTED_RANGE = (">=4.53", "<5.25")
#: versions whose continuous-batching cache is the one ``uint8`` tensor carved by
#: ``cache_allocators/`` (first in 5.18.0; ``full_attention.py::register_cache_tensor`` is the
#: same in 5.18.0, 5.19.0, 5.20.2, 5.23.0 and 5.24.0; the demo ran on 5.18.0, 5.20.2 and
#: 5.24.0). 5.17 and earlier kept per-layer ``key_cache``/``value_cache`` lists of
#: ``[(num_blocks + 2) * block_size, NH, HS]`` (5.10.4, 5.17.0 ``continuous_batching/cache.py``).
PAGED_RANGE = (">=5.18", "<5.25")


def parse_version(v: str) -> tuple[int, int, int]:
    """``"5.24.0"`` → ``(5, 24, 0)``; pre-release and local suffixes are ignored."""
    nums = [int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3]]
    while len(nums) < 3:
        nums.append(0)
    return tuple(nums)  # type: ignore[return-value]


def _in_range(v: tuple[int, int, int], rng: tuple[str, str]) -> bool:
    lo, hi = parse_version(rng[0][2:]), parse_version(rng[1][1:])
    return lo <= v < hi


def installed_version() -> str | None:
    """The installed transformers version (from its distribution metadata), or None."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def check_version(what: str = "cache", paged: bool = False, version: str | None = None) -> str:
    """Refuse a transformers version outside the supported range.

    Args:
        what: what is being read, for the message.
        paged: check the continuous-batching paged-cache range (:data:`PAGED_RANGE`)
            instead of :data:`SUPPORTED_RANGE`.
        version: the version to check (default: the installed one).
    Returns:
        the version string.
    Raises:
        DetectionError: naming the installed version and the supported range.
    """
    v = version or installed_version()
    rng = PAGED_RANGE if paged else SUPPORTED_RANGE
    text = f"transformers{rng[0]},{rng[1]}"
    if v is None:
        raise DetectionError(f"kvcore-transformers reads a transformers {what}, but transformers is not installed; install {text}")
    if not _in_range(parse_version(v), rng):
        raise DetectionError(
            f"kvcore-transformers supports {text} for the {what}; transformers {v} is installed. "
            f"Its KV cache layout was not verified on {v}: install a version in that range (pip install '{text}')"
        )
    return v

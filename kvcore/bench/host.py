"""What a run records about the machine it ran on: device, threads, native kernel, CPU model,
load average, free memory."""

from __future__ import annotations

import os

import torch

from kvcore.kernels import _build


def _meta(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    st = _build.status()
    return {
        "device": device.type,
        "device_name": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "native": {"loaded": st.loaded, "cuda": st.cuda, "reason": st.reason},
        "gbps_counts": "device rows: bytes read + bytes written; pinned rows: bytes crossing the host link once",
        "loadavg_start": _loadavg(),
        "cpu_model": _cpu_model() if device.type == "cpu" else None,
    }


def _cpu_model() -> str | None:
    """The CPU's model name (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _loadavg() -> list[float] | None:
    """The host's 1, 5 and 15 minute load averages (None where the OS has none): a shared
    machine's other work, to read CPU rows by."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _available_bytes(device: torch.device) -> int | None:
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None

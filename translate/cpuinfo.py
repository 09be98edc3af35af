"""The CPU this process runs on, as Linux's /proc/cpuinfo describes it, read in one place for whoever asks:
the CPU backend's choice of kernels (cpu.py), the machine a bench record names (bench/results.py)."""
from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def first_cpu(text: str | None = None) -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (or in `text`): "vendor_id", "model name", "flags" and
    the rest, as written; empty where there is no such file (not Linux)."""
    if text is None:
        try:
            text = CPUINFO.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():  # a blank line ends a processor's block
            if fields:
                break
            continue
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())
    return fields

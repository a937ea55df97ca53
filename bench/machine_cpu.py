"""The whole machine's CPU seconds so far, for benches whose server shares the client's cores."""

from __future__ import annotations

import os

__all__ = ["machine_cpu_s"]


def machine_cpu_s() -> float:
    """CPU seconds every process of the machine has used (a loopback server's too): /proc/stat less idle and
    iowait; 0 where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")

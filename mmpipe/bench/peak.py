"""The device peak MFU is measured against: the KNOWN_DEVICES table (mmpipe.planning.costmodel) on a GPU, a
measured one-thread matmul rate on CPU (each CPU rank runs one thread, so a rank's peak is that)."""
from __future__ import annotations

import time

from ..planning.costmodel import KNOWN_DEVICES


def cpu_matmul_peak(precision: str = "fp32", n: int = 512, seconds: float = 0.5) -> float:
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(3):
            a @ b
        best, t_end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < t_end:  # the best of several short bursts: least disturbed by neighbours
            t0 = time.perf_counter()
            for _ in range(4):
                a @ b
            best = max(best, 4 * 2 * n ** 3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(threads)


def detect_device() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).lower()
            for marker, key in (("h200", "h200"), ("h100", "h100-80gb"), ("a100", "a100-40gb" if "40gb" in name
                                 else "a100-80gb"), ("l40s", "l40s")):
                if marker in name:
                    return key
            return "unknown-gpu"
    except Exception:
        pass
    return "cpu"


def peaks(device: str | None, override: float | None, precisions: set[str]) -> tuple[str, dict[str, float | None]]:
    """(device name, precision -> peak FLOP/s per device)."""
    device = device or detect_device()
    if override:
        return device, {p: override for p in precisions}
    if device == "cpu":
        return device, {p: cpu_matmul_peak(p) for p in precisions}
    dev = KNOWN_DEVICES.get(device)
    # the table holds dense bf16/fp16 peaks; fp32 runs on tensor cores as TF32 at half of it
    return device, {p: (dev.peak_flops / (2 if p == "fp32" else 1)) if dev else None for p in precisions}

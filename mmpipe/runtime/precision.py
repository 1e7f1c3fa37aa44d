"""Which precisions the accelerator runs, asked of DeepSpeed's own accelerator, checked before launch.

DeepSpeed 0.19.8 refuses a precision the device lacks inside `deepspeed.initialize` ("Type fp16 is
not supported on your device."), in every rank, as a traceback. mmpipe asks the same accelerator
first: the front door (`mmpipe train`, local launches) before any process starts, and every rank
before `deepspeed.initialize`, gathered so rank 0 names each host and rank that differs in one line.

What the answers are (DeepSpeed 0.19.8, torch 2.14):
- CPU: bf16 always; fp16 only where oneDNN has fp16 kernels (`torch.ops.mkldnn._is_mkldnn_fp16_supported()`:
  Intel CPUs with AVX512-FP16 / AMX-FP16; an AMD EPYC has none).
- CUDA: fp16 from compute capability 7.0 (V100, T4), 6.x with DS_ALLOW_DEPRECATED_FP16=1; bf16 from
  8.0 (A100, H100). torch also answers True for bf16 on 7.x, where it is emulated (several times
  slower than fp16 on the tensor cores), so mmpipe asks for compute capability 8.0 as well.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ..config import ConfigError

# What to use instead, by precision: files in ds_configs/
SUGGEST = {
    "fp16": "bf16 (ds_configs/zero1_bf16.json) or fp32 (ds_configs/cpu_fp32.json)",
    "bf16_gpu": "fp16 with ZeRO-1 (ds_configs/zero1_fp16.json) or fp32 (ds_configs/cpu_fp32.json)",
    "bf16": "fp32 (ds_configs/cpu_fp32.json)",
}
# Test hook: MMPIPE_FAKE_ACCELERATOR="fp16=0,bf16=1" overrides the accelerator's answers in this
# process (DeepSpeed's own check included); a "rankN:" prefix limits it to the process with RANK=N.
FAKE_ENV = "MMPIPE_FAKE_ACCELERATOR"


class UnsupportedPrecision(ConfigError):
    """The config is valid, this device cannot run its precision (bench reports it `unsupported`)."""


@dataclass(frozen=True)
class Device:
    kind: str  # DeepSpeed's device_name(): "cpu", "cuda", ...
    name: str  # "AMD EPYC 7B13", "Tesla V100-SXM2-32GB"
    fp16: bool
    bf16: bool
    capability: tuple[int, int] | None = None  # CUDA compute capability

    def describe(self) -> str:
        if self.capability:
            return f"{self.name} (compute capability {self.capability[0]}.{self.capability[1]})"
        return f"{self.name} ({self.kind})"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "this CPU"


def _apply_fake(acc) -> None:
    spec = os.environ.get(FAKE_ENV, "")
    if spec.startswith("rank"):
        who, _, spec = spec.partition(":")
        if who != f"rank{os.environ.get('RANK', '0')}":
            return
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        if key in ("fp16", "bf16"):
            answer = val not in ("0", "no", "false")
            setattr(acc, f"is_{key}_supported", lambda a=answer: a)  # the instance DeepSpeed asks too


def this_device() -> Device:
    """The accelerator this process's ranks use, as DeepSpeed sees it."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    _apply_fake(acc)
    kind = acc.device_name()
    fp16, bf16 = bool(acc.is_fp16_supported()), bool(acc.is_bf16_supported())  # the CPU's says None for no
    if kind == "cuda":
        import torch
        cap = torch.cuda.get_device_capability()
        bf16 = bf16 and cap >= (8, 0)
        return Device(kind, torch.cuda.get_device_name(), fp16, bf16, cap)
    return Device(kind, _cpu_name() if kind == "cpu" else kind, fp16, bf16)


def problem(precision: str, device: Device) -> str | None:
    """One line saying why `device` cannot run `precision` and what to use instead, or None."""
    if precision == "fp16" and not device.fp16:
        why = ("has no fp16 kernels (oneDNN's need AVX512-FP16 / AMX-FP16)" if device.kind == "cpu"
               else "does not run fp16 (compute capability 7.0 or newer does)")
        return f"fp16.enabled: {device.describe()} {why}; use {SUGGEST['fp16']}"
    if precision == "bf16" and not device.bf16:
        if device.kind == "cpu":
            return f"bf16.enabled: {device.describe()} does not run bf16; use {SUGGEST['bf16']}"
        return (f"bf16.enabled: {device.describe()} has no bf16 (compute capability 8.0 or newer: A100, H100); "
                f"use {SUGGEST['bf16_gpu']}")
    return None


def check(precision: str, device: Device | None = None) -> None:
    """Raise UnsupportedPrecision if this machine's accelerator cannot run `precision`."""
    msg = problem(precision, device or this_device())
    if msg:
        raise UnsupportedPrecision(msg)


def check_all_ranks(precision: str) -> str | None:
    """Collective, after the process group and before deepspeed.initialize: every rank asks its own
    accelerator; the problems come back as one line per (host, problem) with the ranks it holds,
    identical on every rank, so all stop together. None when every rank can run `precision`."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu":  # NCCL gathers through this rank's own device
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mine = (socket.gethostname(), problem(precision, this_device()))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    bad: dict[tuple[str, str], list[int]] = {}
    for rank, (host, msg) in enumerate(everyone):
        if msg:
            bad.setdefault((host, msg), []).append(rank)
    if not bad:
        return None
    return "\n".join(f"host {host}, rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {msg}"
                     for (host, msg), r in bad.items())

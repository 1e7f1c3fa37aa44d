"""How a rank ends (issue 60): every exit path, the same orderly teardown, and the rank's one-line reason.

Why a finished run could abort (`terminate called without an active exception`, SIGABRT, the launcher's 250):
gloo runs each collective on a worker thread of its process group (`pt_gloo_runloop`), which drops the finished
work, and with it the last C++ reference to the collective's tensors, a moment after the caller has its result.
Freeing a tensor whose Python object torch has kept alive for C++ takes the GIL; a thread that asks for the GIL
once the interpreter is finalizing is ended with pthread_exit, whose unwinding through the work's noexcept
destructor calls std::terminate. gdb on an aborted rank's core showed exactly that thread: runLoop ->
~AsyncAllgatherWork -> TensorImpl::decref_pyobject -> take_gil -> PyThread_exit_thread -> std::terminate, while
the main thread was in Py_FinalizeEx's garbage collection; the work was the report's all_gather_object, the last
collective before the last stage's rank returns (docs/reliability.md, "A clean exit").

`dist.destroy_process_group()` alone does not stop those threads: it unregisters the groups, but a gloo group's
threads are joined only when its ProcessGroup object is freed, and other objects still hold the groups: DeepSpeed's
pipeline grid, engine and module (attributes), its module globals (deepspeed.utils.groups, the pipeline's p2p
module), and torch.distributed.nn.functional, whose functions bind `group=group.WORLD` as a default when the module
is imported (DeepSpeed imports it after the process group exists). The engine itself is never collected: the
autograd graph's C++ side holds hooks that refer to it. Measured on a PP=2 `small` run: after
destroy_process_group the last stage's rank still ran 6 groups' threads (a transport loop and 2 workers each),
and 5 after clearing DeepSpeed's module globals and collecting. So `release` drops every Python reference to the
destroyed groups (dicts, lists, closure cells) and collects: each group is freed here, in the main thread, while
the interpreter is whole; its destructor lets the workers finish (the GIL released) and joins them. This module
imports torch.distributed.nn before any group exists, so that default is None. After `release` no gloo thread
runs on either rank.
"""
from __future__ import annotations

import gc
import os
import sys
import traceback
import types
import weakref
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before any process group: its functions' group=WORLD default binds None

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # a group's worker threads and its transport's event loop
ERRORS = "errors"  # OUTPUT_DIR/errors/rank<R>.txt: a rank's traceback, named by its one-line reason
_groups: list[weakref.ref] = []  # the destroyed process groups, until release sees them freed
_closers: list[Callable[[], None]] = []


def end_of_run(stream) -> None:
    """Every rank, after its last step (the run finished, or a preemption's checkpoint is saved): the loader's
    worker processes stopped, a barrier (no rank is still sending or receiving), the process groups destroyed."""
    stream.close()
    dist.barrier()
    destroy()


def on_exit(close: Callable[[], None]) -> None:
    """Run `close` in `release` (an error's exit path too): e.g. the data stream's, which stops the loader's worker
    processes. Closing twice must be harmless."""
    _closers.append(close)


def destroy() -> None:
    """dist.destroy_process_group(), remembering the groups (weakly) so that `release` can see them freed."""
    from torch.distributed.distributed_c10d import _world
    _groups.extend(weakref.ref(pg) for pg in _world.pg_map)
    dist.destroy_process_group()


def release() -> list[str]:
    """Every exit path, the last thing before the rank returns its status: the registered closers run, the process
    groups destroyed if an early exit left them (locally: after an error no barrier, a peer may be gone), every
    Python reference to them dropped, so that each is freed now, in the main thread: its destructor lets gloo's
    worker threads finish (the GIL released) and joins them. Returns the names of gloo threads still running
    (none expected)."""
    while _closers:
        _closers.pop()()
    if dist.is_available() and dist.is_initialized():
        destroy()
    gc.collect()  # the groups that only garbage still held
    for ref in _groups:
        _forget(ref)
    _groups.clear()
    gc.collect()
    return [n for n in thread_names() if n in GLOO_THREADS]


def _forget(ref: weakref.ref) -> None:
    """Drop every reference to a destroyed group from the dicts (objects' attributes, modules' globals), lists and
    closure cells holding it: DeepSpeed's grid, engine and module, deepspeed.utils.groups and the pipeline's p2p
    module keep theirs, and the engine cannot be collected (the autograd graph's C++ side holds its hooks).
    Plain loops, no comprehension: one would close over `pg`, whose own cell would then be a referrer to clear."""
    pg = ref()
    if pg is None:
        return
    for holder in gc.get_referrers(pg):
        if isinstance(holder, types.CellType):
            holder.cell_contents = None
            continue
        # a list, a dict, or an object whose attributes Python 3.11 keeps without a dict until asked for one
        slots = holder if isinstance(holder, (list, dict)) else getattr(holder, "__dict__", None)
        if not isinstance(slots, (list, dict)):
            continue
        keys = []
        for k, v in (enumerate(slots) if isinstance(slots, list) else slots.items()):
            if v is pg:
                keys.append(k)
        for k in keys:
            slots[k] = None


def thread_names() -> list[str]:
    """This process's threads by their OS names (/proc/self/task/*/comm: C++ threads too, which
    threading.enumerate does not list)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def rank_failed(e: BaseException, out: str | Path) -> int:
    """An error raised in this rank: one line on stderr naming the rank and the error, the traceback in
    OUTPUT_DIR/errors/rank<R>.txt; exit status 1."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    first = (str(e).strip().splitlines() or [""])[0]
    where = Path(out) / ERRORS / f"rank{rank}.txt"
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text("".join(traceback.format_exception(e)))
        kept = f"; traceback in {where}"
    except OSError as write_error:  # the output directory itself may be the problem
        kept = f"; traceback not written ({write_error.strerror}: {where})"
    print(f"mmpipe: error: rank {rank}: {type(e).__name__}: {first}{kept}", file=sys.stderr, flush=True)
    return 1


def error_fault(engine) -> None:
    """Test hook: MMPIPE_FAULT=raise-in-step:STEP:RANK raises a RuntimeError on global rank RANK in its first
    forward of step STEP, in the middle of the step: the other stages are sending to it or waiting on it. Unset
    in normal runs."""
    spec = os.environ.get("MMPIPE_FAULT", "")
    if not spec.startswith("raise-in-step:"):
        return
    _, step, rank = spec.split(":")
    if int(rank) != dist.get_rank():
        return

    def fault(module, inputs):
        if engine.global_steps + 1 == int(step):  # global_steps: the optimizer steps done before this one
            raise RuntimeError(f"injected fault (MMPIPE_FAULT={spec})")
    engine.module.register_forward_pre_hook(fault)

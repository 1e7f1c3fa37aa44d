"""Rank 0's table and check.json: the ranks, the links, and one line per check (pass / FAIL)."""
from __future__ import annotations

import json
from pathlib import Path

from ..run_config import RunConfig
from .main import CHECK_FILE


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def summaries(checks: dict) -> dict[str, str]:
    """One line per check: what was measured against what."""
    env, links, eq, loader = (checks.get(k) for k in ("env", "links", "equivalence", "loader"))
    out = {"env": f"{env['ranks']} ranks, backend {env['backend']}" + "".join(f"; {p}" for p in env["problems"])}
    slow = [r["name"] for r in links["rows"] if not r["ok"]]
    a2a = [r for r in links["rows"] if r["kind"] == "all-to-all"]
    tp = [r for r in links["rows"] if r["kind"] == "tp all-reduce"]
    sp = [r for r in links["rows"] if r["kind"] == "sp all-to-all"]
    out["links"] = (f"{len(links['rows'])} links" + (f"; slow: {', '.join(slow)}" if slow else "")
                    + (f"; all-to-all (one MoE block, one micro-batch): {_a2a_line(a2a)}" if a2a else "")
                    + (f"; TP all-reduce (one block's output, 2 forward + 2 backward a block): {_a2a_line(tp)}"
                       if tp else "")
                    + (f"; SP all-to-all (one block's q, k, v and output, forward; as many backward): {_a2a_line(sp)}"
                       if sp else "")
                    if links["rows"] else "one rank: no link to measure")
    out["equivalence"] = eq.get("error") or eq.get("skipped") or (
        f"{eq['steps']} steps, {', '.join(f'{k} {v}' for k, v in eq['blocks'].items())} blocks: "
        f"loss diff {eq['max_loss_rel_diff']:.1e} "
        f"(tol {eq['tolerance']['loss']:.0e}), grad-norm diff {eq['max_grad_norm_rel_diff']:.1e} "
        f"(tol {eq['tolerance']['grad_norm']:.0e}; worst: step {eq['worst_grad_norm']['step']} "
        f"{eq['worst_grad_norm']['where']})")
    for k, line in (("memory", _memory_line), ("profile", _profile_line)):
        if checks.get(k) is not None:
            out[k] = checks[k].get("error") or checks[k].get("skipped") or line(checks[k])
    need = loader["pipeline_rows_per_s"]
    out["loader"] = (f"the loader feeds {loader['rows_per_s']:.1f} of the "
                     f"{f'{need:.1f}' if need else 'unknown (no planner device)'} rows/s the pipeline can take "
                     f"({loader['pipeline_rate']}; "
                     f"{loader['samples_per_s']:.1f} samples/s"
                     + (f", {loader['clips_per_s']:.1f} clips/s at the set's clips per sample"
                        if loader.get("clips_per_s") else "")
                     + f", {loader['workers']} workers)")
    return out


def _a2a_line(rows: list[dict]) -> str:
    """The slowest group's collective (an EP group's all-to-all, a TP group's all-reduce, an SP group's all-to-alls)
    against the planner's time for it."""
    worst = max(rows, key=lambda r: r["seconds"])
    return (f"slowest {_ms(worst['seconds'])} for {_bytes(worst['bytes'])} ({worst['name']}), planned "
            f"{_ms(worst.get('planned_s'))}")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _memory_line(m: dict) -> str:
    worst = max(m["ranks"], key=lambda r: (r["measured"] or 0) / r["predicted"])
    over = [f"rank {r['rank']}" for r in m["ranks"] if not r["ok"]]
    return (f"one step of the full model: worst rank {worst['rank']} (stage {worst['stage']}) "
            f"{_mib(worst['measured'])} of {_mib(worst['predicted'])} predicted ({worst['how']}; fails over "
            f"x{m['tolerance']} + {_mib(m['slack_bytes'])})" + (f"; over: {', '.join(over)}" if over else "")
            + ("; parameters: each rank's bytes the planner's for its stage (within 1%)"
               if all(r.get("weights_ok") for r in m["ranks"]) else ""))


def _profile_line(p: dict) -> str:
    return (f"{p['path']}: {p['precision']} efficiency {p['efficiency']:.3f} of {p['peak_flops'] / 1e9:.1f} GFLOP/s "
            f"(slowest rank {p['slowest_rank']}: {p['model_seconds_per_micro'][p['slowest_rank']] * 1e3:.1f} ms per "
            f"micro-batch, forward + backward), per-slot overhead {p['microbatch_overhead_s'] * 1e3:.1f} ms; "
            f"mmpipe plan --device-profile {p['path']} {p['plan_flags']}")


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def render(run: RunConfig, ranks: list[dict], checks: dict) -> str:
    title = (f"check: {run.model.name}, {run.stages} stages x dp {run.dp}{f' x tp {run.tp}' if run.tp > 1 else ''}"
             f"{f' x sp {run.sp}' if run.sp > 1 else ''}, "
             f"micro {run.micro} x GAS {run.gas}, "
             f"{run.precision}, ZeRO-{run.zero_stage}, schedule {run.schedule}")
    rank_rows = [[r["rank"], r["host"], r["device"], "yes" if not r["precision_problem"] else "NO", r["torch"],
                  r["deepspeed"], r["nccl"] or "-", r["backend"]] for r in ranks]
    link_rows = [[r["name"], r["kind"], _bytes(r["bytes"]), _ms(r["seconds"]), _ms(r.get("planned_s")),
                  f"{_bytes(r['bandwidth'])}/s",
                  f"{r['latency_s'] * 1e6:.0f} us" if r["latency_s"] is not None else "-",
                  "pass" if r["ok"] else "FAIL"]
                 for r in checks["links"]["rows"]]
    lines = summaries(checks)
    parts = [title, "", _table(["rank", "host", "device", run.precision, "torch", "deepspeed", "nccl", "backend"],
                               rank_rows)]
    if link_rows:
        parts += ["", _table(["link", "kind", "size", "time", "planned", "bandwidth", "latency", "result"],
                             link_rows)]
    if (checks.get("memory") or {}).get("ranks"):
        parts += ["", _table(["rank", "stage", "predicted", "measured", "ratio", "result"],
                             [[r["rank"], r["stage"], _mib(r["predicted"]), _mib(r["measured"]),
                               f"{r['measured'] / r['predicted']:.2f}" if r["measured"] is not None else "-",
                               "pass" if r["ok"] else "FAIL"] for r in checks["memory"]["ranks"]])]
    parts += ["", _table(["check", "result", "detail"],
                         [[k, "pass" if c["ok"] else "FAIL", lines[k]] for k, c in checks.items()])]
    return "\n".join(parts)


def write(out: Path, run: RunConfig, ranks: list[dict], checks: dict) -> list[str]:
    """Print the table, write check.json; the failed checks' names."""
    failed = [k for k, c in checks.items() if not c["ok"]]
    print(render(run, ranks, checks), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"ok": not failed, "failed": failed, "model": run.model.name, "stages": run.stages, "dp": run.dp,
           "tp": run.tp, "sp": run.sp, "micro": run.micro, "gas": run.gas, "precision": run.precision, "ranks": ranks,
           "checks": checks, "summary": summaries(checks)}
    (out / CHECK_FILE).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return failed

"""PNG plots of a sweep: throughput by variant, peak memory per rank, bubble measured vs 1F1B theory."""
from __future__ import annotations

from pathlib import Path


def plot_all(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    labels = [f"{r['name']}#{r.get('repeat', 0)}" for r in ok]
    paths = []

    # every row gets a slot: one that did not run (unsupported, refused, crashed...) shows its status
    allr = rows
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(allr) + 2), 4))
    ax.bar(range(len(allr)), [r["samples_per_s"] if r["status"] == "ok" else 0 for r in allr],
           yerr=[(r.get("samples_per_s_iqr") or 0) if r["status"] == "ok" else 0 for r in allr], color="tab:blue")
    for i, r in enumerate(allr):
        if r["status"] != "ok":
            ax.text(i, 0, f" {r['status']}", rotation=90, ha="center", va="bottom", fontsize=8, color="tab:red")
    ax.set_xticks(range(len(allr)), [f"{r['name']}#{r.get('repeat', 0)}" for r in allr], rotation=45, ha="right",
                  fontsize=8)
    ax.set_ylabel("samples/s (median, IQR bars)")
    ax.set_title("Throughput by variant")
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(ok) + 2), 4))
    width = 0.8 / max(1, max((len(r.get("peak_mem_mb_per_rank") or []) for r in ok), default=1))
    for i, r in enumerate(ok):
        for k, mb in enumerate(r.get("peak_mem_mb_per_rank") or []):
            if mb:
                ax.bar(i - 0.4 + width * (k + 0.5), mb, width, color=f"C{k}", label=f"rank {k}" if i == 0 or k >= len(
                    ok[0].get("peak_mem_mb_per_rank") or []) else None)
    ax.set_xticks(range(len(ok)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("peak MB (RSS on CPU, max allocated on GPU)")
    ax.set_title("Peak memory per rank")
    handles, names = ax.get_legend_handles_labels()
    uniq = dict(zip(names, handles))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    fig.tight_layout()
    paths.append(out / "memory.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    pipe = [r for r in ok if r.get("bubble_measured") is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(pipe) + 2), 4))
    x = range(len(pipe))
    ax.bar([i - 0.2 for i in x], [r["bubble_measured"] for r in pipe], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["bubble_theory"] for r in pipe], 0.4, label="1F1B theory (p-1)/(m+p-1)")
    ax.set_xticks(list(x), [f"{r['name']}#{r.get('repeat', 0)}" for r in pipe], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("idle fraction of the step")
    ax.set_title("Pipeline bubble: measured vs theory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "bubble.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths

"""bench_multimodel.py's picture: TTFT over time per model and configuration, the restarts marked; KV memory."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"elastic": "tab:blue", "static": "tab:orange", "elastic+host": "tab:green"}
MiB = 1 << 20


def plot(runs: dict, path: Path, *, crash_model: str) -> None:
    """One column per pattern; a row per model (TTFT of each request at its arrival), then memory."""
    models = list(next(iter(runs.values()))["patterns"]["bursts"]["per_model"])
    patterns = list(dict.fromkeys(p for run in runs.values() for p in run["patterns"]))
    fig, axes = plt.subplots(len(models) + 1, len(patterns), figsize=(6 * len(patterns), 3 * (len(models) + 1)),
                             sharex="col", squeeze=False)
    for col, pname in enumerate(patterns):
        for row, model in enumerate(models):
            ax = axes[row][col]
            for config, run in runs.items():
                p = run["patterns"].get(pname)
                if p is None:
                    continue
                pts = [(r["arrival"], r["ttft"] * 1e3) for r in p["requests"] if r["model"] == model and r["ttft"]]
                if pts:
                    ax.scatter(*zip(*pts), s=6, alpha=0.6, color=COLORS.get(config), label=config)
                mark_restarts(ax, run, pname, config, label=row == 0 and config == next(iter(runs)))
            ax.set_yscale("log")
            ax.set_title(f"{model} · {pname}", fontsize=9)
            if col == 0:
                ax.set_ylabel("TTFT (ms)")
        ax = axes[-1][col]
        for config, run in runs.items():
            p = run["patterns"].get(pname)
            if p is None or config == "elastic+host":
                continue
            for model, style in zip(models, ("-", "--", ":")):
                pts = [(s["t"] - p["offset_s"], s["classes"][model]["mapped_bytes"] / MiB) for s in run["samples"]
                       if model in s["classes"] and 0 <= s["t"] - p["offset_s"] <= p["duration_s"]]
                if pts:
                    ax.plot(*zip(*pts), style, color=COLORS.get(config), label=f"{config} {model}")
            mark_restarts(ax, run, pname, config, label=False)
        ax.set_title(f"KV memory mapped per model · {pname}", fontsize=9)
        ax.set_xlabel("seconds into the trace")
        if col == 0:
            ax.set_ylabel("MiB")
    axes[0][0].legend(fontsize=7, markerscale=2)
    axes[-1][0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"TTFT per request at its arrival; shaded: {crash_model}'s server down until ready again", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mark_restarts(ax, run: dict, pattern: str, config: str, *, label: bool) -> None:
    for e in run["restarts"]:
        if e["pattern"] != pattern:
            continue
        ax.axvline(e["t_kill"], color=COLORS.get(config), linestyle="--", linewidth=0.8)
        ax.axvspan(e["t_kill"], e["t_ready"], color=COLORS.get(config), alpha=0.08)
        if label:
            ax.annotate(f"{e['signal']} {e['model']}", (e["t_kill"], 1), xycoords=("data", "axes fraction"),
                        fontsize=7, va="top", color=COLORS.get(config))

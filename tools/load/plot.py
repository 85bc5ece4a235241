"""The throughput / TTFT-P99 Pareto picture of a sweep (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

from tools.load.report import pareto


def require_matplotlib() -> None:
    """Fail before the run, with what to do, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'npuserve[plot]' "
                         "(or .venv/bin/pip install matplotlib)") from None


def pareto_png(rows: list[dict], path: str, title: str) -> None:
    """One series per `label`: every point (annotated with its cap or rate) and its frontier as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    labels = list(dict.fromkeys(r["label"] for r in rows))
    markers = "osD^v<>"
    for i, label in enumerate(labels):
        pts = [r for r in rows if r["label"] == label and r.get("ttft_p99_ms") and r.get("tokens_per_s")]
        if not pts:
            continue
        dashed = label.startswith("predicted")
        x = [r["ttft_p99_ms"] / 1000.0 for r in pts]
        y = [r["tokens_per_s"] for r in pts]
        base = next(j for j, lab in enumerate(labels) if lab == label.removeprefix("predicted "))
        color = f"C{base % 10}"  # a prediction shares its variant's colour, hollow and dashed
        ax.scatter(x, y, marker=markers[i % len(markers)], label=label, zorder=3,
                   facecolors="none" if dashed else color, edgecolors=color)
        front = pareto(pts)
        ax.plot([r["ttft_p99_ms"] / 1000.0 for r in front], [r["tokens_per_s"] for r in front],
                linestyle="--" if dashed else "-", color=color, alpha=0.8)
        for r, xi, yi in zip(pts, x, y):
            tag = r.get("concurrency") or r.get("rate")
            if tag is not None:
                ax.annotate(str(tag), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7,
                            color=color)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT P99 (s, log scale)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

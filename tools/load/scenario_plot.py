"""The scenarios' pictures (matplotlib): per-token timelines (long-prompt), TTFT CDFs (tenant-flood)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tools.load.runner import Record
from tools.load.workload import Request


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_png(runs: Mapping[str, Sequence[Record]], requests: Sequence[Request], path: str, title: str) -> None:
    """One panel per server: a dot per token event of every stream request (row = stream), the long
    prompts' span from sent to first token as a shaded band; time from the run's first send."""
    plt = _plt()
    role = {r.index: r for r in requests}
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.2 + 1.6 * len(runs)), dpi=110, sharex=True, squeeze=False)
    for ax, (label, recs) in zip(axes[:, 0], runs.items()):
        t0 = min((r.sent for r in recs), default=0.0)
        for r in recs:
            req = role.get(r.index)
            if req is None:
                continue
            if req.role == "long":
                end = r.first if r.first is not None else (r.last or r.sent)
                ax.axvspan(r.sent - t0, end - t0, color="C3", alpha=0.12)
                continue
            times = [t - t0 for t in r.token_times()]
            ax.plot(times, [req.stream] * len(times), "|", color=f"C{req.stream % 10}", markersize=6)
        ax.set_ylabel(f"{label}\nstream")
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds (shaded: a long prompt from sent to its first token)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def ttft_cdf_png(runs: Mapping[str, Mapping[str, Sequence[float]]], path: str, title: str) -> None:
    """`runs[server][series]` = TTFTs (ms): one step CDF per (server, series), seconds on a log axis."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for i, (label, series) in enumerate(runs.items()):
        for j, (name, xs) in enumerate(series.items()):
            xs = sorted(x / 1000.0 for x in xs)
            if not xs:
                continue
            ys = [(k + 1) / len(xs) for k in range(len(xs))]
            ax.step(xs, ys, where="post", color=f"C{i}", linestyle="-" if j == 0 else "--",
                    label=f"{label}: {name} ({len(xs)})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

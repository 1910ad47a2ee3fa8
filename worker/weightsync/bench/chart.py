"""`weightsync bench --chart FILE.png`: the transfer benchmark's report as one picture, for the
reader who would rather look than read the table.

One panel per dtype; per shape (trainers -> inference ranks) a bar per method, its GB/s delivered
(the version's bytes times the inference ranks, per second: the table's GB/s), and a black line
across the group at what the shape allows: over shaped links the speed of light (the busiest
link's bytes at the link's rate), on loopback the ceiling (raw sockets moving the same bytes
between the same processes). Each bar is labelled with its ratio to that line, the number the
table prints. matplotlib draws it (the examples extra), without a display.
"""

from __future__ import annotations

from pathlib import Path

# the order and colours of the methods, the same in every chart
METHOD_COLOURS = {"weightsync": "#1f77b4", "delta": "#2ca02c", "broadcast": "#ff7f0e", "ceiling": "#7f7f7f"}


def limit_gbps(case: dict) -> tuple[float, str]:
    """The GB/s the shape allows and what it is: the speed of light over links, else the ceiling's."""
    any_method = next(iter(case["methods"].values()))
    delivered = any_method["gbps"] * any_method["seconds_per_version"]  # GB a version delivers
    if "speed_of_light" in case:
        return delivered / case["speed_of_light"], "speed of light"
    return case["methods"]["ceiling"]["gbps"], "ceiling (raw sockets)"


def ratio(case: dict, method: str) -> float:
    figures = case["methods"][method]
    return figures["ratio_to_light"] if "speed_of_light" in case else figures["ratio_to_ceiling"]


def pyplot(command: str):
    """matplotlib's pyplot, drawing into files without a display; `command` says who needs it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{command} needs matplotlib: pip install 'weightsync[examples]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def chart(report: dict, path: str | Path) -> Path:
    """Draw `report` (what `weightsync bench --json` prints) into the PNG at `path`."""
    plt = pyplot("weightsync bench --chart")

    dtypes = list(dict.fromkeys(c["dtype"] for c in report["cases"]))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.8), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        cases = [c for c in report["cases"] if c["dtype"] == dtype]
        methods = [m for m in METHOD_COLOURS if any(m in c["methods"] for c in cases)]
        width = 0.8 / len(methods)
        what = ""
        for x, case in enumerate(cases):
            limit, what = limit_gbps(case)
            ax.hlines(limit, x - 0.45, x + 0.45, colors="black", linewidth=2)
            for k, m in enumerate(methods):
                if m not in case["methods"]:
                    continue
                at = x - 0.4 + width * (k + 0.5)
                gbps = case["methods"][m]["gbps"]
                ax.bar(at, gbps, width, color=METHOD_COLOURS[m], label=m if x == 0 else None)
                ax.annotate(f"{ratio(case, m):.2f}", (at, gbps), ha="center", va="bottom", fontsize=8)
        ax.plot([], [], color="black", linewidth=2, label=what)
        top = max(max(limit_gbps(c)[0] for c in cases), max(f["gbps"] for c in cases for f in c["methods"].values()))
        ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
        ax.set_xticks(range(len(cases)), [f"{c['trainers']} -> {c['inferences']}" for c in cases])
        ax.set_xlabel("trainer ranks -> inference ranks")
        ax.set_ylabel("GB/s delivered")
        ax.set_title(f"{dtype}: each bar's ratio to the black line above it", fontsize=10)
        ax.legend(fontsize=8, loc="upper center", ncol=len(methods) + 1)
    links = f"links of {report['links']} each way" if report.get("links") else "loopback"
    return save(plt, fig, f"weightsync bench, {links}: {report['model']}", path)


def save(plt, fig, title: str, path: str | Path) -> Path:
    """`fig`, titled, into the PNG at `path` (the same size of type and resolution in every picture)."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

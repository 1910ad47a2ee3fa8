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
METHOD_COLOURS = {"weightsync": "#1f77b4", "delta": "#2ca02c", "broadcast": "#ff7f0e", "ceiling": "#7f7f7f",
                  "ahead": "#9467bd", "disk": "#8c564b"}


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


# a version's phases that overlap the ones they contain (a load ahead is inside the staging, the
# worker's load inside the update call, the stall spans pause to resume, the total all of them):
# drawn apart, never stacked
OVERLAPPING = ("prepare", "load", "stall", "total")
# DDP replicas and FSDP2 shards, each with a light shade for the send
WRAP_COLOURS = {"ddp": ("#ff7f0e", "#ffbb78"), "fsdp": ("#1f77b4", "#aec7e8")}


def vllm_chart(report: dict, order: list[str], path: str | Path) -> Path:
    """`weightsync bench --vllm --chart`: per method, where a version's seconds go (each phase's
    median, on the slower server, stacked in `order`, and a black line at the version's total), and
    beside it the seconds per version and the stall, each bar labelled with its ratio to the disk
    reload's."""
    plt = pyplot("weightsync bench --vllm --chart")
    methods = list(report["methods"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    colours = plt.get_cmap("tab20").colors
    for y, name in enumerate(methods):
        phases = report["methods"][name]["phases"]
        start = 0.0
        for k, phase in enumerate(p for p in order if p in phases and p not in OVERLAPPING):
            left.barh(y, phases[phase], left=start, color=colours[order.index(phase) % len(colours)], label=phase)
            start += phases[phase]
        if "total" in phases:  # the version, start to every server serving: what the calls leave out shows
            left.vlines(phases["total"], y - 0.45, y + 0.45, colors="black", linewidth=2,
                        label="total: start -> every server serving")
    handles = {label: h for h, label in zip(*left.get_legend_handles_labels())}
    left.legend(handles.values(), handles.keys(), fontsize=7, ncol=4, loc="upper right")
    left.set_yticks(range(len(methods)), methods)
    left.set_ylim(-0.5, len(methods) + 0.6)  # room for the legend above the bars
    left.set_xlabel("seconds (median of the versions)")
    left.set_title("where a version's seconds go", fontsize=10)
    disk = report["methods"]["disk"]
    width = 0.8 / len(methods)
    for k, name in enumerate(methods):
        m = report["methods"][name]
        for x, (value, base) in enumerate(((m["seconds_per_version"], disk["seconds_per_version"]),
                                           (m["stall_seconds"], disk["stall_seconds"]))):
            at = x - 0.4 + width * (k + 0.5)
            right.bar(at, value, width, color=METHOD_COLOURS.get(name, colours[k]), label=name if x == 0 else None)
            right.annotate(f"{value / base:.2f}x disk", (at, value), ha="center", va="bottom", fontsize=8)
    right.set_xticks([0, 1], ["seconds per version", "stall (served nothing)"])
    right.set_ylabel("seconds (median)")
    right.legend(fontsize=8)
    right.set_title("each bar against the disk reload's", fontsize=10)
    return save(plt, fig, f"weightsync bench --vllm: {report['model']}, {report['trainers']} trainer ranks -> "
                          f"{report['servers']} vLLM servers", path)


def rollout_chart(result: dict, path: str | Path) -> Path:
    """`weightsync bench --vllm --rollout-load --chart`: per way of updating, the tokens per second
    and the longest gap between two tokens of one request with a version every few seconds, each
    against the same load with no update (its bar labelled with the ratio); the seconds from a
    version's publication, and from its staging (ready to commit), to its first token, against the
    stall; and the tokens per second over the run, the publications marked."""
    plt = pyplot("weightsync bench --vllm --rollout-load --chart")
    ways = result["ways"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    axes = axes.flatten()
    for ax, key, title in ((axes[0], "tokens_per_second", "tokens per second"),
                           (axes[1], "longest_gap", "longest gap between two tokens (s)")):
        for x, way in enumerate(ways):
            base, under = way["baseline"][key], way["updates"][key]
            ax.bar(x - 0.2, base, 0.4, color="#7f7f7f", label="no update" if x == 0 else None)
            ax.bar(x + 0.2, under, 0.4, color="#1f77b4", label="a version every "
                   f"{result['every']:g}s" if x == 0 else None)
            ax.annotate(f"{under / base:.2f}x" if base else "-", (x + 0.2, under), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(ways)), [w["way"] for w in ways])
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    for x, way in enumerate(ways):
        rows = list(way.get("path", {}).values())
        for dx, key, color, label in ((-0.12, "first_token", "#1f77b4", "publication -> first token"),
                                      (0.12, "staged_to_first_token", "#ff7f0e", "staged -> first token")):
            seen = [r[key] for r in rows if r.get(key) is not None]
            axes[2].scatter([x + dx] * len(seen), seen, color=color, s=12, label=label if x == 0 else None)
        if way["stall_seconds"] is not None:
            axes[2].hlines(way["stall_seconds"], x - 0.3, x + 0.3, colors="black", label="stall (median)" if x == 0 else None)
    axes[2].set_yscale("log")
    axes[2].set_xticks(range(len(ways)), [w["way"] for w in ways])
    axes[2].set_title("seconds to the first token on the version", fontsize=10)
    axes[2].legend(fontsize=8)
    for way in ways:
        line = way.get("timeline")
        if line:
            rates = line["tokens_per_second"]
            axes[3].plot([line["begin"] + k + 0.5 for k in range(len(rates))], rates, lw=1, label=way["way"])
    for t in (ways[0].get("timeline") or {}).get("published", []):
        axes[3].axvline(t, color="#7f7f7f", lw=0.5, ls=":")
    axes[3].set_xlabel("seconds from the first publication (dotted: publications)", fontsize=8)
    axes[3].set_title("tokens per second, each second", fontsize=10)
    axes[3].legend(fontsize=8)
    return save(plt, fig, f"weightsync bench --vllm --rollout-load: {result['clients']} generations of "
                          f"{result['tokens']} tokens at once", path)


def fsdp_chart(report: dict, path: str | Path) -> Path:
    """`weightsync bench --fsdp --chart`: per dtype, the seconds per version and the slowest
    trainer's send for DDP replicas and FSDP2 shards, and each trainer rank's peak memory beyond its
    start against what it must hold (its shard and the send buffers)."""
    plt = pyplot("weightsync bench --fsdp --chart")
    cases = report["cases"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    wraps = list(cases[0]["methods"])
    width = 0.8 / (2 * len(wraps))
    for x, case in enumerate(cases):
        for k, wrap in enumerate(wraps):
            m = case["methods"][wrap]
            for j, (key, what) in enumerate((("seconds_per_version", "version"), ("send_seconds_per_version", "send"))):
                at = x - 0.4 + width * (2 * k + j + 0.5)
                left.bar(at, m[key], width, color=WRAP_COLOURS[wrap][j], label=f"{wrap}: {what}" if x == 0 else None)
            for r in m["memory"]:
                peak, bound = r["peak_beyond_start"] / 2**20, r["bound"] / 2**20
                at = x * (len(m["memory"]) + 1) + r["rank"]
                right.bar(at + (k - 0.5) * 0.4, peak, 0.4, color=WRAP_COLOURS[wrap][0],
                          label=wrap if x == 0 and r["rank"] == 0 else None)
                if wrap == "fsdp":
                    right.hlines(bound, at - 0.45, at + 0.45, colors="black", linewidth=2,
                                 label="fsdp: shard + send buffers" if x == 0 and r["rank"] == 0 else None)
    labels = [f"{c['dtype']} {c['trainers']} -> {c['inferences']}" for c in cases]
    left.set_xticks(range(len(cases)), labels)
    left.set_ylabel("seconds (median)")
    left.legend(fontsize=8)
    left.set_title("seconds per version, and the slowest trainer's send", fontsize=10)
    ranks = len(cases[0]["methods"][wraps[0]]["memory"])
    right.set_xticks([x * (ranks + 1) + r for x in range(len(cases)) for r in range(ranks)],
                     [f"{c['dtype']}\nrank {r}" for c in cases for r in range(ranks)], fontsize=8)
    right.set_ylim(0, right.get_ylim()[1] * 1.3)  # room for the legend above the bars
    right.set_ylabel("MiB beyond the rank's start (peak)")
    right.legend(fontsize=8)
    right.set_title("each trainer rank's memory", fontsize=10)
    return save(plt, fig, f"weightsync bench --fsdp: {report['model']}", path)


def control_plane_chart(report: dict, path: str | Path) -> Path:
    """`weightsync bench --control-plane --chart`: against the job's ranks, the seconds until every
    rank joined and read the plan, the controller's seconds per version (wall and CPU, median),
    and what heartbeats and the store cost it (CPU seconds a second, MiB held)."""
    plt = pyplot("weightsync bench --control-plane --chart")
    runs = report["runs"]
    ranks = [r["ranks"] for r in runs]
    fig, (join, version, idle) = plt.subplots(1, 3, figsize=(14, 4.4))
    join.plot(ranks, [r["join"]["all_joined_seconds"] for r in runs], "o-", label="every rank joined")
    join.plot(ranks, [r["join"]["all_read_plan_seconds"] for r in runs], "s-", label="every rank read the plan")
    join.set_title("joining", fontsize=10)
    join.set_ylabel("seconds from the first rank's start")
    for key, what in (("version_wall_seconds", "wall"), ("version_cpu_seconds", "controller CPU")):
        version.plot(ranks, [sorted(r["controller"][key])[len(r["controller"][key]) // 2] for r in runs], "o-", label=what)
    version.set_title("the controller per version (median; no bytes move)", fontsize=10)
    version.set_ylabel("seconds")
    idle.plot(ranks, [r["heartbeats"]["controller_cpu_per_second"] for r in runs], "o-",
              label="controller CPU s/s, heartbeats only")
    store = idle.twinx()
    store.plot(ranks, [r["store"]["peak_bytes"] / 2**20 for r in runs], "s--", color="#8c564b", label="store, peak MiB")
    store.set_ylabel("MiB")
    idle.set_title("heartbeats and the store", fontsize=10)
    idle.legend(loc="upper left", fontsize=8)
    store.legend(loc="lower right", fontsize=8)
    for ax in (join, version):
        ax.set_yscale("log")  # the costs span orders of magnitude between the sizes
    for ax in (join, version, idle):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(n) for n in ranks])
        ax.set_xlabel("ranks (trainer and inference)")
        if ax is not idle:
            ax.legend(fontsize=8)
    return save(plt, fig, f"weightsync bench --control-plane: {report['model']}", path)


def save(plt, fig, title: str, path: str | Path) -> Path:
    """`fig`, titled, into the PNG at `path` (the same size of type and resolution in every picture)."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

"""Drawings for `python -m megatron_dist_moe plan --plot` (matplotlib, imported lazily).

plot_plan() draws three byte-proportional panels:
    1. the per-rank activation buffer: slots, device scratch, host overflow scratch (VMM)
    2. slot 0 packed by the simulated layers, for the tracked rank and the most loaded rank:
       full saved state vs input kept for replay, and the reserve for the remaining inputs
    3. each layer's save/replay test: worst-rank candidate + remaining-input reserve vs capacity
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_plan"]

SAVE = "#4C9A5B"
REPLAY = "#E08A2C"
SLOT = "#4C72B0"
SCRATCH = "#C44E52"
HOST = "#B0B0B0"
FREE = "#EDEDED"


def _fmt(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{int(n)} B"


def _bytes_axis(ax, top: float, axis: str = "x"):
    """Ticks at multiples of a power-of-two byte step (about 4-8 of them), labelled in KiB/MiB/GiB."""
    import math

    import matplotlib.ticker as mticker

    step = 2 ** max(int(math.floor(math.log2(max(top, 8) / 6))), 0)
    a = ax.xaxis if axis == "x" else ax.yaxis
    a.set_major_locator(mticker.MultipleLocator(step))
    a.set_major_formatter(mticker.FuncFormatter(lambda v, _: _fmt(v) if v > 0 else "0"))


def _label(ax, x0, width, total, text, y=0.0, color="white"):
    """Put `text` inside a bar segment when it is wide enough to read."""
    if width / max(total, 1) > 0.06:
        ax.text(x0 + width / 2, y, text, ha="center", va="center", fontsize=8, color=color,
                clip_on=True)


def plot_plan(plan, sim, path: str | Path, title: str = "") -> Path:
    """Draw `plan` (a MemoryPlan) and `sim` (cli.SlotSimulation or None) into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    panels = 3 if sim is not None and sim.layers else 1
    heights = [1.0, 1.5, 2.6][:panels]
    fig, axes = plt.subplots(panels, 1, figsize=(11, 1.6 + 1.9 * sum(heights)),
                             gridspec_kw=dict(height_ratios=heights))
    if panels == 1:
        axes = [axes]
    c = plan.config
    fig.suptitle(f"Dist-MoE memory plan{': ' + title if title else ''}\n"
                 f"T={c.num_local_input_tokens} D={c.hidden_dim} F={c.intermediate_dim} "
                 f"K={c.top_k} E={c.num_experts} EP={plan.ep_size} {c.precision}",
                 fontsize=11)

    # 1. buffer layout ---------------------------------------------------------------------------
    ax = axes[0]
    segs = [(f"slot {s}", plan.slot_bytes, SLOT) for s in range(plan.num_slots)]
    segs.append(("device scratch", plan.device_scratch_bytes, SCRATCH))
    if plan.host_scratch_bytes:
        segs.append(("host scratch (VMM)", plan.host_scratch_bytes, HOST))
    total = sum(b for _, b, _ in segs)
    x = 0
    for i, (name, b, color) in enumerate(segs):
        ax.barh(0, b, left=x, height=0.6, color=color, edgecolor="white",
                hatch="//" if color == HOST else None)
        _label(ax, x, b, total, f"{name}\n{_fmt(b)}", color="black" if color == HOST else "white")
        x += b
    ax.set_xlim(0, total)
    _bytes_axis(ax, total)
    ax.set_yticks([])
    ax.set_title(f"activation buffer per rank ({_fmt(total)}; slots {plan.slot_policy}); "
                 f"scratch covers {plan.total_scratch_rows:,} routed rows "
                 f"({plan.total_scratch_rows / plan.balanced_rows:.2g}x balanced)",
                 fontsize=9, loc="left")
    ax.set_xlabel("bytes from the buffer base")
    ax.legend(handles=[Patch(color=SLOT, label="activation slot"),
                       Patch(color=SCRATCH, label="device scratch")]
              + ([Patch(facecolor=HOST, hatch="//", label="host overflow scratch")]
                 if plan.host_scratch_bytes else []),
              fontsize=8, loc="upper right", bbox_to_anchor=(1.0, -0.45), ncol=3, frameon=False)

    if panels == 1:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    layers = sim.layers
    n = len(layers)
    cap = plan.slot_bytes

    # 2. slot packing per rank -------------------------------------------------------------------
    ax = axes[1]
    final = layers[-1].saved_after
    others = [r for r in range(plan.ep_size) if r != sim.tracked_rank]
    busiest = max(others, key=lambda r: final[r]) if others else None
    ranks = [sim.tracked_rank] + ([busiest] if busiest is not None else [])
    for yi, r in enumerate(ranks):
        y = len(ranks) - 1 - yi
        ax.barh(y, cap, left=0, height=0.6, color=FREE, edgecolor="#999999")
        before = 0
        for d in layers:
            kept = d.saved_after[r] - before
            color = REPLAY if d.need_recompute else SAVE
            ax.barh(y, kept, left=before, height=0.6, color=color, edgecolor="white")
            _label(ax, before, kept, cap, f"L{d.layer}" + (" x" if d.need_recompute else ""), y=y)
            before = d.saved_after[r]
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" + (" (tracked)" if r == sim.tracked_rank else
                                       "\n(busiest other)") for r in reversed(ranks)], fontsize=8)
    ax.set_xlim(0, cap * 1.001)
    _bytes_axis(ax, cap)
    ax.set_xlabel("bytes from the slot base")
    ax.set_title(f"slot 0 after {n} layer forward(s): capacity {_fmt(cap)}; green = full state "
                 "(x_gathered, h1, h3 routes), orange = input x only, replayed in backward",
                 fontsize=9, loc="left")

    # 3. per-layer decisions ---------------------------------------------------------------------
    ax = axes[2]
    xs = range(n)
    cand = [d.candidate_bytes for d in layers]
    res = [d.reserve_bytes for d in layers]
    colors = [REPLAY if d.need_recompute else SAVE for d in layers]
    ax.bar(xs, cand, color=colors, edgecolor="black", linewidth=0.5)
    ax.bar(xs, res, bottom=cand, color="white", edgecolor="black", hatch="..", linewidth=0.5)
    ax.axhline(cap, color="black", linestyle="--", linewidth=1)
    ax.text(-0.45, cap, f"slot capacity {_fmt(cap)}", va="bottom", ha="left", fontsize=8,
            bbox=dict(facecolor="white", edgecolor="none", pad=1))
    top = max(max(a + b for a, b in zip(cand, res)), cap)
    for i, d in enumerate(layers):
        tag = "replay" if d.need_recompute else "save"
        over = "\nOVERFLOW" if d.overflow else ""
        ax.text(i, cand[i] + res[i] + top * 0.01,
                f"{tag}\n{d.multiple:g}x rows{over}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, top * 1.25)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"L{d.layer}\n{d.rows[sim.tracked_rank]:,} rows" for d in layers],
                       fontsize=8)
    _bytes_axis(ax, top * 1.25, "y")
    ax.set_title("save/replay test per layer: max over ranks of (saved + full state) "
                 "+ reserve for the remaining layers' inputs (dotted) vs slot capacity",
                 fontsize=9, loc="left")
    ax.legend(handles=[Patch(color=SAVE, label="keeps full state"),
                       Patch(color=REPLAY, label="keeps x, replays"),
                       Patch(facecolor="white", edgecolor="black", hatch="..",
                             label="remaining-input reserve")],
              fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.93), frameon=False)

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

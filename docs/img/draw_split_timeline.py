"""Draw docs/img/ordered-topic-split.svg: a split of an ordered topic over time.

    python docs/img/draw_split_timeline.py

The picture is a schematic of what OrderedTopic and its consumers do (the timings are
illustrative, not measured): partition 1 is split into 2 and 3; its command message
is its last message; 2 and 3 take new writes at once but are consumed only once the
consumer of 1 has recorded the command; partition 0 never waits. The dots are the
messages of one key, whose logic partition moves from 1 to 3. The output is
deterministic (no date, a fixed hash salt), so it changes only when this script does.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

OUT = Path(__file__).with_name("ordered-topic-split.svg")

SPLIT = 4.0  # the split is proposed, the command message appended
DRAINED = 5.2  # the consumer of 1 has settled everything before the command
RECORDED = 6.2  # ... and the fence has passed: it records the command
END = 10.0

LANES = [  # (y, label, writes from/to, consumed from/to)
    (3, "P0  logic [0, 512)", (0.0, END), (0.0, END)),
    (2, "P1  logic [512, 1024)", (0.0, SPLIT), (0.0, RECORDED)),
    (1, "P2  logic [512, 768)", (SPLIT, END), (RECORDED, END)),
    (0, "P3  logic [768, 1024)", (SPLIT, END), (RECORDED, END)),
]
KEY_PUBLISHED = [(2, 1.0), (2, 2.2), (2, 3.4), (0, 4.4), (0, 5.0), (0, 7.0), (0, 8.6)]
KEY_HANDLED = [(2, 1.3), (2, 2.5), (2, 4.9), (0, 6.4), (0, 6.6), (0, 7.3), (0, 8.9)]

WRITE, READ, HELD, KEY = "#9ecae1", "#3182bd", "#fdd0a2", "#d62728"


def draw() -> None:
    style = {"svg.fonttype": "path", "svg.hashsalt": "ordered-topic-split",
             "font.size": 10}
    with plt.rc_context(style):
        fig, ax = plt.subplots(figsize=(9.0, 3.9), layout="constrained")
        for y, _label, (w0, w1), (r0, r1) in LANES:
            ax.broken_barh([(w0, w1 - w0)], (y + 0.08, 0.34), color=WRITE)
            ax.broken_barh([(r0, r1 - r0)], (y - 0.42, 0.34), color=READ)
            if r0 > w0:  # written to, not yet consumed: held back
                ax.broken_barh([(w0, r0 - w0)], (y - 0.42, 0.34), color=HELD,
                               hatch="//", edgecolor="#e6550d", linewidth=0.6)
        ax.plot([SPLIT], [2.25], marker="D", markersize=9, color="black", zorder=5)
        ax.annotate("command message v2\n(P1's last message)", (SPLIT, 2.25),
                    xytext=(0.6, 1.05), fontsize=9,
                    arrowprops={"arrowstyle": "->", "lw": 0.8})
        ax.annotate("consumer of P1 records it\n(all before it settled, fence passed)",
                    (RECORDED, 1.75), xytext=(RECORDED + 0.45, 1.85), fontsize=9,
                    arrowprops={"arrowstyle": "->", "lw": 0.8})
        for x, text in ((SPLIT, "split: v2 proposed,\npublishers switch"),
                        (RECORDED, "P2, P3 consumed")):
            ax.axvline(x, color="grey", linestyle=":", linewidth=1)
            ax.text(x, 3.62, text, ha="center", va="bottom", fontsize=9)
        ax.axvspan(DRAINED, RECORDED, ymin=0.0, ymax=0.86, color="grey", alpha=0.08)
        ax.text((DRAINED + RECORDED) / 2, -0.58, "fence", ha="center", va="bottom",
                fontsize=8, color="dimgrey")
        pub = [(x, y + 0.25) for y, x in KEY_PUBLISHED]
        got = [(x, y - 0.25) for y, x in KEY_HANDLED]
        ax.scatter(*zip(*pub, strict=True), s=26, marker="o", facecolors="white",
                   edgecolors=KEY, zorder=6)
        ax.scatter(*zip(*got, strict=True), s=26, marker="o", color=KEY, zorder=6)
        ax.set_yticks([y for y, *_ in LANES], [label for _, label, *_ in LANES])
        ax.set_xticks([0, SPLIT, RECORDED, END], ["", "t split", "t recorded", "time"])
        ax.set_xlim(0, END)
        ax.set_ylim(-0.6, 4.2)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.legend(handles=[
            Patch(color=WRITE, label="takes new messages"),
            Patch(color=READ, label="consumed"),
            Patch(facecolor=HELD, edgecolor="#e6550d", hatch="//",
                  label="written, held until P1's command is recorded"),
            plt.Line2D([], [], marker="o", linestyle="", markerfacecolor="white",
                       markeredgecolor=KEY, label="one key's message published"),
            plt.Line2D([], [], marker="o", linestyle="", color=KEY, label="... handled"),
        ], loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=3, frameon=False,
            fontsize=9)
        fig.savefig(OUT, metadata={"Date": None})
        plt.close(fig)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    draw()

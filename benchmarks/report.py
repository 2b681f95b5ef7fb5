"""Collect speed rows into `speed_table.json`, a markdown table and a speedup-vs-N plot against the FLOP bound.

    python benchmarks/report.py benchmarks/results/2026-12-01_speed_report/speed_table.json NEW_RUN/speed_*.json

Later files win for the same (model, mode, P, S, N, wave, offload); each row keeps the file it came from in `source`
(run folder and name; rows of a `speed_table.json` given as input keep theirs, so a new table is the old one plus the
new files). The output goes to a run folder of its own (default `benchmarks/results/<today>_speed_report`):
`speed_table.json`, `.md`, `speedup_vs_n.png` and a generated `MANIFEST.md` (`harness.RunFolder`).
`with cost model` is what PrefixFlowGRPOTrainer runs: PrefixFlow where `hf_prefixflow.planning.flops.MIN_SPEEDUP` says a
group pays, else the plain path, which is the baseline (1.00x).
The plot has a row of panels per model and mode; the paper's eager Llama3-8B points (10k/2k split, H20, TP2 CP4)
are drawn beside the 8B eager ones for reference.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib

import harness
from hf_prefixflow.planning.flops import MIN_SPEEDUP

PAPER_10K_2K = {16: 3.800, 32: 4.115, 128: 4.395}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}_speed_report")
    args = parser.parse_args()

    rows: dict[tuple, dict] = {}
    for name in args.files:
        for row in json.loads(pathlib.Path(name).read_text()):
            key = (row["model"], row["mode"], row["P"], row["S"], row["N"], row.get("wave", 1),
                   row.get("offload", False))
            path = pathlib.Path(name)
            rows[key] = {**row, "source": row.get("source", f"{path.parent.name}/{path.name}")}
    ordered = [rows[k] for k in sorted(rows)]
    for row in ordered:
        row["with_cost_model"] = row["speedup"] if row["flop_bound"] >= MIN_SPEEDUP else 1.0
    lines = ["| model | mode | P / S | N | wave | baseline s | PrefixFlow s | speedup | FLOP bound | share | "
             "with cost model | source |", "| --- " * 12 + "|"]
    lines += [f"| {r['model']}{' +offload' * r.get('offload', False)} | {r['mode']} | {r['P']} / {r['S']} | "
              f"{r['N']} | {r.get('wave', 1)} | "
              f"{r['baseline_s']:.3f} | {r['prefixflow_s']:.3f} | {r['speedup']:.2f}x | {r['flop_bound']:.2f}x | "
              f"{share(r):.1%} | {r['with_cost_model']:.2f}x | {r['source']} |" for r in ordered]
    run = harness.RunFolder("report", args.out, tag="speed_table")
    run.write(ordered, lines)
    plot(ordered, run.path / "speedup_vs_n.png")
    run.attach("speedup_vs_n.png", what="speedup against N, the FLOP bound beside it")


def share(row: dict) -> float:
    """Share of the FLOP bound, from the unrounded times where the row has it."""
    return row.get("share_of_bound", row["speedup"] / row["flop_bound"])


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Speedup against N: a row of panels per model and mode, a panel per split, a line per wave (and offload)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({(r["model"], r["mode"]) for r in rows})
    splits = {kind: sorted({(r["P"], r["S"]) for r in rows if (r["model"], r["mode"]) == kind}, reverse=True)
              for kind in kinds}
    columns = max(len(s) for s in splits.values())
    fig, axes = plt.subplots(len(kinds), columns, figsize=(4.2 * columns, 3.2 * len(kinds)), squeeze=False)
    for axes_row, kind in zip(axes, kinds):
        for ax in axes_row[len(splits[kind]):]:
            ax.set_visible(False)
        for ax, split in zip(axes_row, splits[kind]):
            mine = [r for r in rows if (r["model"], r["mode"], r["P"], r["S"]) == (*kind, *split)]
            for line in sorted({(r.get("wave", 1), r.get("offload", False)) for r in mine}):
                points = sorted((r["N"], r["speedup"]) for r in mine
                                if (r.get("wave", 1), r.get("offload", False)) == line)
                ax.plot(*zip(*points), "o-", label=f"wave {line[0]}" + " +offload" * line[1])
            ax.plot(*zip(*sorted({(r["N"], r["flop_bound"]) for r in mine})), "kx--", label="FLOP bound")
            if split == (10240, 2048) and kind == ("llama3-8b", "eager"):
                ax.plot(list(PAPER_10K_2K), list(PAPER_10K_2K.values()), "s", color="gray", label="paper (H20)")
            ax.axhline(1.0, color="red", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{kind[0]} {kind[1]}, P/S = {split[0]}/{split[1]}", fontsize=9)
            ax.set_xlabel("N")
            ax.set_ylabel("speedup")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()

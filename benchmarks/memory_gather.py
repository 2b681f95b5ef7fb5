"""Gather `benchmarks/memory.py` runs into `benchmarks/results/memory_like_for_like.json`, docs/benchmarks.md's table.

    python benchmarks/memory_gather.py RUN/fixed_replanned.json RUN/frontier.json RUN/frontier_full_kv.json --summary
    python benchmarks/memory_gather.py --from-log RUN/frontier.log --meta commit=abc,cap_gib=24,... --out RUN/x.json

Rows come from the files' fixed rows (later files win for the same model, P, S, policy, offload mode and extra
recompute); the frontier searches from every file's `frontier` list. Each row gets the frontier of the proportional
search at its own P/S, policy, offload mode and extra recompute, where one was run: the longest trainable P + S of
PrefixFlow from the latest file that searched it, of the baseline the longest any file found (the ratio never
flatters PrefixFlow). Every row and search keeps the file it came from in `source`. `--summary` also prints the
docs/benchmarks.md's memory summary.

`--from-log` rebuilds the frontier searches of a `memory.py` run whose report was never written (its command's time
limit stopped it mid-search) from the trials its log printed; `--meta` supplies what the log does not say (commit,
cap_gib, resolution, gpu, scoring, proportions), and a search cut short says so in its `stop`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

FIELDS = ("model", "P", "S", "N", "policy", "offload", "offload_kv", "scoring", "extra_recompute", "baseline_peak_gib",
          "prefixflow_phase_b_peak_gib", "prefixflow_phase_a_peak_gib", "prefixflow_phase_c_peak_gib",
          "plan_phase_b_peak_gib", "plan_phase_b_error", "phase_b_reduction", "baseline_time_s", "prefixflow_time_s",
          "time_ratio", "error", "gpu", "commit")


def mode(row: dict) -> str:
    return "kv" if row.get("offload_kv") else "on" if row["offload"] else "off"


SEARCH_LINE = re.compile(r"frontier (\w+) (\w+) (baseline|prefixflow) offload=(\w+): planner predicts (\d+)")
TRIAL_LINE = re.compile(r"\]\s+(\d+): (.+) \(([\d.]+) s\)$")


def searches_from_log(path: pathlib.Path, meta: dict) -> list[dict]:
    """The frontier searches a `memory.py` log printed, one row per PrefixFlow search paired with the baseline
    search before it (`memory.py`'s order)."""
    searches, current = [], None
    for line in path.read_text().splitlines():
        if (found := SEARCH_LINE.search(line)):
            kind, policy, side, offload, predicted = found.groups()
            current = {"kind": kind, "policy": policy, "side": side, "offload": offload, "predicted": int(predicted),
                       "trials": []}
            searches.append(current)
        elif current is not None and (found := TRIAL_LINE.search(line)):
            total, reason, seconds = found.groups()
            current["trials"].append({"total": int(total), "trains": reason == "trains", "reason": reason,
                                      "seconds": float(seconds)})
    rows, baseline = [], None
    for search in searches:
        trains = [t["total"] for t in search["trials"] if t["trains"]]
        fails = [t["total"] for t in search["trials"] if not t["trains"]]
        result = {"longest_trains": max(trains, default=0), "shortest_fails": min(fails, default=None),
                  "stop": "resolution" if fails and trains and min(fails) - max(trains) <= int(meta["resolution"])
                  else "cut short (the log ends)", "trials": search["trials"], "predicted": search["predicted"]}
        if search["side"] == "baseline":
            baseline = result
            continue
        rows.append({"model": meta["model"], "search": search["kind"], "proportions": meta["proportions"],
                     "fixed_S": None, "policy": search["policy"], "offload": search["offload"] != "off",
                     "offload_kv": search["offload"] == "kv", "scoring": meta.get("scoring", "fused"),
                     "extra_recompute": meta.get("extra_recompute", "none"), "rows": 1,
                     "cap_gib": float(meta["cap_gib"]), "resolution": int(meta["resolution"]), "gpu": meta["gpu"],
                     "commit": meta["commit"], "baseline_frontier_tokens": baseline["longest_trains"],
                     "prefixflow_frontier_tokens": result["longest_trains"],
                     "frontier_ratio": round(result["longest_trains"] / baseline["longest_trains"], 3)
                     if baseline["longest_trains"] else None, "error": None,
                     "plan_baseline_frontier_tokens": baseline["predicted"],
                     "plan_prefixflow_frontier_tokens": result["predicted"], "baseline_search": baseline,
                     "prefixflow_search": result, "source": path.name})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path,
                        default=pathlib.Path("benchmarks/results/memory_like_for_like.json"))
    parser.add_argument("--summary", action="store_true", help="also print docs/benchmarks.md's memory summary")
    parser.add_argument("--from-log", type=pathlib.Path, default=None, help="a memory.py log to rebuild searches from")
    parser.add_argument("--meta", default="", help="KEY=VALUE,... for --from-log: model, proportions, cap_gib, "
                                                   "resolution, gpu, commit (scoring, extra_recompute optional)")
    args = parser.parse_args()
    if args.from_log is not None:
        meta = dict(item.split("=", 1) for item in filter(None, args.meta.split(",")))
        args.out.write_text(json.dumps({"frontier": searches_from_log(args.from_log, meta)}, indent=1))
        print(f"searches of {args.from_log} -> {args.out}")
        return
    rows, searches = {}, []
    for path in args.files:
        report = json.loads(path.read_text())
        source = f"{path.parent.name}/{path.name}"
        for row in report.get("rows", []):
            rows[row["model"], row["P"], row["S"], row["policy"], mode(row), row.get("extra_recompute")] = {
                **{k: row.get(k) for k in FIELDS}, "source": source}
        searches += [{**search, "source": source} for search in report.get("frontier", [])]
    frontiers: dict[tuple, dict] = {}
    for search in searches:
        if search["search"] != "proportional" or not search["prefixflow_frontier_tokens"]:
            continue
        key = (search["model"], search["proportions"], search["policy"], mode(search), search.get("extra_recompute"))
        best = frontiers.get(key, {})
        frontiers[key] = {
            "baseline_frontier_tokens": max(best.get("baseline_frontier_tokens", 0),
                                            search["baseline_frontier_tokens"]),
            "prefixflow_frontier_tokens": search["prefixflow_frontier_tokens"],
            "frontier_stop": search["prefixflow_search"]["stop"], "frontier_cap_gib": search["cap_gib"],
            "frontier_source": ", ".join(dict.fromkeys(filter(None, [best.get("frontier_source"), search["source"]])))}
    table = []
    for (model, p, s, policy, offload, recompute), row in rows.items():
        found = frontiers.get((model, f"{p}/{s}", policy, offload, recompute))
        frontier = {"baseline_frontier_tokens": None, "prefixflow_frontier_tokens": None, "frontier_ratio": None}
        if found:
            frontier = {**found, "frontier_ratio": round(found["prefixflow_frontier_tokens"]
                                                         / found["baseline_frontier_tokens"], 3)}
        table.append({**row, **frontier})
    args.out.write_text(json.dumps({"sources": [str(p) for p in args.files], "rows": table, "frontier": searches},
                                   indent=1))
    print(f"{len(table)} rows, {len(searches)} searches -> {args.out}")
    if args.summary:
        print(summary_table(table))


# docs/benchmarks.md's memory summary: (model, policy, offload mode, extra recompute) at 10k/2k, N=16.
SUMMARY_ROWS = (("qwen3-1.7b", "none", "on", "prefix layers (share 1)"), ("qwen3-1.7b", "none", "on", "none"),
                ("qwen3-1.7b", "none", "kv", "prefix layers (share 1)"), ("qwen3-1.7b", "full", "off", "none"),
                ("qwen3-1.7b", "full", "on", "none"), ("qwen3-1.7b", "full", "kv", "none"),
                ("qwen3-1.7b", "selective", "off", "none"), ("qwen3-1.7b", "selective", "kv", "none"),
                ("llama3-8b", "none", "kv", "prefix layers (share 1)"), ("llama3-8b", "full", "off", "none"),
                ("llama3-8b", "full", "kv", "none"))
MODELS = {"qwen3-1.7b": "Qwen3-1.7B", "llama3-8b": "Llama3-8B"}
OFFLOAD = {"off": "prompt on the device", "on": "`offload`", "kv": "`offload_kv`"}


def summary_table(rows: list[dict]) -> str:
    """docs/benchmarks.md's memory summary, rendered from the gathered rows (tests/test_readme.py checks the page
    holds it): PrefixFlow's settings above the baseline's peak included."""
    lines = ["| shape, checkpointing (both sides) | PrefixFlow | Phase-B peak GiB | longest P + S | step time |",
             "| --- | --- | --- | --- | --- |"]
    for model, policy, offload, recompute in SUMMARY_ROWS:
        row = next(r for r in rows if (r["model"], r["P"], r["S"], r["policy"], mode(r), r["extra_recompute"])
                   == (model, 10240, 2048, policy, offload, recompute))
        extra = "" if recompute == "none" else ", prompt recomputed"
        frontier = "-" if row["frontier_ratio"] is None else f"{row['frontier_ratio']:.2f}x"
        if row.get("frontier_stop") not in (None, "resolution"):  # the longest it trained before it stopped
            frontier = f">= {frontier}"
        lines.append(f"| {MODELS[model]}, {policy} | {OFFLOAD[offload]}{extra} | {row['baseline_peak_gib']:.1f} -> "
                     f"{row['prefixflow_phase_b_peak_gib']:.1f} ({-row['phase_b_reduction']:+.0%}) | {frontier} | "
                     f"{row['time_ratio']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Gather `benchmarks/memory.py` runs into the table the README reads: `benchmarks/results/memory_like_for_like.json`.

    python benchmarks/memory_gather.py RUN/fixed_replanned.json RUN/frontier.json RUN/frontier_full_kv.json

Rows come from the files' fixed rows (later files win for the same model, P, S, policy and offload mode); the
frontier searches from every file's `frontier` list. Each row gets the frontier of the proportional search at its
own P/S, policy and offload mode, where one was run: the longest trainable P + S of PrefixFlow from the latest file
that searched it, of the baseline the longest any file found (the ratio never flatters PrefixFlow). Every row and
search keeps the file it came from in `source`.
"""

from __future__ import annotations

import argparse
import json
import pathlib

FIELDS = ("model", "P", "S", "N", "policy", "offload", "offload_kv", "scoring", "extra_recompute", "baseline_peak_gib",
          "prefixflow_phase_b_peak_gib", "prefixflow_phase_a_peak_gib", "prefixflow_phase_c_peak_gib",
          "plan_phase_b_peak_gib", "plan_phase_b_error", "phase_b_reduction", "baseline_time_s", "prefixflow_time_s",
          "time_ratio", "gpu", "commit")


def mode(row: dict) -> str:
    return "kv" if row.get("offload_kv") else "on" if row["offload"] else "off"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/memory_like_for_like.json"))
    args = parser.parse_args()
    rows, searches = {}, []
    for path in args.files:
        report = json.loads(path.read_text())
        source = f"{path.parent.name}/{path.name}"
        for row in report.get("rows", []):
            rows[row["model"], row["P"], row["S"], row["policy"], mode(row)] = {
                **{k: row.get(k) for k in FIELDS}, "source": source}
        searches += [{**search, "source": source} for search in report.get("frontier", [])]
    frontiers: dict[tuple, dict] = {}
    for search in searches:
        if search["search"] != "proportional" or not search["prefixflow_frontier_tokens"]:
            continue
        key = (search["model"], search["proportions"], search["policy"], mode(search))
        best = frontiers.get(key, {})
        frontiers[key] = {
            "baseline_frontier_tokens": max(best.get("baseline_frontier_tokens", 0), search["baseline_frontier_tokens"]),
            "prefixflow_frontier_tokens": search["prefixflow_frontier_tokens"],
            "frontier_stop": search["prefixflow_search"]["stop"], "frontier_cap_gib": search["cap_gib"],
            "frontier_source": ", ".join(dict.fromkeys(filter(None, [best.get("frontier_source"), search["source"]])))}
    table = []
    for (model, p, s, policy, offload), row in rows.items():
        found = frontiers.get((model, f"{p}/{s}", policy, offload))
        frontier = {"baseline_frontier_tokens": None, "prefixflow_frontier_tokens": None, "frontier_ratio": None}
        if found:
            frontier = {**found, "frontier_ratio": round(found["prefixflow_frontier_tokens"]
                                                         / found["baseline_frontier_tokens"], 3)}
        table.append({**row, **frontier})
    args.out.write_text(json.dumps({"sources": [str(p) for p in args.files], "rows": table, "frontier": searches},
                                   indent=1))
    print(f"{len(table)} rows, {len(searches)} searches -> {args.out}")


if __name__ == "__main__":
    main()

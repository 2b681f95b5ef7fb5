"""The main job and the walkthrough notebook run end to end (reduced sizes)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import grpo_long_prefix  # noqa: E402
import quickstart  # noqa: E402
from launcher import torchrun  # noqa: E402


def test_quickstart_gradients_agree():
    assert quickstart.main(["--prefix", "64", "--suffix", "12", "--n", "4", "--wave", "3"]) < 1e-5


def test_pipeline_example_gradients_agree():
    result = torchrun("../examples/pipeline_parallel.py", "--prefix", "64", "--suffix", "12", "--completions", "4",
                      "--microbatches", "2", "--steps", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    differences = [float(d) for d in re.findall(r"max relative difference (\S+)", result.stdout)]
    assert len(differences) == 2 and max(differences) < 1e-5
    assert len(re.findall(r"^step \d: loss", result.stdout, re.M)) == 2


def test_grpo_long_prefix_trains_both_trainers_identically(tmp_path):
    results = grpo_long_prefix.main(["--steps", "3", "--passages", "12", "--hidden", "32", "--layers", "2",
                                     "--out", str(tmp_path)])
    assert (tmp_path / "curves.png").stat().st_size > 0
    stock, prefixflow = results["stock"], results["prefixflow"]
    assert len(stock) == len(prefixflow) == 3
    for s, p in zip(stock, prefixflow):
        assert s["reward"] == p["reward"]
        assert abs(s["loss"] - p["loss"]) <= 1e-4 + 1e-3 * abs(s["loss"])
        assert p["prefixflow/prefix_ratio"] > 0.8 and p["update_s"] > 0 and p["step_s"] >= p["update_s"]


def test_trainer_step_benchmark_runs_on_the_cpu(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import trainer_step

    rows = trainer_step.main(["--tiny", "--batches", "2", "--steps", "1", "--out", str(tmp_path)])
    assert len(rows) == 1 and rows[0]["stock_s"] > 0 and rows[0]["prefixflow_s"] > 0
    # The default memory rule: at this size a merged run's fused-head tile outgrows the stock microbatch.
    assert rows[0]["run_microbatches"] == 1 == rows[0]["prefixflow_settings"]["merge_cap"]
    assert rows[0]["flop_ratio"] > 1 and rows[0]["amdahl_cap"] > 1 and len(rows[0]["offload_modes"]) == 1
    assert "| tiny | 152 / 8.0 | 4 | 2 | on | fixed |" in (tmp_path / "trainer_step.md").read_text()


def test_walkthrough_notebook_executes(tmp_path):
    notebook = nbformat.read(ROOT / "notebooks" / "prefixflow_grpo_walkthrough.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("agree at every step" in o.get("text", "") for o in outputs)


def test_memory_benchmark_and_its_gather_run_on_the_cpu(tmp_path):
    """memory.py --tiny: every policy and offload mode, PrefixFlow's gradients those of the baseline (fp32) and
    offload_kv's those of offload bit for bit; memory_gather.py pairs each row with its frontier, the baseline's
    longest over the runs."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'benchmarks'}{os.pathsep}{ROOT}"}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--tiny", "--sections", "fixed",
                    "--out", str(tmp_path)], check=True, env=env, capture_output=True)
    report = json.loads((tmp_path / "memory_like_for_like.json").read_text())
    rows = report["rows"]
    assert {(r["policy"], r["offload"], r["offload_kv"]) for r in rows} == {
        (p, o, k) for p in ("none", "full", "selective") for o, k in ((False, False), (True, False), (True, True))}
    assert all(not r["error"] and r["max_gradient_difference"] < 1e-4 for r in rows)
    assert report["verdicts"]["kv_vs_on_max_difference"] == report["verdicts"]["on_vs_on_max_difference"] == 0.0
    search = {"model": "tiny", "search": "proportional", "proportions": "80/16", "policy": "full", "offload": True,
              "offload_kv": True, "extra_recompute": "none",
              "cap_gib": 1.0, "prefixflow_search": {"stop": "resolution"}}
    runs = [{"frontier": [{**search, "baseline_frontier_tokens": 100, "prefixflow_frontier_tokens": 150}]},
            {"frontier": [{**search, "baseline_frontier_tokens": 90, "prefixflow_frontier_tokens": 190}]}]
    for i, run in enumerate(runs):
        (tmp_path / f"frontier{i}.json").write_text(json.dumps(run))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_gather.py"),
                    str(tmp_path / "memory_like_for_like.json"), str(tmp_path / "frontier0.json"),
                    str(tmp_path / "frontier1.json"), "--out", str(tmp_path / "gathered.json")], check=True, env=env)
    gathered = {(r["P"], r["policy"], r["offload"], r["offload_kv"]): r
                for r in json.loads((tmp_path / "gathered.json").read_text())["rows"]}
    row = gathered[80, "full", True, True]
    assert (row["baseline_frontier_tokens"], row["prefixflow_frontier_tokens"]) == (100, 190)
    assert row["frontier_ratio"] == 1.9
    assert gathered[80, "full", True, False]["frontier_ratio"] is None
    log = tmp_path / "cut.log"  # a run stopped mid-search: its log's trials are all there is
    log.write_text("[ 1.0s] frontier proportional full baseline offload=off: planner predicts 96\n"
                   "[ 2.0s]   96: trains (0.5 s)\n[ 3.0s]   112: out of memory (0.4 s)\n"
                   "[ 4.0s] frontier proportional full prefixflow offload=kv: planner predicts 160\n"
                   "[ 5.0s]   160: trains (0.9 s)\n[ 6.0s]   192: out of memory (0.9 s)\n")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_gather.py"), "--from-log", str(log), "--meta",
                    "model=tiny,proportions=80/16,cap_gib=1,resolution=16,gpu=cpu,commit=x",
                    "--out", str(tmp_path / "cut.json")], check=True, env=env)
    (search,) = json.loads((tmp_path / "cut.json").read_text())["frontier"]
    assert (search["baseline_frontier_tokens"], search["prefixflow_frontier_tokens"], search["offload_kv"]) == (
        96, 160, True)
    assert search["prefixflow_search"]["stop"] == "cut short (the log ends)"

"""`python -m benchmarks`: one entry point that lists every measurement and runs the one named; the harness they
share (benchmarks/harness.py) and each measurement's writer, on fake rows."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def benchmarks(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_help_lists_every_measurement_and_the_readme_names_each():
    listed = benchmarks("--help")
    assert listed.returncode == 0
    names = [line.split()[0] for line in listed.stdout.splitlines()[2:] if line.strip()]
    scripts = {p.stem for pattern in ("*.py", "*.sh") for p in (ROOT / "benchmarks").glob(pattern)}
    assert set(names) == scripts - {"__main__", "harness", "criterion", "multi_gpu_worker"}
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert [name for name in names if f"`{name}`" not in readme] == []


def test_runs_the_named_measurement_with_its_arguments():
    ran = benchmarks("dpo_step", "--help")
    assert ran.returncode == 0 and "--splits" in ran.stdout


def test_an_unknown_name_is_refused_with_the_list():
    ran = benchmarks("no_such_measurement")
    assert ran.returncode == 2 and "trainer_step" in ran.stderr


# -- the shared harness and each measurement's writer, with fake rows (the measurements themselves need a GPU) -----

sys.path.insert(0, str(ROOT / "benchmarks"))
import harness  # noqa: E402


def test_run_folder_writes_rows_table_and_a_manifest_section_per_stem(tmp_path):
    rows = harness.RunFolder("speed", tmp_path, argv=["--n", "4"])
    rows.write([{"a": 1}, {"a": 2}], ["| a |", "| --- |"])
    report = harness.RunFolder("speed", tmp_path, tag="speed_report", argv=[])
    report.write({"config": {}, "rows": []}, ["text"], title="A report")
    report.attach("extra.txt", "kernels\n", "the kernels")
    assert json.loads((tmp_path / "speed.json").read_text()) == [{"a": 1}, {"a": 2}]
    first, _, *table = (tmp_path / "speed.md").read_text().splitlines()
    assert first.startswith("`python -m benchmarks speed --n 4`; ") and table == ["| a |", "| --- |"]
    assert (tmp_path / "speed_report.md").read_text().startswith("# A report\n\n`python -m benchmarks speed`; ")
    manifest = (tmp_path / "MANIFEST.md").read_text()
    assert manifest.startswith(harness.GENERATED) and manifest.count("\n## ") == 2
    assert "`speed.json` (2 rows), `speed.md` (the table)" in manifest
    assert "`speed_report.json` (the report), `speed_report.md` (the table), `extra.txt` (the kernels)" in manifest
    (tmp_path / "MANIFEST.md").write_text("# written by hand\n")
    rows.write([], None)  # no table: no markdown; a hand-written manifest is left alone
    assert (tmp_path / "MANIFEST.md").read_text() == "# written by hand\n"


def test_timing_on_the_cpu():
    calls = []
    median, peak, retries = harness.timed(lambda: calls.append("timed"), 3, lambda: calls.append("warm"))
    assert calls == ["warm"] + ["timed"] * 3 and median >= 0 and peak is None and retries == 0
    assert harness.median_seconds(lambda: calls.append("x"), repeats=2, warmup=2) >= 0 and calls.count("x") == 4
    env = harness.environment(gpu="test")
    assert env["gpu"] == "test" and {"commit", "date", "python", "torch", "transformers"} <= set(env)


def test_prefix_grouper_step_replaces_a_row_of_the_same_setting(tmp_path):
    import prefix_grouper_step as pg

    row = {"model": "m", "P": 8, "S": [4, 4], "N": 2, "wave": 1, "checkpointing": "on", "flop_ratio": 1.5,
           **{f"{side}_s": 1.0 for side in pg.SIDES}, **{f"{side}_peak_gib": None for side in pg.SIDES},
           **{f"{side}_{k}": 1.0 for side in pg.SIDES[1:] for k in ("speedup", "share_of_flop_ratio")}}
    (tmp_path / "prefix_grouper_step.json").write_text(json.dumps([{**row, "P": 4, "device": "CPU"}, row]))
    pg.write([{**row, "gpu": "cpu"}], harness.RunFolder("prefix_grouper_step", tmp_path, argv=[]))
    assert [r["P"] for r in json.loads((tmp_path / "prefix_grouper_step.json").read_text())] == [4, 8]
    table = (tmp_path / "prefix_grouper_step.md").read_text()
    assert "| m | 4 / 4 | 2 | on |" in table and table.rstrip().endswith("| cpu |") and "| CPU |" in table


def test_prefix_grouper_step_records_a_side_out_of_memory(tmp_path, monkeypatch):
    """A side that runs out of device memory is listed and shown as OOM; the other sides are still measured."""
    import argparse

    import prefix_grouper_step as pg

    def measure(model, run, repeats):
        if run is oom:
            raise torch.OutOfMemoryError("out of memory")
        return 2.0, None

    oom = object()
    monkeypatch.setattr(pg, "measure", measure)
    monkeypatch.setattr(pg, "sides", lambda *a: {"full": None, "prefix_grouper": oom, "prefixflow": None})
    model = pg.build_tiny(True)
    args = argparse.Namespace(tiny=False, model="m", wave=1, checkpointing="on", repeats=1)
    row = pg.row(args, model, torch.arange(8), [torch.arange(4)] * 2, {"gpu": "cpu"})
    assert row["out_of_memory"] == ["prefix_grouper"] and row["prefix_grouper_speedup"] is None
    assert row["prefixflow_speedup"] == 1.0
    pg.write([row], harness.RunFolder("prefix_grouper_step", tmp_path, argv=[]))
    assert "| 2.000 | OOM | 2.000 | OOM | 1.00x |" in (tmp_path / "prefix_grouper_step.md").read_text()


def test_dpo_step_runs_the_trainers_of_its_order(monkeypatch):
    """`--order` runs the named trainers in that order, one alone where one is named (a clean peak per process);
    each side records what it found allocated before building its model."""
    import argparse

    import dpo_step
    from hf_prefixflow.planning.flops import ModelShape

    ran = []

    def run(name, prompt, response, args):
        ran.append(name)
        shape = ModelShape(layers=1, hidden=8, attention_width=8, layer_weights=256, vocab=32)
        return {"steps": [1.0], "warmup_steps": [2.0], "peak_gib": 3.0, "resident_before_gib": 0.5,
                "fallback_pairs": 0, "losses": [0.69], "shape": shape}

    monkeypatch.setattr(dpo_step, "run", run)
    args = argparse.Namespace(tiny=True, lora=False, batch=1, config={}, prefixflow_config={},
                              stock_compile_layers=False, warmup=1, steps=1, order="prefixflow,stock")
    row = dpo_step.measure(16, 4, args, {})
    assert ran == ["prefixflow", "stock"] and row["speedup"] == 1.0 and row["stock_resident_before_gib"] == 0.5
    ran.clear()
    row = dpo_step.measure(16, 4, argparse.Namespace(**{**vars(args), "order": "prefixflow"}), {})
    assert ran == ["prefixflow"] and "speedup" not in row and row["prefixflow_peak_gib"] == 3.0


def test_writers_of_the_gpu_measurements(tmp_path):
    import argparse

    import attention_kernels
    import gpu_equivalence
    import gpu_pipeline
    import memory
    import memory_trace
    import speed

    speed_row = {"P": 8, "S": 4, "N": 2, "wave": 1, "baseline_s": 2.0, "prefixflow_s": 1.0, "speedup": 2.0,
                 "flop_bound": 2.5, "share_of_bound": 0.8, "baseline_peak_gib": 3.0, "prefixflow_peak_gib": 2.0,
                 "baseline_alloc_retries": 0, "prefixflow_alloc_retries": 1}
    assert speed.table([speed_row])[-1] == ("| 8 / 4 | 2 | 1 | 2.000 | 1.000 | 2.00x | 2.50x | 80.0% | 3.0 / 2.0 "
                                            "| 0 / 1 |")
    meta = {"P": 8, "S": 4, "heads": 2, "kv_heads": 1, "dim": 4}
    assert attention_kernels.table(meta, [{"case": "a", "ms": 1.5, "tflops": 9.0}])[-1] == "| a | 1.5 | 9.0 |"

    args = argparse.Namespace(prefix=8, head_dim=4, suffix=4, n=2, wave=1, steps=2, lr=0.1, tag="eq")
    failed = {"path": "p", "layout": "padded", "variant": "correct", "passed": False, "error": "E: x",
              "verdict": "ERROR"}
    run = harness.RunFolder("gpu_equivalence", tmp_path / "eq", "eq", [])
    assert not gpu_equivalence.write(run, args, [failed], [])  # a correct row that erred: not as required
    assert (tmp_path / "eq" / "eq.md").read_text().startswith("# bf16 equivalence on ")

    timing = {"baseline": {"times_s": [2.0], "median_s": 2.0, "peak_gib_max_stage": 1.0},
              "prefixflow_wave1": {"times_s": [1.0], "median_s": 1.0, "peak_gib_max_stage": 1.0}}
    pipeline_meta = {"stages": 2, "gpu": "cpu", "precision": "fp32", "lr": 0.3, "speed_setting": "tiny",
                     "flop_bound": 2.0}
    run = harness.RunFolder("gpu_pipeline", tmp_path / "pp", argv=[], command="torchrun benchmarks/gpu_pipeline.py")
    gpu_pipeline.report(run, pipeline_meta, [], timing)
    assert set(json.loads((tmp_path / "pp" / "gpu_pipeline.json").read_text())) >= {"stages", "equivalence", "speed"}
    assert "prefixflow_wave1 2.00x" in (tmp_path / "pp" / "gpu_pipeline.md").read_text()

    config = {"command": "python benchmarks/memory.py; replanned: x", "gpu": "g", "torch": "t", "transformers": "tf",
              "date": "d", "commit": "c", "rows": 1, "dtype": "bfloat16", "timed_split": "8/4"}
    memory.write({"config": config, "rows": [], "frontier": []}, harness.RunFolder("memory", tmp_path / "m", "mem", []))
    text = (tmp_path / "m" / "mem.md").read_text()
    assert "Measured by `python benchmarks/memory.py` on g" in text and "verdicts" in json.loads(
        (tmp_path / "m" / "mem.json").read_text())

    trace = memory_trace.report("P=8", 1.0, 2**29, {"a.py:1:f": 2**29})
    memory_trace.write([trace], argparse.Namespace(sp=False, out=tmp_path / "t"))
    assert json.loads((tmp_path / "t" / "memory_trace.json").read_text())[0]["top"] == [{"where": "a.py:1:f",
                                                                                         "gib": 0.5}]


def test_one_triton_config_keeps_four_warps_and_fewest_stages():
    """`harness.pick_config`, what `--one-config` keeps of each autotuned kernel's list."""
    config = lambda warps, stages, **kw: SimpleNamespace(num_warps=warps, num_stages=stages, kwargs=kw)
    listed = [config(2, 2, BV=32), config(4, 3, BV=32), config(4, 2, BV=64), config(8, 1)]
    assert harness.pick_config(listed) is listed[2]
    assert harness.pick_config(listed[:1] + listed[3:]) is listed[0]  # no four-warp entry: the first


def test_traced_step_finds_the_steps_largest_live_set():
    """`trainer_step --memory-trace`'s callback on a stand-in allocator history: the peak of the traced step counts
    what was allocated before it, split by allocating frame."""
    import trainer_step

    frame = lambda name: [{"filename": f"/x/{name}.py", "line": 1, "name": name}]
    events = [{"action": "alloc", "addr": 1, "size": 100, "frames": frame("weights")}]
    memory = SimpleNamespace(_record_memory_history=lambda **kw: None,
                             _snapshot=lambda: {"device_traces": [list(events)]})
    step = trainer_step.TracedStep(skip=1, memory=memory)
    step.on_step_begin(None, SimpleNamespace(global_step=1), None)
    events += [{"action": "alloc", "addr": 2, "size": 50, "frames": frame("wave")},
               {"action": "free_requested", "addr": 2, "size": 50},
               {"action": "alloc", "addr": 3, "size": 80, "frames": frame("phase_c")},
               {"action": "alloc", "addr": 4, "size": 10, "frames": frame("phase_c")},
               {"action": "free_requested", "addr": 3, "size": 80}]
    step.on_step_end(None, SimpleNamespace(global_step=2), None)
    assert step.peak_bytes == 190 and step.start is None
    assert step.split == {"weights.py:1:weights": 100, "phase_c.py:1:phase_c": 90}


def test_dpo_criterion_passes_correct_steps_and_fails_a_broken_one(tmp_path):
    """The DPO bf16 criterion on the CPU (bf16 autocast, fp64 reference): the control row decides nothing, a
    correct step passes at the first and the last check, Phase C skipped fails."""
    import dpo_criterion

    # short pairs: bf16 matmuls in the backward are slow on a CPU (tenths of a second each at this width)
    good = dpo_criterion.main(["--tiny", "--cases", "full", "--broken", "phase-c-skipped", "--steps", "2",
                               "--prompt", "24", "--response", "8", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "dpo_criterion.json").read_text())
    assert good and [(r["variant"], r["step"], r["passed"]) for r in rows] == [
        ("control", 1, None), ("correct", 1, True), ("correct", 2, True), ("phase-c-skipped", 1, False),
        ("phase-c-skipped", 2, False)]
    assert all(r["fallback_rows"] == 0 for r in rows)


def test_dpo_step_profiles_each_trainer(tmp_path):
    import dpo_step

    assert dpo_step.main(["--tiny", "--profile", "--splits", "48/6", "--out", str(tmp_path)]) == []
    report = json.loads((tmp_path / "dpo_step_profile.json").read_text())
    phases = {(r["trainer"], r["phase"]) for r in report["phases"]}
    assert {("stock", "step"), ("prefixflow", "phase_a"), ("prefixflow", "phase_c")} <= phases
    assert all(any("self_host_ms" in op for op in ops) for ops in report["top_ops"].values())


def test_stock_compile_layers_compiles_each_decoder_layer():
    import trainer_step
    from hf_prefixflow import _compat
    from hf_prefixflow.core.recompute import decoder_layers

    sys.path.insert(0, str(ROOT / "examples"))
    import synthetic

    model = synthetic.make_model(synthetic.make_tokenizer(), layers=3)
    trainer_step.compile_layers(model)
    assert [_compat.is_compiled(layer) for layer in decoder_layers(model)] == [True] * 3


def test_dpo_frontier_stops_each_trainer_at_its_first_out_of_memory(tmp_path, monkeypatch):
    import argparse

    import dpo_step

    fits = {"stock": 2048, "prefixflow": 4096}
    monkeypatch.setattr(dpo_step, "run", lambda name, prompt, response, args: (
        {"peak_gib": 1.0} if prompt <= fits[name] else None))
    args = argparse.Namespace(tiny=True, lora=True, model="m", order="stock,prefixflow", frontier_cap_gib=20.0)
    run = harness.RunFolder("dpo_step", tmp_path, tag="dpo_frontier", argv=[])
    trials = dpo_step.frontier([(8192, 64), (1024, 64), (2048, 64), (4096, 64)], args, run)
    assert [(t["trainer"], t["P"], t["trained"]) for t in trials] == [
        ("stock", 1024, True), ("stock", 2048, True), ("stock", 4096, False),
        ("prefixflow", 1024, True), ("prefixflow", 2048, True), ("prefixflow", 4096, True),
        ("prefixflow", 8192, False)]
    report = json.loads((tmp_path / "dpo_frontier.json").read_text())
    assert report["longest_prompt"] == fits and report["frontier_ratio"] == 2.0

"""CI runs exactly the README's install, example and test commands; README and docs link only to existing files; the
README's memory table is rendered from the results; the README's code runs as written (on a CPU, no download) and its
low-level snippet trains exactly; the trainers' import names the `trl` extra when it is missing."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from equivalence import assert_same_gradients, gradients

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "results" / "README.md",
         ROOT / "benchmarks" / "results" / "latest.md"]


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\s+```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip()]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert len(commands) == 3
    positions = [ci.index(command) for command in commands]
    assert positions == sorted(positions)


def test_the_readme_is_a_front_door():
    # Room for two snippets that run as written; the rest belongs in docs/.
    assert len((ROOT / "README.md").read_text().splitlines()) <= 175


def test_links_point_to_files_that_exist():
    missing = []
    for page in PAGES:
        text = page.read_text()
        targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
        for target in targets:
            path = target.split("#")[0]
            if path and "://" not in path and not (page.parent / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing


def test_the_memory_summary_reads_from_the_results():
    """docs/benchmarks.md's memory summary is the one `benchmarks/memory_gather.py` renders from
    memory_like_for_like.json."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import memory_gather
    finally:
        sys.path.pop(0)
    rows = json.loads((ROOT / "benchmarks" / "results" / "memory_like_for_like.json").read_text())["rows"]
    assert memory_gather.summary_table(rows) in (ROOT / "docs" / "benchmarks.md").read_text()


def range_of(values: list[float], digits: int = 2) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def test_the_results_table_reads_from_its_runs():
    """Every speedup and peak of the README's results table is the range over the two device calls' files."""
    runs = ROOT / "benchmarks" / "results" / "2026-12-05_default_swap"
    calls = {name: [json.loads((runs / f"{name}_call{c}.json").read_text()) for c in (1, 2)]
             for name in ("memory_grid", "rloo_step", "dpo_step")}
    readme = (ROOT / "README.md").read_text()
    figures = []
    for name, (first, second) in calls.items():
        for a, b in zip(first, second):
            if a.get("fallback_pairs"):  # DPO 4,096/512 ran every pair on the plain path: not quoted
                continue
            figures.append(range_of([a["speedup"], b["speedup"]]) + "x")
            if name == "dpo_step":  # PrefixFlow ran second in its process there: its peak is quoted from a clean run
                continue
            stock, pf = a.get("peak_gib_stock", a.get("stock_peak_gib")), a.get("peak_gib_prefixflow",
                                                                                a.get("prefixflow_peak_gib"))
            figures.append(f"{stock} -> {pf}")
    assert [f for f in figures if f not in readme] == []


def test_the_single_gpu_rows_read_from_their_runs():
    """The README's H100 rows (compiled layers, on one side and on both; DPO at 4,096/512 and DPO's clean peaks;
    Qwen3.5 steps, Nemotron-H steps): each speedup is the range of stock / PrefixFlow seconds over the calls'
    files, each Nemotron-H time the range of its seconds."""
    results = ROOT / "benchmarks" / "results"

    def rows(*paths: str) -> list[dict]:
        return [row for path in paths for row in json.loads((results / path).read_text())]

    def speedups(found: list[dict], **match) -> str:
        chosen = [r for r in found if all(r.get(k) == v for k, v in match.items())]
        return range_of([r["stock_s"] / r["prefixflow_s"] for r in chosen]) + "x"

    compiled = rows("2026-12-05_compiled_step/compiled_call1.json", "2026-12-05_compiled_step/compiled_call2.json")
    eager = rows("2026-12-05_compiled_step/eager_call2.json")
    dpo = rows(*(f"2026-12-05_dpo_trainer_order/{name}.json" for name in
                 ("stock_first_call1", "prefixflow_first_call2", "prefixflow_first_call3")))
    qwen35 = rows("2026-12-05_qwen3_5_fla/trainer_step_call1.json", "2026-12-05_qwen3_5_fla/trainer_step_call2.json",
                  "2026-12-05_qwen3_5_memory_trace/trainer_step_call3.json")
    nemotron = rows("2026-12-05_nemotron_h_step/trainer_step_call1.json",
                    "2026-12-05_nemotron_h_step/trainer_step_call2.json")
    clean = [(rows(f"2026-12-06_dpo_clean_peaks/stock_call{c}.json")[0],
              rows(f"2026-12-06_dpo_clean_peaks/prefixflow_call{c}.json")[0]) for c in (1, 2)]
    both = rows("2026-12-06_compiled_both_sides/trainer_step.json")
    figures = [f"{speedups(compiled, batch=4)} / {speedups(compiled, batch=16)}",
               range_of([s["stock_s"] / p["prefixflow_s"] for s, p in clean]) + "x",
               f"{clean[0][0]['stock_peak_gib']} -> {clean[0][1]['prefixflow_peak_gib']} GiB",
               f"{speedups(both, batch=4)} / {speedups(both, batch=16)}",
               f"{speedups(eager, batch=4)} / {speedups(eager, batch=16)}",
               speedups(dpo, P=4096),
               f"{speedups(qwen35, batch=4)} / {speedups(qwen35, batch=16)}",
               *(range_of([r["prefixflow_s"] for r in nemotron if r["batch"] == b]) + " s" for b in (4, 16))]
    readme = (ROOT / "README.md").read_text()
    assert [f for f in figures if f not in readme] == []


def readme_snippet(section: str) -> str:
    """The first Python block under the README's `## section` heading."""
    readme = (ROOT / "README.md").read_text()
    return re.search(rf"^## {re.escape(section)}\n.*?```python\n(.*?)```", readme, re.S | re.M).group(1)


def test_the_swap_snippet_trains_on_a_cpu(tmp_path, monkeypatch):
    """The README's trainer snippet as written, from a folder that holds the repository's examples/ (as the root
    does): it builds its offline model and data, and PrefixFlowGRPOTrainer trains shared groups."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the snippet prepends examples/
    namespace = {}
    exec(compile(readme_snippet("Swap one class"), "README.md: Swap one class", "exec"), namespace)
    state = namespace["trainer"].state
    assert state.global_step == 2
    metrics = state.log_history[-1]  # TRL's logging_steps exceed the run: the end-of-training averages
    assert metrics["prefixflow/groups"] >= 1 and "prefixflow/fallback_rows" not in metrics


def full_sequence_gradients(model, prompt_ids, completion_ids, completion_mask, masked: bool) -> dict:
    """The reference: each `[P || S_i]` as its own right-padded row through the same model, the same loss."""
    model.zero_grad()
    n, p = completion_ids.shape[0], prompt_ids.shape[0]
    ids = torch.cat([prompt_ids.expand(n, -1), completion_ids], dim=1)  # [N, P + S]
    mask = torch.cat([torch.ones(n, p, dtype=completion_mask.dtype), completion_mask], dim=1)
    logits = model(ids, attention_mask=mask).logits[:, p - 1:-1]  # position p - 1 + t predicts completion token t
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), completion_ids, reduction="none")
    ((nll * completion_mask if masked else nll).sum() / completion_mask.sum()).backward()
    return gradients(model)


def run_low_level_snippet(code: str) -> dict:
    """The README's low-level snippet in float64 (its tiny model is built under the default dtype)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        namespace = {}
        exec(compile(code, "README.md: The low-level API", "exec"), namespace)
    finally:
        torch.set_default_dtype(default)
    return namespace


def test_the_low_level_snippet_equals_full_sequence_training():
    namespace = run_low_level_snippet(readme_snippet("The low-level API"))
    model = namespace["model"]
    assert next(model.parameters()).dtype == torch.float64
    got = gradients(model)
    expected = full_sequence_gradients(model, namespace["prompt_ids"], namespace["completion_ids"],
                                       namespace["completion_mask"], masked=True)
    assert_same_gradients(got, expected)


def test_a_loss_over_padded_positions_is_not_full_sequence_training():
    """Broken variant: the same unmasked loss on both sides still differs (padded positions' logits in a wave are
    not those of the full sequence), which is why the README's and docs' loss must leave padding out."""
    code = readme_snippet("The low-level API")
    masked_loss = "(nll * completion_mask[rows]).sum()"
    assert masked_loss in code
    namespace = run_low_level_snippet(code.replace(masked_loss, "nll.sum()"))
    model = namespace["model"]
    got = gradients(model)
    expected = full_sequence_gradients(model, namespace["prompt_ids"], namespace["completion_ids"],
                                       namespace["completion_mask"], masked=False)
    with pytest.raises(AssertionError, match="max error"):
        assert_same_gradients(got, expected)


def trainer_import_error(monkeypatch, missing: str, trainer: str = "PrefixFlowGRPOTrainer") -> pytest.ExceptionInfo:
    """`from hf_prefixflow import <trainer>` with `missing` made unimportable (None in sys.modules) and the trainer
    modules unloaded, so the lazy import runs again."""
    import hf_prefixflow.trainers.dpo  # noqa: F401  (loaded, so that monkeypatch puts them back afterwards)
    import hf_prefixflow.trainers.grpo  # noqa: F401

    for name in [name for name in sys.modules if name.startswith("hf_prefixflow.trainers")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(ImportError) as caught:
        exec(f"from hf_prefixflow import {trainer}", {})
    return caught


@pytest.mark.parametrize("trainer", ["PrefixFlowGRPOTrainer", "PrefixFlowGRPOConfig", "PrefixFlowDPOTrainer"])
def test_the_trainers_name_the_trl_extra_when_trl_is_missing(monkeypatch, trainer):
    caught = trainer_import_error(monkeypatch, "trl", trainer)
    assert str(caught.value).startswith(f"hf_prefixflow.{trainer} needs TRL")
    assert 'pip install "hf-prefixflow[trl]"' in str(caught.value) and "'trl'" in str(caught.value)
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_an_unrelated_missing_module_is_not_blamed_on_the_extra(monkeypatch):
    caught = trainer_import_error(monkeypatch, "hf_prefixflow.trainers.routing")
    assert caught.type is ModuleNotFoundError and "hf-prefixflow[trl]" not in str(caught.value)


def test_the_trainers_name_the_trl_extra_when_accelerate_is_missing():
    """The case users meet: accelerate absent from the start (transformers then never loads it), in a fresh
    interpreter."""
    code = ("import sys\nsys.modules['accelerate'] = None\nimport hf_prefixflow\n"
            "try:\n    from hf_prefixflow import PrefixFlowGRPOTrainer\n"
            "except ImportError as error:\n    print(type(error).__name__, error)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ImportError ") and "'accelerate'" in out.stdout
    assert 'pip install "hf-prefixflow[trl]"' in out.stdout

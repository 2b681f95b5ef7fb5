"""Multi-GPU equivalence and SP capacity, in one command (2 GPUs, NCCL; `--tiny` runs the same control flow on the CPU).

    python benchmarks/multi_gpu_suite.py --out $OUT                 # 2 GPUs
    python benchmarks/multi_gpu_suite.py --out /tmp/mgs --tiny      # CPU, gloo, tiny model, steps 1,2,3

Equivalence (like the paper's Table 3): the same random-init Qwen3-architecture model (4 layers, hidden 512, 8 query /
4 KV heads, vocab 2048, untied), the same prompts (1024-1536 tokens), the same frozen rollouts (completions up to 128
tokens, N=4; they depend only on the prompt, its copy number and the step, so every engine trains on identical rows),
the same hyperparameters (AdamW lr 1e-5, constant schedule, no weight decay, no gradient clipping so that the
gradients read before the step are what the optimizer uses, loss_type TRL's default dapo), 8 rows (2 prompts) per
optimizer step in 2 microbatches per process, TRL's row shuffle and PrefixFlow's group shuffle off (as in
tests/ddp_worker.py), so the global batch and the split into microbatches match across engines:

- baseline: stock `GRPOTrainer`, one process on one GPU, full sequences, per-device batch 4, grad accumulation 2;
- zero2 / zero3: `PrefixFlowGRPOTrainer` under DeepSpeed ZeRO-2 / ZeRO-3 on 2 GPUs, per-device batch 2, accumulation 2;
- sp2: `PrefixFlowGRPOTrainer` with prefixflow_sp_size=2 on 2 GPUs (TRL stays data parallel over both processes, each
  with per-device batch 2; the SP pair pools its rows and runs them sharded);
- controls, if time remains: stock `GRPOTrainer` under ZeRO-2, ZeRO-3 and DDP on 2 GPUs (what the engine alone moves).

`bf16=True` in the config means: baseline, sp2, stock-ddp: Accelerate's bf16 autocast over fp32 weights; ZeRO:
DeepSpeed's bf16 mode (bf16 weights, activations and gradients in the engine, fp32 master weights in the optimizer),
so ZeRO rows also carry the engine's precision (the stock-zero controls measure that part alone). Compared at the
record steps (default 1, 10, 20), element-wise with |x-y| <= 1e-3 + 1e-2 max(|x|,|y|): the step's loss, every
parameter's full gradient before the optimizer step, every weight after it (fp32 master weights under ZeRO).

SP capacity: the Qwen3-1.7B shape (bf16 weights and grads, non-reentrant checkpointing, fwd+bwd, no optimizer, N=4
completions of 256 tokens), every GPU capped with set_per_process_memory_fraction (--cap-gib, default 20 GiB, to keep
the bracketing short). GPU 0 alone brackets the longest prompt the one-GPU full-sequence baseline fits (doubling from
16k, then bisecting to 8k; OOMs are caught; a probe runs one `[P || S]` row, whose peak is the group's since TRL
runs rows one after another). Both GPUs then run the whole group, in one wave, with Ulysses SP=2 PrefixFlow
(low-level API, prefix offload on: each rank's checkpointed layer inputs wait on the host during Phase B) at the first
length that OOMed the baseline; if that fails, at halved lengths towards the longest that trains. Each SP length
runs in a launch of its own, ended by a timeout if a rank runs out of memory inside a collective (its peer would
wait forever). Reported: time, tokens/s (baseline: P + S; SP group: P + N*S) and peak memory per GPU, and whether
SP=2 trained where the baseline OOMed.

Writes `multi_gpu_suite.json` and `.md` under --out after every run (a run cut by --deadline-s keeps what finished),
plus each run's log under `logs/`. Large snapshots stay in a scratch directory (--scratch, default a temp dir).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
TOLERANCE = "|x-y| <= 1e-3 + 1e-2*max(|x|,|y|)"


def free_port() -> int:  # as tests/launcher.py (benchmarks do not import from tests/)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def violation(x: torch.Tensor, y: torch.Tensor) -> float:
    """max over elements of |x-y| / (1e-3 + 1e-2 max(|x|,|y|)); <= 1 passes."""
    x, y = x.double(), y.double()
    return ((x - y).abs() / (1e-3 + 1e-2 * torch.maximum(x.abs(), y.abs()))).max().item()


def compare(candidate: dict, baseline: dict) -> dict:
    row = {"L": abs(candidate["loss"] - baseline["loss"]),
           "L_ratio": violation(torch.tensor(candidate["loss"]), torch.tensor(baseline["loss"])),
           "loss": candidate["loss"], "baseline_loss": baseline["loss"]}
    for key, what in (("G", "grads"), ("W", "weights")):
        a, b = candidate[what], baseline[what]
        if a is None or b is None:
            row[key], row[key + "_ratio"], row[key + "_worst_param"] = None, None, "not captured"
            continue
        if a.keys() != b.keys():
            raise ValueError(f"{what}: parameter names differ: {sorted(a.keys() ^ b.keys())[:5]}")
        missing = [n for n in a if a[n] is None or b[n] is None]
        diffs = {n: ((a[n] - b[n]).abs().max().item(), violation(a[n], b[n])) for n in a if n not in missing}
        worst = max(diffs, key=lambda n: diffs[n][1])
        row[key] = max(d for d, _ in diffs.values())
        row[key + "_ratio"], row[key + "_worst_param"] = diffs[worst][1], worst
        if missing:
            row[key + "_missing"] = missing
    ratios = [row[k] for k in ("L_ratio", "G_ratio", "W_ratio") if row[k] is not None]
    row["worst_ratio"] = max(ratios)
    row["passed"] = all(r <= 1.0 for r in ratios) and len(ratios) == 3
    return row


class Suite:
    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        self.out = pathlib.Path(args.out)
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.scratch = pathlib.Path(args.scratch or tempfile.mkdtemp(prefix="multi_gpu_suite_"))
        self.scratch.mkdir(parents=True, exist_ok=True)
        tiny = args.tiny
        self.steps = [int(s) for s in (args.steps or ("1,2,3" if tiny else "1,10,20")).split(",")]
        self.train_cfg = dict(
            tiny=tiny, steps=self.steps, seed=0, n=4, global_rows=8, gas=2, lr=args.lr, optim=args.optim,
            vocab=256 if tiny else 2048, hidden=32 if tiny else 512, intermediate=64 if tiny else 1536,
            layers=2 if tiny else 4, heads=4 if tiny else 8, kv_heads=2 if tiny else 4,
            prompt=[40, 60] if tiny else [1024, 1536], completion=8 if tiny else 128,
            init_std=0.2 if tiny else None)
        self.capacity_cfg = dict(
            tiny=tiny, shape="tiny" if tiny else args.capacity_shape, n=2 if tiny else 4, suffix=8 if tiny else 256,
            cap_gib=args.cap_gib, start_prefix=64 if tiny else 16384, max_prefix=1 << 12 if tiny else 1 << 20,
            precision_tokens=32 if tiny else 8192, granularity=8 if tiny else 1024, tiny_oom_tokens=300,
            collective_timeout_s=120, offload=True, sp_timeout_s=60 if tiny else 150, reserve_s=5 if tiny else 25)
        self.result = {
            "suite": "benchmarks/multi_gpu_suite.py", "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "tolerance": TOLERANCE, "record_steps": self.steps, "train_config": self.train_cfg,
            "capacity_config": self.capacity_cfg, "env": env(tiny), "runs": {}, "equivalence": [], "capacity": None,
            "skipped": []}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def launch(self, name: str, nproc: int, *worker_args: str, timeout: float) -> dict:
        path = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
        env_vars = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"}
        if not self.args.tiny:
            env_vars["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(nproc))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), str(HERE / "multi_gpu_worker.py"), *worker_args]
        start = time.monotonic()
        log = self.out / "logs" / f"{name}.log"
        logs = [tempfile.TemporaryFile("w+") for _ in range(2)]  # files, not pipes: a stray rank cannot block reading
        proc = subprocess.Popen(cmd, env=env_vars, stdout=logs[0], stderr=logs[1], text=True, cwd=ROOT)
        try:
            rc = proc.wait(timeout=timeout)
            note = ""
        except subprocess.TimeoutExpired:
            stop(proc)
            rc, note = "timeout", f"\n[timed out after {timeout:.0f} s]"
        stdout, stderr = (f.seek(0) or f.read() for f in logs)
        for f in logs:
            f.close()
        text = stdout + "\n--- stderr ---\n" + stderr + note
        log.write_text(text)
        run = {"rc": rc, "wall_s": round(time.monotonic() - start, 1), "log": f"logs/{name}.log"}
        if rc != 0:
            run["error_tail"] = text[-1500:]
        run["completed"] = rc == 0
        for line in text.splitlines():
            if line.startswith("{") and '"engine"' in line:
                run.update(json.loads(line))
                run["completed"] = True  # rank 0 finished training and wrote its snapshots (rc may still be a teardown crash)
        if run.get("gpu") and "gpus" not in self.result["env"]:
            self.result["env"]["gpus"] = [run["gpu"]] * torch.cuda.device_count()
        print(f"[{self.elapsed():6.1f}s] {name}: rc={rc} in {run['wall_s']} s", flush=True)
        self.result["runs"][name] = run
        return run

    def budget(self, name: str) -> float | None:
        """Seconds this run may take, or None (skipped) once the deadline has passed."""
        left = self.args.deadline_s - self.elapsed()
        if left <= 0:
            self.result["skipped"].append(name)
            print(f"[{self.elapsed():6.1f}s] {name}: skipped (deadline {self.args.deadline_s} s passed)", flush=True)
            self.write()
            return None
        return max(20.0, left + self.args.grace_s)

    def train(self, engine: str, nproc: int) -> None:
        timeout = self.budget(engine)
        if timeout is None:
            return
        cfg = json.dumps(self.train_cfg)
        run = self.launch(engine, nproc, "train", engine, str(self.scratch), cfg, timeout=timeout)
        if engine != "baseline":
            for step in self.steps:
                row = {"engine": engine, "step": step}
                try:
                    row.update(compare(torch.load(self.scratch / f"{engine}_step{step}.pt"),
                                       torch.load(self.scratch / f"baseline_step{step}.pt")))
                except FileNotFoundError as exc:
                    row.update({"passed": False, "error": f"missing snapshot {pathlib.Path(exc.filename).name} "
                                                          f"(run rc={run['rc']})"})
                except Exception as exc:  # reported, not hidden
                    row.update({"passed": False, "error": f"{type(exc).__name__}: {exc}"[:400]})
                self.result["equivalence"].append(row)
                print(json.dumps(row), flush=True)
        self.write()

    def capacity(self) -> None:
        """The baseline's bracket in one process, then SP=2 at the length that OOMed it, each SP length in a launch
        of its own: a rank out of memory inside a collective hangs its peer, which only a timeout ends. If SP=2
        fails there too, halve towards the longest length it trains (what it holds per GPU, for the record)."""
        cfg = self.capacity_cfg
        result = self._capacity_stage("capacity-baseline", 1, {"stage": "baseline"})
        self.result["capacity"] = result
        if "error" in result:
            return self.write()
        fits, fails = result["baseline_largest_fitting_P"], result["baseline_smallest_oom_P"]
        target = fails or (2 * fits if fits else cfg["start_prefix"])
        result["sp2_target_P"], result["sp2_runs"] = target, []
        low, high, length = 0, None, target
        while length and self.budget("capacity-sp2") is not None:
            row = self._capacity_stage(f"capacity-sp2-{length}", 2, {"stage": "sp2", "P": length, "repeats": 2})
            row = row.get("sp2") or {"P": length, "ok": False, "error": row.get("error", "no result")}
            result["sp2_runs"].append(row)
            low, high = (length, high) if row["ok"] else (low, length)
            if row["ok"] or high - low <= cfg["precision_tokens"]:
                break
            length = (low + high) // 2 // cfg["granularity"] * cfg["granularity"]
        result["sp2_largest_fitting_P"] = low or None
        result["sp2_trains_where_baseline_ooms"] = bool(fails) and low >= fails
        self.write()

    def _capacity_stage(self, name: str, nproc: int, stage: dict) -> dict:
        timeout = self.budget(name)
        if timeout is None:
            return {"error": "deadline passed"}
        path = self.scratch / f"{name}.json"
        cfg = {**self.capacity_cfg, **stage, "budget_s": min(self.args.capacity_budget_s, timeout - 30)}
        if stage["stage"] == "sp2":
            timeout = min(timeout, cfg["sp_timeout_s"])
        run = self.launch(name, nproc, "capacity", "-", str(path), json.dumps(cfg), timeout=timeout)
        if path.exists():
            return json.loads(path.read_text())
        return {"error": "out of memory in a collective, or out of time (timed out)" if run["rc"] == "timeout"
                else f"rc={run['rc']}"}

    def write(self) -> None:
        self.result["elapsed_s"] = round(self.elapsed(), 1)
        (self.out / "multi_gpu_suite.json").write_text(json.dumps(self.result, indent=1))
        (self.out / "multi_gpu_suite.md").write_text(markdown(self.result))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its ranks in sessions of their own), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(proc: subprocess.Popen) -> None:
    """End a timed-out torchrun and the ranks it started (only those): SIGTERM, which torchrun forwards, then
    SIGKILL for whatever is left after 10 s."""
    ranks = descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def env(tiny: bool) -> dict:
    from importlib import metadata

    info = {"torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "device": "cpu (gloo)" if tiny else "cuda (nccl)"}
    for module in ("transformers", "trl", "accelerate", "deepspeed", "peft"):
        try:
            info[module] = metadata.version(module)
        except Exception as exc:  # noqa: BLE001
            info[module] = f"unavailable: {type(exc).__name__}"
    return info


def _f(x, fmt=".1e") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(r: dict) -> str:
    e, c = r["env"], r["train_config"]
    lines = [f"# Multi-GPU equivalence and SP capacity ({e.get('gpus', [e['device']])[0]}, torch {e['torch']}, "
             f"transformers {e['transformers']}, {e['date']})", "",
             f"`{r['command']}` — {r['elapsed_s']} s. Qwen3 shape: {c['layers']} layers, hidden {c['hidden']}, "
             f"{c['heads']}/{c['kv_heads']} heads, vocab {c['vocab']}; prompts {c['prompt'][0]}-{c['prompt'][1]} "
             f"tokens, completions up to {c['completion']}, N={c['n']}, {c['global_rows']} rows per step in "
             f"{c['gas']} microbatches per process; {c['optim']} lr {c['lr']:g}, no clipping. Baseline: stock "
             "GRPOTrainer on one GPU, full sequences. Cells: max |difference| of gradients / loss / weights "
             f"(G / L / W) against the baseline; ratio: the worst element's |x-y| over the tolerance {TOLERANCE} "
             "(<= 1 passes).", "",
             "| engine | " + " | ".join(f"step {s} G / L / W" for s in r["record_steps"])
             + " | worst ratio (G, L, W) | pass |",
             "| --- | " + " | ".join("---" for _ in r["record_steps"]) + " | --- | --- |"]
    engines = list(dict.fromkeys(row["engine"] for row in r["equivalence"]))
    for engine in engines:
        rows = {row["step"]: row for row in r["equivalence"] if row["engine"] == engine}
        cells, worst, passed = [], {"G": 0.0, "L": 0.0, "W": 0.0}, True
        for step in r["record_steps"]:
            row = rows.get(step)
            if row is None or "error" in row:
                cells.append("error" if row else "-")
                passed = False
                continue
            cells.append(f"{_f(row['G'])} / {_f(row['L'])} / {_f(row['W'])}")
            for k in worst:
                if row.get(k + "_ratio") is not None:
                    worst[k] = max(worst[k], row[k + "_ratio"])
            passed = passed and row["passed"]
        lines.append(f"| {engine} | " + " | ".join(cells)
                     + f" | {worst['G']:.3g}, {worst['L']:.3g}, {worst['W']:.3g} | {'yes' if passed else 'NO'} |")
    errors = [f"- {row['engine']} step {row['step']}: {row['error']}" for row in r["equivalence"] if "error" in row]
    failed = [f"- {name}: rc={run['rc']} ({run['log']})" + (" after training completed (teardown)" if run.get("completed")
                                                          else "") for name, run in r["runs"].items() if run["rc"] != 0]
    if errors or failed:
        lines += ["", "Errors:", *failed, *errors]
    if r["skipped"]:
        lines += ["", f"Skipped (deadline): {', '.join(r['skipped'])}"]
    cap = r.get("capacity")
    if cap:
        lines += ["", "## SP=2 capacity", ""]
        if "error" in cap:
            lines.append(f"capacity run failed: {cap['error']}")
        else:
            lines.append(f"{cap['shape']} shape, {cap['precision']}, {cap['checkpointing']} checkpointing, N={cap['N']} "
                         f"completions of {cap['S']} tokens, memory cap: {cap['cap_gib']} GiB per GPU "
                         f"({cap['memory_cap']}).")
            lines += ["", "| run | P | result | s | tokens/s | peak GiB (per GPU) |", "| --- | --- | --- | --- | --- | --- |"]
            for p in cap["baseline_probes"]:
                lines.append(f"| 1 GPU full sequence, one row | {p['P']} | {'fits' if p['ok'] else 'OOM'} | {p.get('s', '-')} | "
                             f"{p.get('tokens_per_s', '-')} | {p.get('peak_gib', '-')} |")
            for p in cap.get("sp2_runs", []):
                result = "fits" if p.get("ok") else p.get("error", "OOM")
                lines.append(f"| **SP=2**, whole group | {p['P']} | {result} | {p.get('s', '-')} | "
                             f"{p.get('tokens_per_s', '-')} | {p.get('peak_gib_per_gpu', p.get('peak_gib', '-'))} |")
            lines += ["", f"Baseline: largest fitting P {cap.get('baseline_largest_fitting_P')}, smallest OOM P "
                          f"{cap.get('baseline_smallest_oom_P')}. SP=2: largest fitting P {cap.get('sp2_largest_fitting_P')}; "
                          f"trains where the baseline OOMs: {cap.get('sp2_trains_where_baseline_ooms')}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU, gloo, tiny model, fp32, steps 1,2,3")
    parser.add_argument("--deadline-s", type=float, default=200.0,
                        help="launch no new run after this many seconds (results are written after every run)")
    parser.add_argument("--grace-s", type=float, default=40.0, help="a run may outlive the deadline by this much")
    parser.add_argument("--steps", default=None, help="record steps (default 1,10,20; --tiny: 1,2,3)")
    parser.add_argument("--engines", default="zero2,zero3,sp2",
                        help="after the baseline, in order: zero2, zero3, sp2 (controls come after the capacity run)")
    parser.add_argument("--controls", default="stock-zero2,stock-zero3,stock-ddp")
    parser.add_argument("--optim", default="adamw_torch", help="HF optim name; 'sgd' adds momentum 0.9")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--no-capacity", action="store_true")
    parser.add_argument("--capacity-shape", default="qwen3-1.7b")
    parser.add_argument("--cap-gib", type=float, default=20.0, help="memory cap per GPU for the capacity bracketing")
    parser.add_argument("--capacity-budget-s", type=float, default=75.0)
    parser.add_argument("--scratch", default=None, help="where the (large) per-step snapshots go")
    args = parser.parse_args()

    suite = Suite(args)
    suite.write()
    engines, controls = (list(filter(None, names.split(","))) for names in (args.engines, args.controls))
    if engines or controls:
        suite.train("baseline", 1)
    for engine in engines:
        suite.train(engine, 2)
    if not args.no_capacity:
        suite.capacity()
    for engine in controls:
        suite.train(engine, 2)
    suite.write()
    print((suite.out / "multi_gpu_suite.md").read_text())


if __name__ == "__main__":
    main()

"""Multi-GPU equivalence and SP capacity, in one command (2 GPUs, NCCL; `--tiny` runs the same control flow on the CPU).

    python benchmarks/multi_gpu_suite.py --out $OUT                 # 2 GPUs
    python benchmarks/multi_gpu_suite.py --out /tmp/mgs --tiny      # CPU, gloo, tiny model, steps 1,2,3

Equivalence (like the paper's Table 3): the same random-init Qwen3-architecture model (4 layers, hidden 512, 8 query /
4 KV heads, vocab 2048, untied), the same prompts (1024-1536 tokens), the same frozen rollouts (completions up to 128
tokens, N=4; they depend only on the prompt, its copy number and the step, so every engine trains on identical rows),
the same hyperparameters (plain SGD by default, constant schedule, no weight decay, no gradient clipping so that the
gradients read before the step are what the optimizer uses, loss_type TRL's default dapo), 8 rows (2 prompts) per
optimizer step in 2 microbatches per process, TRL's row shuffle and PrefixFlow's group shuffle off (as in
tests/ddp_worker.py), so the global batch and the split into microbatches match across engines:

- baseline: stock `GRPOTrainer`, one process on one GPU, full sequences, per-device batch 4, grad accumulation 2;
- ddp / zero2 / zero3 / fsdp2: `PrefixFlowGRPOTrainer` under plain DDP, DeepSpeed ZeRO-2 / ZeRO-3 or FSDP2 (through
  Accelerate) on 2 GPUs, per-device batch 2, accumulation 2;
- sp2: `PrefixFlowGRPOTrainer` with prefixflow_sp_size=2 on 2 GPUs (TRL stays data parallel over both processes, each
  with per-device batch 2; the SP pair pools its rows and runs them sharded);
- `--broken`: `ddp` with a broken variant of `criterion.variant` patched in, each of which must fail;
- controls, if time remains: stock `GRPOTrainer` under DDP, ZeRO-2, ZeRO-3 and FSDP2 on 2 GPUs (what the engine alone
  moves).

`bf16=True` in the config means: baseline, ddp, sp2: Accelerate's bf16 autocast over fp32 weights; ZeRO: DeepSpeed's
bf16 mode (bf16 weights, activations and gradients in the engine, fp32 master weights in the optimizer); FSDP2:
Accelerate's mixed-precision policy (bf16 compute weights). `--tiny` trains in fp32 throughout.

Primary criterion (`benchmarks/criterion.py`) at the record steps (default 1, 10, 20): per parameter, the engine's
full gradient before the optimizer step, its error against the fp64 full-sequence gradient over the one-GPU
baseline's error against it, at most 1.2 for the worst parameter. The fp64 gradients come from one more process
after the training runs: stock TRL's loss, no autocast, over the baseline's microbatches of the step (as the
baseline's trainer scaled them), at each engine's own weights before the step (the engines' weights part by their
accumulated rounding after step 1, and a reference at the baseline's weights would count that drift as the engine's
error). Where the engine's stock control ran (ZeRO's bf16 mode and FSDP2's mixed precision are not the baseline's
autocast), a parameter's baseline error is the larger of the baseline's and the control's: stock TRL under the same
engine is a valid bf16 full-sequence computation too. The controls themselves are judged against the baseline
alone, for the record. Secondary, reported only: the step's loss, every gradient and every weight after the step
(fp32 master weights under ZeRO) against the baseline's, element-wise with |x-y| <= 1e-3 + 1e-2 max(|x|,|y|).

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

Writes `multi_gpu_suite.json`, `.md` and a generated `MANIFEST.md` under --out after every run (`harness.RunFolder`;
a run cut by --deadline-s keeps what finished; the fp64 reference run comes last whatever the deadline, within
--reference-s), plus each run's log under `logs/`.
Large snapshots stay in a scratch directory (--scratch, default a temp dir). Exits with 1 unless every engine passed
at every record step and every broken variant failed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

import criterion
import harness

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
CONTROL_OF = {"ddp": "stock-ddp", "sp2": "stock-ddp", "zero2": "stock-zero2", "zero3": "stock-zero3",
              "fsdp2": "stock-fsdp2"}


def free_port() -> int:  # as tests/launcher.py (benchmarks do not import from tests/)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def compare(engine: str, step: int, load) -> dict:
    """The primary criterion and the paper's tolerance for `engine` at `step`; `load(name)` reads a scratch file."""
    candidate, baseline = load(f"{engine}_step{step}.pt"), load(f"baseline_step{step}.pt")
    reference = load(f"reference_baseline_step{step}.pt")
    candidate_reference = load(f"reference_{engine}_step{step}.pt")
    if candidate["grads"].keys() != baseline["grads"].keys():
        raise ValueError(f"parameter names differ: {sorted(candidate['grads'].keys() ^ baseline['grads'].keys())[:5]}")
    control = CONTROL_OF.get(engine.partition(":")[0])
    controls, control_used = (), None
    try:
        controls = ((load(f"{control}_step{step}.pt")["grads"], load(f"reference_{control}_step{step}.pt")),)
        control_used = control
    except FileNotFoundError:
        pass
    row = {**criterion.judge(candidate["grads"], baseline["grads"], reference, candidate_reference,
                             controls=controls), "control": control_used}
    paper = criterion.paper_violation
    row["paper"] = {"L": paper(candidate["loss"], baseline["loss"]),
                    "G": max(paper(a, baseline["grads"][n]) for n, a in candidate["grads"].items()
                             if a is not None and baseline["grads"][n] is not None),
                    "W": max(paper(a, baseline["weights"][n]) for n, a in candidate["weights"].items())}
    row.update(loss=candidate["loss"], baseline_loss=baseline["loss"])
    before, base_before = candidate["weights_before"], baseline["weights_before"]
    row["drifted_apart"] = (sum((before[n].double() - w.double()).pow(2).sum() for n, w in base_before.items())
                            / sum(w.double().pow(2).sum() for w in base_before.values())).sqrt().item()
    if engine.startswith("stock"):
        row["passed"] = None  # a control: how far stock TRL under this engine is from the one-GPU baseline
    return row


class Suite:
    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        device = "cpu (gloo)" if args.tiny else "cuda (nccl)"  # the GPU's name once a rank reports it
        self.run = harness.RunFolder("multi_gpu_suite", args.out, gpu=device)  # CUDA stays untouched in this process
        self.run.files["logs/"] = "each run's output"
        self.out = self.run.path
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.scratch = pathlib.Path(args.scratch or tempfile.mkdtemp(prefix="multi_gpu_suite_"))
        self.scratch.mkdir(parents=True, exist_ok=True)
        tiny = args.tiny
        self.steps = [int(s) for s in (args.steps or ("1,2,3" if tiny else "1,10,20")).split(",")]
        self.train_cfg = dict(
            tiny=tiny, steps=self.steps, seed=0, n=4, global_rows=8, gas=2, lr=args.lr, optim=args.optim,
            # --tiny is narrow in depth, not width: narrow norm weights scatter the criterion's ratio between steps
            vocab=256 if tiny else 2048, hidden=512, intermediate=128 if tiny else 1536, layers=2 if tiny else 4,
            heads=8, kv_heads=4, prompt=[40, 60] if tiny else [1024, 1536], completion=8 if tiny else 128)
        self.capacity_cfg = dict(
            tiny=tiny, shape="tiny" if tiny else args.capacity_shape, n=2 if tiny else 4, suffix=8 if tiny else 256,
            cap_gib=args.cap_gib, start_prefix=64 if tiny else 16384, max_prefix=1 << 12 if tiny else 1 << 20,
            precision_tokens=32 if tiny else 8192, granularity=8 if tiny else 1024, tiny_oom_tokens=300,
            collective_timeout_s=120, offload=True, sp_timeout_s=60 if tiny else 150, reserve_s=5 if tiny else 25)
        self.result = {
            "suite": "benchmarks/multi_gpu_suite.py", "command": self.run.command,
            "criterion": f"worst parameter's gradient error ratio to the baseline's <= {criterion.LIMIT}",
            "tolerance": criterion.PAPER, "record_steps": self.steps, "train_config": self.train_cfg,
            "capacity_config": self.capacity_cfg, "env": {**self.run.environment, "device": device}, "runs": {},
            "equivalence": [], "capacity": None,
            "skipped": []}
        self.trained: list[str] = []

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
                run["completed"] = True  # rank 0 finished and wrote its snapshots (rc may be a teardown crash)
        if run.get("gpu") and "gpus" not in self.result["env"]:
            self.result["env"]["gpus"] = [run["gpu"]] * torch.cuda.device_count()
            self.result["env"]["gpu"] = self.run.environment["gpu"] = run["gpu"]
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
        self.launch(engine, nproc, "train", engine, str(self.scratch), json.dumps(self.train_cfg), timeout=timeout)
        self.trained.append(engine)
        self.write()

    def reference(self) -> None:
        """The fp64 gradients at every engine's weights, then every engine's comparison (whatever the deadline)."""
        self.launch("reference", 1, "reference", "-", str(self.scratch), json.dumps(self.train_cfg),
                    timeout=self.args.reference_s)
        load = lambda name: torch.load(self.scratch / name, weights_only=False)  # noqa: E731
        for engine in self.trained:
            if engine == "baseline":
                continue
            broken = engine.partition(":")[2] in criterion.BROKEN
            for step in self.steps:
                row = {"engine": engine, "step": step}
                try:
                    row.update(compare(engine, step, load))
                except Exception as exc:  # a missing snapshot or reference is reported, not hidden
                    rc = self.result["runs"].get(engine, {}).get("rc")
                    row.update(passed=False, error=f"{type(exc).__name__}: {exc} (run rc={rc})"[:400])
                row["verdict"] = criterion.verdict(row["passed"], broken, row.get("error"))
                self.result["equivalence"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "ratios"}), flush=True)
        self.write()

    def as_required(self) -> bool:
        rows = self.result["equivalence"]
        return bool(rows) and all(criterion.as_expected(r, r["engine"].partition(":")[2] in criterion.BROKEN)
                                  for r in rows)

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
        self.result["as_required"] = self.as_required()
        self.run.write(self.result, markdown(self.result), title="Multi-GPU equivalence and SP capacity")


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


def markdown(r: dict) -> list[str]:
    """The report's tables (the run folder's header line names the command and the environment)."""
    c = r["train_config"]
    lines = [f"Wall time {r['elapsed_s']} s. Qwen3 shape: {c['layers']} layers, hidden {c['hidden']}, "
             f"{c['heads']}/{c['kv_heads']} heads, vocab {c['vocab']}; prompts {c['prompt'][0]}-{c['prompt'][1]} "
             f"tokens, completions up to {c['completion']}, N={c['n']}, {c['global_rows']} rows per step in "
             f"{c['gas']} microbatches per process; {c['optim']} lr {c['lr']:g}, no clipping. Baseline: stock "
             "GRPOTrainer on one GPU, full sequences. Primary, per record step: per parameter, the engine's gradient "
             "error against the fp64 full-sequence gradient at its own weights over the baseline's (or, where the "
             "engine's stock control ran, the larger of the two valid bf16 errors), worst parameter at most "
             f"{criterion.LIMIT}; median beside it; drifted apart: the engine's weights before the step against the "
             "baseline's, relative distance. Controls (stock TRL) are judged for the record. Secondary "
             f"(reported only): the paper's {criterion.PAPER} on the loss / gradients / weights, worst ratio.", "",
             "| engine | step | worst ratio (parameter) | median ratio | denominator | drifted apart | paper L / G / W "
             "| verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    ratio = criterion.format_ratio
    for row in r["equivalence"]:
        if "error" in row:
            lines.append(f"| {row['engine']} | {row['step']} | {row['error'][:100]} | - | - | - | - | "
                         f"{row['verdict']} |")
            continue
        paper = row["paper"]
        lines.append(f"| {row['engine']} | {row['step']} | {ratio(row['worst_ratio'])} ({row['worst_param']}) | "
                     f"{ratio(row['median_ratio'])} | baseline{' + ' + row['control'] if row['control'] else ''} | "
                     f"{row['drifted_apart']:.1e} | {paper['L']:.3f} / {paper['G']:.3f} / {paper['W']:.3f} | "
                     f"{row['verdict']} |")
    if r["equivalence"]:
        lines += ["", "Every engine passes and every broken variant fails: "
                  + ("yes" if r.get("as_required") else "NO")]
    errors = [f"- {row['engine']} step {row['step']}: {row['error']}" for row in r["equivalence"] if "error" in row]
    failed = [f"- {name}: rc={run['rc']} ({run['log']})"
              + (" after training completed (teardown)" if run.get("completed") else "")
              for name, run in r["runs"].items() if run["rc"] != 0]
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
            lines.append(f"{cap['shape']} shape, {cap['precision']}, {cap['checkpointing']} checkpointing, "
                         f"N={cap['N']} "
                         f"completions of {cap['S']} tokens, memory cap: {cap['cap_gib']} GiB per GPU "
                         f"({cap['memory_cap']}).")
            lines += ["", "| run | P | result | s | tokens/s | peak GiB (per GPU) |",
                      "| --- | --- | --- | --- | --- | --- |"]
            for p in cap["baseline_probes"]:
                lines.append(f"| 1 GPU full sequence, one row | {p['P']} | {'fits' if p['ok'] else 'OOM'} | "
                             f"{p.get('s', '-')} | "
                             f"{p.get('tokens_per_s', '-')} | {p.get('peak_gib', '-')} |")
            for p in cap.get("sp2_runs", []):
                result = "fits" if p.get("ok") else p.get("error", "OOM")
                lines.append(f"| **SP=2**, whole group | {p['P']} | {result} | {p.get('s', '-')} | "
                             f"{p.get('tokens_per_s', '-')} | {p.get('peak_gib_per_gpu', p.get('peak_gib', '-'))} |")
            lines += ["", f"Baseline: largest fitting P {cap.get('baseline_largest_fitting_P')}, smallest OOM P "
                          f"{cap.get('baseline_smallest_oom_P')}. SP=2: largest fitting P "
                          f"{cap.get('sp2_largest_fitting_P')}; "
                          f"trains where the baseline OOMs: {cap.get('sp2_trains_where_baseline_ooms')}."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU, gloo, tiny model, fp32, steps 1,2,3")
    parser.add_argument("--deadline-s", type=float, default=200.0,
                        help="launch no new run after this many seconds (results are written after every run)")
    parser.add_argument("--grace-s", type=float, default=40.0, help="a run may outlive the deadline by this much")
    parser.add_argument("--steps", default=None, help="record steps (default 1,10,20; --tiny: 1,2,3)")
    parser.add_argument("--engines", default="ddp,zero2,zero3,fsdp2,sp2",
                        help="after the baseline, in order: ddp, zero2, zero3, fsdp2, sp2 (controls come after the "
                             "capacity run)")
    parser.add_argument("--broken", default="", help="comma-separated broken variants run under ddp after the "
                        "engines, each must fail: " + ", ".join(criterion.BROKEN))
    parser.add_argument("--controls", default="stock-ddp,stock-zero2,stock-zero3,stock-fsdp2")
    parser.add_argument("--optim", default="sgd", help="HF optim name (sgd: plain SGD)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--reference-s", type=float, default=None,
                        help="time limit of the fp64 reference run, which comes last (default 150; --tiny: 300)")
    parser.add_argument("--no-capacity", action="store_true")
    parser.add_argument("--capacity-shape", default="qwen3-1.7b")
    parser.add_argument("--cap-gib", type=float, default=20.0, help="memory cap per GPU for the capacity bracketing")
    parser.add_argument("--capacity-budget-s", type=float, default=75.0)
    parser.add_argument("--scratch", default=None, help="where the (large) per-step snapshots go")
    args = parser.parse_args()
    if args.reference_s is None:
        args.reference_s = 300.0 if args.tiny else 150.0
    broken = [b for b in args.broken.split(",") if b]
    if unknown := set(broken) - set(criterion.BROKEN):
        parser.error(f"unknown broken variants {sorted(unknown)}")

    suite = Suite(args)
    suite.write()
    engines, controls = (list(filter(None, names.split(","))) for names in (args.engines, args.controls))
    engines += [f"ddp:{variant}" for variant in broken]
    if engines or controls:
        suite.train("baseline", 1)
    for engine in engines:
        suite.train(engine, 2)
    if not args.no_capacity:
        suite.capacity()
    for engine in controls:
        suite.train(engine, 2)
    if engines or controls:
        suite.reference()
    suite.write()
    print((suite.out / "multi_gpu_suite.md").read_text())
    sys.exit(0 if suite.as_required() or not (engines or controls) else 1)


if __name__ == "__main__":
    main()

"""One rank of a run of `benchmarks/multi_gpu_suite.py` (launched by it through torch.distributed.run).

    python -m torch.distributed.run --nproc_per_node N benchmarks/multi_gpu_worker.py train ENGINE SCRATCH JSON_ARGS
    python -m torch.distributed.run --nproc_per_node 1 benchmarks/multi_gpu_worker.py reference - SCRATCH JSON_ARGS
    python -m torch.distributed.run --nproc_per_node 1|2 benchmarks/multi_gpu_worker.py capacity - OUT_JSON JSON_ARGS

`train` ENGINE: `baseline` (stock GRPOTrainer, one process), `ddp` (PrefixFlowGRPOTrainer under plain DDP),
`zero2`/`zero3` (under DeepSpeed ZeRO), `fsdp2` (under FSDP2 through Accelerate), `sp2` (prefixflow_sp_size=2), the
controls `stock-ddp`/`stock-zero2`/`stock-zero3`/`stock-fsdp2` (GRPOTrainer on the same engine), and `ENGINE:VARIANT`
with a variant of `criterion.variant` patched in (a broken one must fail). Rank 0 writes `SCRATCH/ENGINE_step{k}.pt`
= {loss, grads, weights_before, weights} at the record steps: the loss of the optimizer step (the mean over ranks of
the summed microbatch losses each rank backpropagated), every parameter's full gradient and weight right before the
optimizer step (DeepSpeed: `safe_get_full_grad` and the fp32 master weights inside `DeepSpeedEngine.step`, which
Accelerate calls at the end of the boundary backward, before clipping and the update; others:
`on_pre_optimizer_step`, after PrefixFlow's Phase C and the DP reduction; FSDP2 shards gathered), and every weight
after the step (DeepSpeed: the fp32 master weights, gathered under ZeRO-3; others: the fp32 weights). The baseline
also writes `baseline_inputs_step{k}.pt`: each microbatch's TRL inputs and the factor its loss reached autograd with.

`reference` (one process): the fp64 full-sequence gradient of each recorded step at every engine's weights before
it, stock TRL's loss over the baseline's microbatches, no autocast (`reference_ENGINE_step{k}.pt`).

`capacity`: the low-level API on a bigger shape, under a memory cap. JSON_ARGS "stage" "baseline" (one process):
bracket the one-GPU full-sequence baseline's largest prefix; "sp2" (two processes): train one group of prefix "P"
with Ulysses SP=2 (see the suite's docstring).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import sys
import time

import torch
import torch.distributed as dist
from speed import SHAPES

WORDS_PREFIX = "t"
SPECIALS = ["<pad>", "<eos>", "<bos>"]


# -- the task: a word-level tokenizer over `vocab` ids, random long prompts, frozen rollouts -------------------------

def make_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"{WORDS_PREFIX}{i}" for i in range(vocab - len(SPECIALS))]
    table = {token: i for i, token in enumerate(SPECIALS + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=table, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   padding_side="left")


def make_dataset(prompts: int, lengths: tuple[int, int], vocab: int, seed: int = 0):
    from datasets import Dataset

    rng = random.Random(seed)
    words = vocab - len(SPECIALS)
    texts = [" ".join(f"{WORDS_PREFIX}{rng.randrange(words)}" for _ in range(rng.randint(*lengths)))
             for _ in range(prompts)]
    return Dataset.from_dict({"prompt": texts})


def reward(completions, **kwargs) -> list[float]:
    """Deterministic and varied within a group (zero-variance groups would give zero advantages)."""
    return [float(len(c.split()) % 5) + 0.01 * sum(int(w[1:]) % 7 for w in c.split() if w[1:].isdigit())
            for c in completions]


def freeze_rollouts(trainer, max_length: int, vocab: int, seed: int = 0) -> None:
    """Generation replaced by completions that depend only on the prompt, its copy number within the call and the
    call count (one generation per optimizer step on every process): every engine trains on the same rows however its
    weights drift and however many processes split the batch. The same rule as tests/grpo_setup.freeze_rollouts
    (per_prompt=True), over this task's vocabulary."""
    calls = {"n": 0}

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls["n"] += 1
        out, seen = [], {}
        for prompt in prompt_ids:
            index = seen[tuple(prompt)] = seen.get(tuple(prompt), -1) + 1
            rng = random.Random(hash((tuple(prompt), index, calls["n"], seed)) & 0xFFFFFFFF)
            length = rng.randint(max(1, max_length // 4), max_length)
            tokens = [rng.randrange(len(SPECIALS), vocab) for _ in range(length)]
            if length < max_length and rng.random() < 0.7:
                tokens[-1] = 1  # eos
            out.append(tokens)
        return out, None

    trainer._generate_single_turn = generate


def make_model(cfg: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["kv_heads"], head_dim=cfg["hidden"] // cfg["heads"],
                         max_position_embeddings=8192, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(cfg["seed"])  # the same fp32 weights in every engine (built before any DeepSpeed config exists)
    model = Qwen3ForCausalLM(config)
    if cfg.get("init_std"):
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, cfg["init_std"])
    return model


# -- recording loss, gradients and weights at the record steps ------------------------------------------------------

def full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor of an FSDP2 shard (a collective: every rank calls it), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def on_cpu(value):
    """`value` (a TRL batch: tensors, lists, scalars) with every tensor detached on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(v) for v in value)
    return value


class Recorder:
    def __init__(self, trainer, steps: list[int], engine: str, scratch: str):
        self.trainer, self.steps, self.engine, self.scratch = trainer, set(steps), engine, scratch
        self.deepspeed = "zero" in engine
        self.window = 0.0
        self.grads: dict | None = None
        self.weights_before: dict | None = None
        self.microbatches: list[dict] = []  # the baseline's: rows and loss scale of each, for the fp64 reference
        self.pending = None
        self.rank = int(os.environ.get("RANK", 0))

    def params(self):
        return list(self.trainer.accelerator.unwrap_model(self.trainer.model).named_parameters())

    def next_step(self) -> int:
        return self.trainer.state.global_step + 1

    def capture(self, grad_of, weight_of) -> None:
        """Every parameter's full gradient and weight right before the optimizer step, at the record steps."""
        if self.next_step() not in self.steps or self.grads is not None:
            return
        grads, weights = {}, {}
        for name, param in self.params():  # same order on every rank: the ZeRO and FSDP getters are collectives
            grad, weight = grad_of(param), weight_of(param)
            if self.rank == 0:
                grads[name] = None if grad is None else grad.detach().float().cpu().clone()
                weights[name] = weight.detach().float().cpu().clone()
        self.grads, self.weights_before = grads, weights

    def step_end(self) -> None:
        step = self.trainer.state.global_step
        loss = torch.tensor([self.window], dtype=torch.float64, device=self.trainer.accelerator.device)
        self.window = 0.0
        if step not in self.steps:
            self.grads = self.weights_before = None
            self.microbatches = []
            return
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        weights = {}
        if self.deepspeed:
            from deepspeed.utils import safe_get_full_fp32_param
        for name, param in self.params():
            value = safe_get_full_fp32_param(param) if self.deepspeed else full(param)
            if value is None:
                value = param
            if self.rank == 0:
                weights[name] = value.detach().float().cpu().clone()
        if self.rank == 0:
            torch.save({"loss": loss.item(), "grads": self.grads, "weights": weights,
                        "weights_before": self.weights_before},
                       os.path.join(self.scratch, f"{self.engine}_step{step}.pt"))
            if self.microbatches:
                torch.save(self.microbatches, os.path.join(self.scratch, f"{self.engine}_inputs_step{step}.pt"))
        self.grads = self.weights_before = None
        self.microbatches = []


def install(trainer, recorder: Recorder) -> None:
    from transformers import TrainerCallback

    class Callback(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if not recorder.deepspeed:
                recorder.capture(lambda p: full(p.grad), full)

        def on_step_end(self, args, state, control, **kwargs):
            recorder.step_end()

    trainer.add_callback(Callback())
    training_step = trainer.training_step

    def recorded(model, inputs, num_items_in_batch=None):
        loss = training_step(model, inputs, num_items_in_batch)
        recorder.window += float(loss)
        return loss

    trainer.training_step = recorded
    if recorder.engine == "baseline":  # each microbatch's rows and the factor its loss is backpropagated with
        compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward

        def recorded_loss(model, inputs, *args, **kwargs):
            loss = compute_loss(model, inputs, *args, **kwargs)
            if recorder.next_step() in recorder.steps:
                recorder.pending = (on_cpu(inputs), loss.detach())
            return loss

        def recorded_backward(loss, **kwargs):
            if recorder.pending is not None:
                inputs, raw = recorder.pending
                # what reaches autograd: the trainer's scaling, then Accelerate's division by its own accumulation
                scale = (loss.detach() / raw).item() / trainer.accelerator.gradient_accumulation_steps
                recorder.microbatches.append({"inputs": inputs, "scale": scale,
                                              "accumulation": trainer.current_gradient_accumulation_steps})
                recorder.pending = None
            return backward(loss, **kwargs)

        trainer.compute_loss, trainer.accelerator.backward = recorded_loss, recorded_backward
    if recorder.deepspeed:  # Accelerate steps the engine inside the boundary backward: grads are read just before
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

        step = DeepSpeedEngine.step

        def master(param):  # the fp32 master weight (gathered under ZeRO-3)
            weight = safe_get_full_fp32_param(param)
            return param if weight is None else weight

        def recorded_step(engine, *args, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                recorder.capture(safe_get_full_grad, master)
            return step(engine, *args, **kwargs)

        DeepSpeedEngine.step = recorded_step


def deepspeed_config(stage: int) -> dict:
    # bf16 "auto": on with GRPOConfig(bf16=True), i.e. DeepSpeed's bf16 mode (bf16 weights and activations in the
    # engine, fp32 master weights in the optimizer); off in --tiny (fp32).
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "bf16": {"enabled": "auto"}}


def fsdp_on_cpu() -> None:
    """--tiny: Accelerate turns an FSDP plugin into FSDP only on accelerators; on gloo it would silently train plain
    DDP. `fully_shard` itself runs on a CPU mesh, so let Accelerate's FSDP path run there (as tests/ddp_worker.py)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = patched


def trainer_args(cfg: dict, scratch: str, engine: str, processes: int, bf16: bool) -> dict:
    """The GRPOConfig arguments every engine shares (the same rows in the same microbatches, no clipping)."""
    tiny = cfg["tiny"]
    common = dict(output_dir=os.path.join(scratch, engine), num_generations=cfg["n"],
                  per_device_train_batch_size=cfg["global_rows"] // (cfg["gas"] * processes),
                  gradient_accumulation_steps=cfg["gas"], max_completion_length=cfg["completion"],
                  max_steps=max(cfg["steps"]), report_to="none", logging_steps=1, save_strategy="no",
                  learning_rate=cfg["lr"], optim=cfg["optim"], lr_scheduler_type="constant", warmup_steps=0,
                  weight_decay=0.0, max_grad_norm=0.0, seed=3, bf16=bf16, use_cpu=tiny,
                  ddp_backend="gloo" if tiny else "nccl", disable_tqdm=True, dataloader_num_workers=0)
    if engine.endswith(("zero2", "zero3")):
        common["deepspeed"] = deepspeed_config(int(engine[-1]))
    if engine.endswith("fsdp2"):
        common.update(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]})
    return common


def train(engine: str, scratch: str, cfg: dict) -> None:
    """ENGINE[:VARIANT]: with a variant of `criterion` (a broken one must fail the comparison) patched in."""
    import trl.trainer.grpo_trainer as trl_grpo
    from trl import GRPOConfig, GRPOTrainer

    import criterion
    from hf_prefixflow import PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer
    from hf_prefixflow.trainers import mixin as pf_mixin
    from hf_prefixflow.trainers.grouping import check_group_prompts

    # Same rows in the same microbatches on every engine (as tests/ddp_worker.py): no row or group shuffle.
    trl_grpo.shuffle_sequence_dict = lambda batch: batch
    pf_mixin.shuffle_groups = (
        lambda batch, size, generator=None, offset=0: (check_group_prompts(batch, size, offset), batch)[1])

    name, _, variant = engine.partition(":")
    processes = int(os.environ.get("WORLD_SIZE", 1))
    if name.endswith("fsdp2") and cfg["tiny"]:
        fsdp_on_cpu()
    model = make_model(cfg)  # before the config: a live DeepSpeed config would make transformers init under zero.Init
    common = trainer_args(cfg, scratch, engine, processes, bf16=not cfg["tiny"])
    stock = name == "baseline" or name.startswith("stock")
    if stock:
        trainer_cls, args = GRPOTrainer, GRPOConfig(**common)
    else:
        trainer_cls = PrefixFlowGRPOTrainer
        args = PrefixFlowGRPOConfig(prefixflow_sp_size=2 if name == "sp2" else 1, **common)
    dataset = make_dataset(cfg["global_rows"] // cfg["n"] * max(cfg["steps"]) + 4, tuple(cfg["prompt"]), cfg["vocab"])
    trainer = trainer_cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=make_tokenizer(cfg["vocab"]))
    freeze_rollouts(trainer, cfg["completion"], cfg["vocab"])
    recorder = Recorder(trainer, cfg["steps"], engine, scratch)
    install(trainer, recorder)
    start = time.perf_counter()
    with criterion.variant(variant or None, cfg["layers"]) as used:
        trainer.train()
    if recorder.rank == 0:
        print(json.dumps({"engine": engine, "train_s": round(time.perf_counter() - start, 2),
                          "per_device_train_batch_size": args.per_device_train_batch_size,
                          "processes": processes, "precision": precision(name, cfg["tiny"]),
                          "wrapped": type(trainer.model_wrapped).__name__, "variant_calls": used["calls"],
                          "gpu": None if cfg["tiny"] else torch.cuda.get_device_name()}), flush=True)
    if dist.is_initialized():  # an orderly teardown (gloo has aborted at interpreter exit after ZeRO-3)
        dist.barrier()
        dist.destroy_process_group()


def precision(engine: str, tiny: bool) -> str:
    if tiny:
        return "fp32"
    if "zero" in engine:
        return "DeepSpeed bf16 (bf16 weights/activations/grads in the engine, fp32 master weights)"
    if "fsdp2" in engine:
        return "FSDP2 mixed precision through Accelerate (bf16 compute weights, fp32 sharded weights)"
    return "bf16 autocast over fp32 weights (Accelerate mixed_precision=bf16)"


def reference(scratch: str, cfg: dict) -> None:
    """The fp64 full-sequence gradient of every recorded step at each engine's weights before that step: stock
    TRL's loss (`compute_loss`, no autocast) over the baseline's microbatches of the step, each scaled as the
    baseline's trainer backpropagated it. Writes `reference_ENGINE_step{k}.pt` beside the snapshots."""
    from trl import GRPOConfig, GRPOTrainer

    device = torch.device("cpu") if cfg["tiny"] else torch.device("cuda")
    model = make_model(cfg).to(device, torch.float64)
    args = GRPOConfig(**trainer_args(cfg, scratch, "reference", 1, bf16=False))
    dataset = make_dataset(4, tuple(cfg["prompt"]), cfg["vocab"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=make_tokenizer(cfg["vocab"]))
    model = model.to(device, torch.float64).train()
    params = dict(model.named_parameters())
    for step in cfg["steps"]:
        inputs_path = os.path.join(scratch, f"baseline_inputs_step{step}.pt")
        if not os.path.exists(inputs_path):
            continue
        microbatches = torch.load(inputs_path, weights_only=False)
        done = []  # (weights, grads): engines at the same weights share one reference (every engine at step 1)
        for path in sorted(f for f in os.listdir(scratch) if f.endswith(f"_step{step}.pt") and "_" in f):
            engine = path[: -len(f"_step{step}.pt")]
            if engine.startswith("reference_") or engine.endswith("_inputs"):
                continue
            weights = torch.load(os.path.join(scratch, path), weights_only=False)["weights_before"]
            grads = next((g for w, g in done if all(torch.equal(w[n], weights[n]) for n in w)), None)
            if grads is None:
                with torch.no_grad():
                    for name, param in params.items():
                        param.copy_(weights[name])
                model.zero_grad(set_to_none=True)
                for batch in microbatches:
                    trainer.current_gradient_accumulation_steps = batch["accumulation"]
                    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                              for k, v in batch["inputs"].items()}
                    (trainer.compute_loss(model, inputs) * batch["scale"]).backward()
                grads = {n: None if p.grad is None else p.grad.detach().cpu().clone() for n, p in params.items()}
                done.append((weights, grads))
            torch.save(grads, os.path.join(scratch, f"reference_{engine}_step{step}.pt"))
            print(json.dumps({"reference": engine, "step": step, "shared": len(done)}), flush=True)


# -- SP capacity: the one-GPU full-sequence baseline vs Ulysses SP=2, low-level API ----------------------------------

CAPACITY_SHAPES = {
    "qwen3-1.7b": {k: v for k, v in SHAPES["qwen3-1.7b"].items() if k != "model_type"},
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}


def capacity(out_json: str, cfg: dict) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import hf_prefixflow
    from hf_prefixflow.distributed import ulysses

    tiny = cfg["tiny"]
    device = torch.device("cpu") if tiny else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if not tiny:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if tiny else "nccl", timeout=datetime.timedelta(seconds=cfg["collective_timeout_s"]))
    rank = dist.get_rank()
    deadline = time.time() + cfg.get("budget_s", 0)
    if not tiny:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg["cap_gib"] * 2**30 / total), device)
    config = Qwen3Config(max_position_embeddings=1 << 20, attn_implementation="sdpa", **CAPACITY_SHAPES[cfg["shape"]])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.float32 if tiny else torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = hf_prefixflow.apply_prefixflow(model.train(), offload=cfg["offload"])  # prefix groups only: SP runs
    vocab, n, suffix = config.vocab_size, cfg["n"], cfg["suffix"]
    result = {"shape": cfg["shape"], "N": n, "S": suffix, "cap_gib": None if tiny else cfg["cap_gib"],
              "memory_cap": "torch.cuda.set_per_process_memory_fraction on every GPU" if not tiny else
              f"simulated: --tiny raises OOM above {cfg['tiny_oom_tokens']} tokens per forward",
              "precision": "fp32" if tiny else "bf16 weights and grads, no optimizer (fwd+bwd only, like speed.py)",
              "checkpointing": "non-reentrant", "baseline_probes": []}

    def group(length: int):
        gen = torch.Generator(device="cpu").manual_seed(length)
        prompt = torch.randint(0, vocab, (length,), generator=gen).to(device)
        return prompt, torch.randint(0, vocab, (n, suffix), generator=gen).to(device)

    def loss_of(logits, targets):
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum")

    def check_tiny(tokens: int):
        if tiny and tokens > cfg["tiny_oom_tokens"]:
            raise torch.cuda.OutOfMemoryError("simulated (--tiny)")

    def baseline(prompt, suffixes):  # one [P || S_i] per forward, as TRL with batch 1; the probe runs one row
        for s in suffixes[:1]:  # (rows run one after another, so the peak of one row is the group's peak)
            check_tiny(len(prompt) + len(s))
            ids = torch.cat([prompt, s])[None]
            logits = model(ids, logits_to_keep=len(s) + 1, use_cache=False).logits[:, :-1]
            loss_of(logits, s[None]).backward()

    sp = ulysses.SequenceParallel() if cfg["stage"] == "sp2" else None

    def sp2(prompt, suffixes):  # the whole group as one padded wave, sharded over both GPUs
        check_tiny((len(prompt) + n * suffix) // 2)
        with ulysses.prefix_group(model, prompt, sp) as g:
            out = g(suffixes, attention_mask=torch.ones_like(suffixes))
            real = out.token_index >= 0
            loss_of(out.logits[:, real], suffixes[:, out.token_index[real]]).backward()
        ulysses.reduce_gradients(model, sp)

    def measure(fn, length: int, repeats: int = 1) -> dict:
        prompt, suffixes = group(length)
        model.zero_grad(set_to_none=True)
        if not tiny:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            times = []
            for _ in range(repeats):
                if not tiny:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                fn(prompt, suffixes)
                if not tiny:
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
            tokens = length + suffix if fn is baseline else length + n * suffix
            row = {"P": length, "ok": True, "s": round(min(times), 4), "tokens": tokens,
                   "tokens_per_s": round(tokens / min(times), 1)}
        except torch.cuda.OutOfMemoryError:
            row = {"P": length, "ok": False, "oom": True}
        model.zero_grad(set_to_none=True)
        if not tiny:
            row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            torch.cuda.empty_cache()
        return row

    def write():
        if rank == 0:
            with open(out_json, "w") as f:
                json.dump(result, f, indent=1)

    if cfg["stage"] == "baseline":  # one process: the full-sequence baseline, doubling then bisecting
        fits, fails = None, None
        length = cfg["start_prefix"]
        while time.time() < deadline - cfg["reserve_s"] and length <= cfg["max_prefix"]:
            row = measure(baseline, length)
            result["baseline_probes"].append(row)
            print(json.dumps({"baseline": row}), flush=True)
            write()
            if row["ok"]:
                fits = length
            else:
                fails = length
                break
            length *= 2
        while (fits and fails and fails - fits > cfg["precision_tokens"]
               and time.time() < deadline - cfg["reserve_s"]):
            mid = (fits + fails) // 2 // cfg["granularity"] * cfg["granularity"]
            if not fits < mid < fails:
                break
            row = measure(baseline, mid)
            result["baseline_probes"].append(row)
            print(json.dumps({"baseline": row}), flush=True)
            write()
            fits, fails = (mid, fails) if row["ok"] else (fits, mid)
        result["baseline_largest_fitting_P"], result["baseline_smallest_oom_P"] = fits, fails
    else:  # both ranks, one length: an OOM inside a collective hangs the other rank, so the suite times us out
        row = measure(sp2, cfg["P"], repeats=cfg["repeats"])
        if not tiny:
            peak = torch.tensor([row.get("peak_gib", 0.0)], device=device)
            peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
            dist.all_gather(peaks, peak)
            row["peak_gib_per_gpu"] = [round(p.item(), 2) for p in peaks]
        result["sp2"] = row
        print(json.dumps({"sp2": row}), flush=True)
    write()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, name, path, cfg_json = sys.argv[1:5]
    if mode == "train":
        train(name, path, json.loads(cfg_json))
    elif mode == "reference":
        reference(path, json.loads(cfg_json))
    else:
        capacity(path, json.loads(cfg_json))

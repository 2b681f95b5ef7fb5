"""PrefixFlowGRPOTrainer: TRL's GRPOTrainer whose actor update and scoring passes run each prompt as a prefix group.

Swap `GRPOTrainer` for `PrefixFlowGRPOTrainer`; the config, data, loss, metrics and checkpoints stay TRL's. What
changes: batches are shuffled and split by whole groups instead of rows, and the per-token log-probs come from
prefix groups: a prompt runs forward once (Phase A), its completions run as a suffix wave through TRL's own fused
LM head (Phase B); TRL's loss and backward follow untouched, and the delayed prefix backward (Phase C) runs once
the last microbatch that reads the prompt has been backpropagated, before the optimizer step. MoE models also
record their routes during generation and replay them (`trainers/routing.py`); under DDP the gradients are reduced
once, after Phase C, and under FSDP2 inside the boundary's Phase C (`hf_prefixflow/distributed/`). Under plain DDP a
group may straddle processes: its owner's prefix K/V are shared with the other holders and their gK/gV summed back
(`hf_prefixflow/distributed/placement.py`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from accelerate.utils import DistributedType, TorchDynamoPlugin
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from hf_prefixflow import AutoWaves, GroupSession, PrefixFlowError, apply_prefixflow, moe
from hf_prefixflow.attention import RECOMPILE_LIMIT
from hf_prefixflow.distributed import data_parallel, fsdp, placement, zero
from hf_prefixflow.flops import MIN_SPEEDUP, ModelShape
from hf_prefixflow.model import unwrap
from hf_prefixflow.recompute import RECOMPUTE_SHARE, decoder_layers

from . import routing, sequence_parallel
from .grouping import BatchGroup, check_geometry, find_groups, shuffle_groups

logger = logging.getLogger(__name__)

MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                   "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


@dataclass
class PrefixFlowGRPOConfig(GRPOConfig):
    """`GRPOConfig` plus PrefixFlow's knobs; a plain `GRPOConfig` gets these defaults."""

    prefixflow_layout: str = field(
        default="padded", metadata={"help": "suffix wave layout: 'padded' rows or one 'packed' row per group"})
    prefixflow_min_speedup: float = field(
        default=MIN_SPEEDUP, metadata={"help": "groups whose FLOP bound is below this train on the plain path "
                                               "(logged and counted); see hf_prefixflow.flops.MIN_SPEEDUP"})
    prefixflow_scoring: bool = field(
        default=True, metadata={"help": "reuse the prefix in the old-policy and reference scoring passes"})
    prefixflow_routing_replay: bool = field(
        default=True, metadata={"help": "MoE models: record routes during generation and replay them in training"})
    prefixflow_offload: bool = field(
        default=False, metadata={"help": "keep dormant prefix activations in a host pool between Phase A and C"})
    prefixflow_prefix_recompute: float | None = field(
        default=None, metadata={"help": "the share of prefix layers Phase A checkpoints and Phase C recomputes "
                                        f"(default {RECOMPUTE_SHARE} with offload, where it replaces copying them "
                                        "back, else 0)"})
    prefixflow_suffix_checkpointing: bool = field(
        default=True, metadata={"help": "with gradient_checkpointing: False keeps suffix waves' activations instead "
                                        "of recomputing them (the prefix stays checkpointed)"})
    prefixflow_wave_size: str | None = field(
        default=None, metadata={"help": "rows per suffix wave: None keeps a group's rows of a microbatch in one wave; "
                                        "a number caps it; 'auto' sizes waves from free CUDA memory (AutoWaves)"})
    prefixflow_kv_grad_dtype: str | None = field(
        default=None, metadata={"help": "dtype gK/gV sum in across waves ('float32', 'bfloat16'); default: the "
                                        "trainable parameters' own (fp32 under DeepSpeed, which accumulates in fp32)"})
    prefixflow_sp_size: int = field(
        default=1, metadata={"help": "Ulysses sequence parallelism over groups of this many consecutive processes "
                                     "(trainers/sequence_parallel.py); ParallelismConfig(sp_size=N) means the same"})

    def __post_init__(self):
        pc = self.parallelism_config
        if pc is not None and pc.sp_enabled:  # PrefixFlow runs Ulysses itself; TRL and DeepSpeed's would refuse
            size = sequence_parallel.sp_size_from(pc, self.prefixflow_sp_size)
            self.prefixflow_sp_size, self.parallelism_config = size, None
        super().__post_init__()


DEFAULTS = {name: PrefixFlowGRPOConfig.__dataclass_fields__[name].default
            for name in ("prefixflow_layout", "prefixflow_min_speedup", "prefixflow_scoring",
                         "prefixflow_routing_replay", "prefixflow_offload", "prefixflow_prefix_recompute",
                         "prefixflow_suffix_checkpointing", "prefixflow_wave_size", "prefixflow_kv_grad_dtype")}


class PrefixFlowGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with training-time KV caching of each group's shared prompt."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Accelerate shards the model only in train(); a model sharded at load time already holds FSDP2 units.
        self._fsdp = self.accelerator.distributed_type == DistributedType.FSDP or bool(fsdp.units(self.model))
        self._check_supported()
        for name, default in DEFAULTS.items():
            setattr(self, name, getattr(self.args, name, default))
        if self.prefixflow_layout not in ("padded", "packed"):
            raise PrefixFlowError(f"prefixflow_layout must be 'padded' or 'packed', got {self.prefixflow_layout!r}.")
        self._auto_waves = self._check_wave_size()
        if self.args.torch_compile:
            self._compile_layers()
        apply_prefixflow(self.model, offload=self.prefixflow_offload,
                         prefix_recompute=self.prefixflow_prefix_recompute,
                         suffix_checkpointing=self.prefixflow_suffix_checkpointing,
                         kv_grad_dtype=self._kv_grad_dtype())
        if self.ref_model is not None:
            apply_prefixflow(self.ref_model)
        self._shape = ModelShape.from_config(unwrap(self.model).config)
        self._session: GroupSession | None = None
        self._open: dict[tuple, object] = {}
        self._fallbacks: Counter = Counter()
        self._replay = self.prefixflow_routing_replay and bool(moe.routers(unwrap(self.model)))
        self._routes: torch.Tensor | None = None  # routes of the rows being scored or trained
        if self._replay:
            self._check_replay_supported()
        self._splits: dict[tuple, placement.SplitGroup] = {}  # this window's groups split across processes
        if self._split and moe.routers(unwrap(self.model)):
            raise PrefixFlowError("groups split across processes are supported for dense models only (MoE routes and "
                                  "router logits are per rank); " + _WHOLE_GROUPS)

    def _build_accelerator_args(self, **kwargs) -> dict:
        # torch_compile: Accelerate would wrap the whole model in one compiled module, which PrefixFlow's phases
        # cannot run through; `_compile_layers` compiles each decoder layer in place instead.
        options = super()._build_accelerator_args(**kwargs)
        if self.args.torch_compile:
            options["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return options

    def _compile_layers(self) -> None:
        if self._deepspeed or self._fsdp:
            raise PrefixFlowError("torch_compile with DeepSpeed or FSDP is not supported by PrefixFlowGRPOTrainer "
                                  "(untested with their hooks); turn torch_compile off, or train with DDP.")
        for model in (m for m in (self.model, self.ref_model) if m is not None):
            layers = decoder_layers(model)
            if not layers:
                raise PrefixFlowError("torch_compile: PrefixFlow compiles a model's decoder layers (transformers' "
                                      f"GradientCheckpointingLayer), and {type(model).__name__} has none.")
            for layer in layers:
                layer.compile(backend=self.args.torch_compile_backend, mode=self.args.torch_compile_mode)
            logger.info("PrefixFlow: torch_compile compiles each of the %d decoder layers in place, not the whole "
                        "model.", len(layers))
        if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
            logger.info("PrefixFlow: torch_compile raises torch._dynamo.config.recompile_limit from %d to %d (the "
                        "phases' variants of a layer's graph).", torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT

    def _kv_grad_dtype(self) -> torch.dtype | None:
        name = self.prefixflow_kv_grad_dtype
        if name is None:
            return torch.float32 if self._deepspeed else None  # DeepSpeed's grad_accum_dtype defaults to fp32
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise PrefixFlowError(f"prefixflow_kv_grad_dtype must name a floating-point torch dtype such as "
                                  f"'float32' or 'bfloat16', got {name!r}.")
        return dtype

    @property
    def _deepspeed(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    def _check_supported(self) -> None:
        plain_ddp = (self.accelerator.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
                     and not self._fsdp and getattr(self.args, "prefixflow_sp_size", 1) == 1)
        self._split = check_geometry(self.args.per_device_train_batch_size, self.num_generations,
                                     self.args.steps_per_generation, can_split=plain_ddp)
        supported = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU,
                     DistributedType.DEEPSPEED, DistributedType.FSDP)
        if self.accelerator.distributed_type not in supported:
            raise PrefixFlowError(
                f"PrefixFlowGRPOTrainer supports one process, DDP, FSDP2 and DeepSpeed ZeRO for now, not "
                f"{self.accelerator.distributed_type}."
            )
        self._sp = sequence_parallel.setup(self, getattr(self.args, "prefixflow_sp_size", 1))
        if self._fsdp:
            fsdp.check_config(self.accelerator, self.model)
        if self._deepspeed:
            zero.check_config(self.accelerator)
            if self.args.steps_per_generation % self.args.gradient_accumulation_steps:
                raise PrefixFlowError(
                    "under DeepSpeed, prompts stay cached until the accumulation boundary, so a new generation must "
                    "not start inside a window: make steps_per_generation a multiple of gradient_accumulation_steps."
                )
        kwargs = self.args.gradient_checkpointing_kwargs or {}
        if self.args.gradient_checkpointing and kwargs.get("use_reentrant", False):
            raise PrefixFlowError(
                "reentrant activation checkpointing detaches the prefix K/V from the prefix graph. Set "
                "gradient_checkpointing_kwargs={'use_reentrant': False} (TRL's default)."
            )

    def _check_replay_supported(self) -> None:
        if self.use_vllm or self.use_transformers_continuous_batching:
            raise PrefixFlowError(
                "MoE routing replay records routes in TRL's transformers generation path; vLLM and continuous "
                "batching do not expose them. Set use_vllm=False, or prefixflow_routing_replay=False to let training "
                "route afresh as GRPOTrainer does."
            )
        if self.tools or self.environment_factories is not None or getattr(self, "rollout_func", None) is not None:
            raise PrefixFlowError("MoE routing replay does not support tool calls or custom rollouts yet; set "
                                  "prefixflow_routing_replay=False.")
        moe.check_replay_supported(unwrap(self.model))

    # -- MoE routing replay: record during generation, carry with the batch -----------------------------------

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # The compiled layers are for training: a generation cache read by layer index would make each layer a graph
        # of its own and use up torch.compile's recompile limit (`_compile_layers`).
        eager = torch.compiler.set_stance("force_eager") if self.args.torch_compile else contextlib.nullcontext()
        with eager:
            return self._generate_recording_routes(prompt_ids, images, multimodal_fields, num_generations,
                                                   has_tool_images)

    def _generate_recording_routes(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images):
        if not self._replay:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        with moe.record_routing() as recorder:
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                                     num_generations, has_tool_images)
        config = unwrap(self.model).config.get_text_config()
        prefill = next(iter(recorder.calls.values()))[0]  # the first call runs the left-padded prompts
        prompt_width = prefill.shape[0] // len(prompt_ids)
        self._routes = routing.assemble(recorder, len(prompt_ids), prompt_width,
                                        max(len(c) for c in completion_ids), config.num_hidden_layers,
                                        num_generations, config.num_experts_per_tok)
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)  # scoring passes inside use self._routes
        if self._replay:
            width = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
            if self._routes is None or self._routes.shape[0] != batch["prompt_ids"].shape[0] \
                    or self._routes.shape[2] != width:
                raise PrefixFlowError("the recorded routes do not match the generated batch; replay cannot proceed.")
            batch[routing.BATCH_KEY] = self._routes
        self._routes = None
        return batch

    def _compute_loss(self, model, inputs):
        self._routes = inputs.get(routing.BATCH_KEY)
        if self._split and model.training and torch.is_grad_enabled():  # an actor update's microbatch
            self._open_split_groups(model, inputs)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._routes = None

    def _rows_routes(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        if not self._replay:
            return None
        routes = self._routes
        if routes is None or routes.shape[0] != input_ids.shape[0] or routes.shape[2] != input_ids.shape[1]:
            raise PrefixFlowError("MoE routing replay data is missing for this forward; refusing to re-route.")
        return routes.to(input_ids.device)

    # -- data flow: whole groups ------------------------------------------------------------------------------

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = split_pixel_values_by_grid(self._generate_and_score_completions(generation_batch))
            # The stock trainer shuffles rows here. This process's rows start `offset` rows into their group.
            offset = self.accelerator.process_index * len(batch["prompt_ids"]) % self.num_generations
            batch = shuffle_groups(batch, self.num_generations, offset=offset)
            chunks = split_tensor_dict(batch, self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(chunk) for chunk in chunks]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    # -- log-probs through prefix groups ----------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        if self._sp is not None:  # Ulysses: the SP group pools its rows and runs them sharded
            if any(extra.get(key) is not None for key in MULTIMODAL_KEYS) or compute_aux_loss:
                raise PrefixFlowError("sequence parallelism supports text-only dense models; multimodal inputs and "
                                      "MoE auxiliary losses are not sharded yet.")
            return sequence_parallel.logps(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy)
        routes = self._rows_routes(input_ids)

        def plain(rows):
            if routes is not None:
                return routing.plain_logps(self, model, input_ids[rows], attention_mask[rows], logits_to_keep,
                                           routes[rows], compute_entropy, compute_aux_loss)
            return super(PrefixFlowGRPOTrainer, self)._get_per_token_logps_and_entropies(
                model, input_ids[rows], attention_mask[rows], logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **extra)

        training = torch.is_grad_enabled()
        reason = self._plain_path_reason(extra, training)
        if reason and training and self._split:
            raise PrefixFlowError(f"{reason} cannot train groups split across processes; " + _WHOLE_GROUPS)
        shared, fallback = [], []
        if not reason:
            groups = find_groups(input_ids, attention_mask, logits_to_keep)
            # The load-balancing loss spans the microbatch, ZeRO needs a group at every boundary (and ZeRO-3 the same
            # forwards on every rank), FSDP2 both: then every group with a prompt to share is shared.
            every_group = compute_aux_loss or (self._deepspeed and training) or self._fsdp
            shared, fallback = self._choose(groups, attention_mask[:, -logits_to_keep:], every_group=every_group,
                                            split=self._splits if training else {})
            if compute_aux_loss and fallback:  # the load-balancing loss spans the whole microbatch: one path for all
                reason = "router auxiliary loss with a one-token prompt"
        fresh = sum(g.key not in self._open for g in shared) if training else len(shared)
        # Before any forward: under FSDP2 a rank taking another path would mismatch the others' collectives.
        schedule = [1, 0, 0, 0] if reason else [0, fresh, sum(len(g.rows) for g in shared), int(bool(fallback))]
        fsdp.check_same_schedule(model, "a microbatch's paths, prefix forwards, suffix-wave rows and plain forwards",
                                 schedule)
        if reason:
            self._count_fallback(reason, input_ids.shape[0])
            return plain(slice(None))
        aux_parts: list | None = [] if compute_aux_loss else None
        width = input_ids.shape[1] - logits_to_keep
        completions, completion_mask = input_ids[:, -logits_to_keep:], attention_mask[:, -logits_to_keep:]
        suffix_routes = None if routes is None else routes[:, :, width:]
        pieces: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []
        start = time.perf_counter()
        if fallback:
            self._count_fallback("below prefixflow_min_speedup", len(fallback))
            logps, entropies, _ = plain(fallback)
            pieces.append((fallback, logps, entropies))
        if shared:
            waves = (completions, completion_mask, suffix_routes, compute_entropy, aux_parts)
            if training:
                pieces += self._training_waves(model, shared, routes, width, waves)
            else:
                with GroupSession(model) as session:
                    pieces += [self._wave(self._open_group(session, g, routes, width, aux_parts is not None), g.rows,
                                          *waves) for g in shared]
        self._log_groups(shared, completion_mask, training, time.perf_counter() - start)
        order = torch.tensor([r for rows, _, _ in pieces for r in rows], device=input_ids.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        logps = torch.cat([p[1] for p in pieces])[inverse]
        entropies = torch.cat([p[2] for p in pieces])[inverse] if compute_entropy else None
        aux = None
        if aux_parts is not None:
            config = unwrap(self.model).config.get_text_config()
            aux = moe.load_balancing_loss(aux_parts, config.num_experts, config.num_experts_per_tok)
        return logps, entropies, aux

    def _plain_path_reason(self, extra: dict, training: bool) -> str | None:
        if any(extra.get(key) is not None for key in MULTIMODAL_KEYS):
            if self._replay:
                raise PrefixFlowError("MoE routing replay with multimodal inputs is not supported; set "
                                      "prefixflow_routing_replay=False.")
            return "multimodal inputs"
        if not training and not self.prefixflow_scoring:
            return "prefixflow_scoring=False"
        return None

    def _choose(self, groups: list[BatchGroup], completion_mask: torch.Tensor, every_group: bool = False,
                split: dict | None = None):
        """Groups worth sharing, and the rows that train on the plain path (the FLOP model's verdict, unless
        `every_group`: then only one-token prompts, which leave nothing to share). Groups split across processes
        (keys in `split`) are always shared: their other holders read this rank's K/V or send it gK/gV."""
        lengths = completion_mask.sum(dim=1).tolist()
        shared, fallback = [], []
        for group in groups:
            pays = self._shape.pays(len(group.prefix_ids), [int(lengths[r]) for r in group.rows],
                                    self.prefixflow_min_speedup)
            if (every_group or pays or group.key in (split or {})) and len(group.prefix_ids) > 1:
                shared.append(group)
            else:
                fallback += group.rows
        return shared, fallback

    def _open_group(self, session: GroupSession, group: BatchGroup, routes: torch.Tensor | None, width: int,
                    collect_router_logits: bool):
        prefix_routes = None if routes is None else routes[group.rows[0], :, group.position_offset : width].long()
        with self.accelerator.autocast():  # Phase A under the same autocast as the waves, as in TRL's forward
            return session.open(group.prefix_ids, group.position_offset, routes=prefix_routes,
                                collect_router_logits=collect_router_logits)

    def _wave(self, group, rows, completions, completion_mask, suffix_routes, compute_entropy, aux_parts):
        """One suffix wave of `rows` through TRL's fused LM head; log-prob `t` scores completion token `t`."""
        ids, mask = completions[rows], completion_mask[rows]
        labels = ids.masked_fill(mask == 0, -100)
        routes = None if suffix_routes is None else suffix_routes[rows].transpose(0, 1).long()
        if aux_parts is not None:
            return rows, *self._wave_with_router_logits(group, ids, mask, labels, routes, compute_entropy, aux_parts)
        with self.accelerator.autocast():
            if self.prefixflow_layout == "packed":
                real = mask.sum(dim=1).clamp(min=1).tolist()
                suffixes = [row[:n] for row, n in zip(ids, real)]
                per_suffix = None if routes is None else [routes[:, i, :n] for i, n in enumerate(real)]
                out = group.packed(suffixes, routes=per_suffix, shift_labels=_pack(labels, real),
                                   fused_lm_head=True).raw
                logps, entropy = _unpack(out.log_probs, real, ids.shape[1]), _unpack(out.entropy, real, ids.shape[1])
            else:
                out = group(ids, attention_mask=mask, routes=routes, shift_labels=labels, fused_lm_head=True)
                logps, entropy = out.log_probs, out.entropy
        return rows, logps, (entropy if compute_entropy else None)

    def _wave_with_router_logits(self, group, ids, mask, labels, routes, compute_entropy, aux_parts):
        """A padded wave that also feeds each completion's last token (TRL's rows do, so its router logits count in
        the load-balancing loss) and adds this wave's and the prefix's router logits to `aux_parts`."""
        pad = ids.new_zeros(ids.shape[0], 1)
        ids, mask, labels = torch.cat([ids, pad], 1), torch.cat([mask, pad], 1), torch.cat([labels, pad - 100], 1)
        if routes is not None:
            routes = torch.cat([routes, routes[:, :, -1:]], dim=2)
        with self.accelerator.autocast():
            wave = group.padded_wave(ids, mask, routes)
            wave.router_logits = {}
            out = group.run_wave(wave, shift_labels=labels, fused_lm_head=True)
        count = float(len(ids))
        aux_parts.append(({l: t.leaf for l, t in group.cache.router_logits.items()},
                          torch.full((group.cache.prefix_length,), count, device=ids.device)))
        aux_parts.append((wave.router_logits, (wave.segment_ids >= 0).reshape(-1)))
        entropy = out.entropy[:, :-1] if compute_entropy else None
        return out.log_probs[:, :-1], entropy

    # -- the actor update: groups live across the microbatches of one accumulation window ----------------------

    def _training_waves(self, model, groups, routes, width, waves):
        if self._session is None:
            self._session = GroupSession(model).__enter__()
        pieces = []
        for g in groups:
            split = self._splits.get(g.key)
            group = split.group if split is not None else self._open.get(g.key)
            if group is None:
                group = self._open[g.key] = self._open_group(self._session, g, routes, width, waves[-1] is not None)
            pieces += [self._wave(group, rows, *waves) for rows in self._wave_rows(g, waves[1])]
        self._metrics["train"]["prefixflow/wave_size"].append(sum(len(p[0]) for p in pieces) / len(pieces))
        return pieces

    def _check_wave_size(self) -> AutoWaves | None:
        size = self.prefixflow_wave_size
        if size == "auto":
            if self.accelerator.device.type != "cuda":
                raise PrefixFlowError("prefixflow_wave_size='auto' reads free CUDA memory; on "
                                      f"{self.accelerator.device.type} give a number of rows or None.")
            if self.accelerator.num_processes > 1:  # DDP buffers and sharded weights talk in every forward
                raise PrefixFlowError("prefixflow_wave_size='auto' could pick different wave counts on different "
                                      "processes, whose per-forward collectives would then hang; give a number.")
            return AutoWaves()
        if size is not None:
            if not str(size).isdigit() or int(size) < 1:
                raise PrefixFlowError(f"prefixflow_wave_size must be None, 'auto' or a positive integer, got {size!r}.")
            self.prefixflow_wave_size = int(size)
        return None

    def _wave_rows(self, g: BatchGroup, completion_mask: torch.Tensor):
        """A group's rows of this microbatch, wave by wave (any split is exact). TRL backpropagates the microbatch's
        loss once, so its waves' graphs coexist: a smaller wave bounds one forward's working set, not their sum;
        'auto' measures a wave's forward and sizes each wave to the memory free when it starts."""
        if self._auto_waves is None:
            size = self.prefixflow_wave_size or len(g.rows)
            yield from (g.rows[i : i + size] for i in range(0, len(g.rows), size))
            return
        lengths = completion_mask[g.rows].sum(dim=1).tolist()
        for rows in self._auto_waves.waves(lengths, len(g.prefix_ids), completion_mask.device):
            yield [g.rows[i] for i in rows]

    def training_step(self, model, inputs, num_items_in_batch):
        window = zero.inside_window(self.accelerator) if self._deepspeed else contextlib.nullcontext()
        # DDP and FSDP2 accumulate every backward locally; DDP reduces once after Phase C, FSDP2 in its last backward.
        with data_parallel.local_gradients(model), fsdp.local_gradients(model):
            try:
                with window:
                    loss = super().training_step(model, inputs, num_items_in_batch)
            except BaseException as exc:
                self._end_session(exc)
                raise
            start = time.perf_counter()
            if self.accelerator.sync_gradients:
                placement.reduce_gradients(list(self._splits.values()))  # every rank, in the order they opened
                self._end_boundary()  # Phase C for every open group, before the optimizer step
            elif not self._deepspeed and self._sp is None:  # under ZeRO and SP, groups stay open until the boundary
                self._close_groups_not_in_next_microbatch()
            self._metrics["train"]["prefixflow/phase_c_s"].append(time.perf_counter() - start)
        if self.accelerator.sync_gradients:
            data_parallel.all_reduce_gradients(model)
        return loss

    def _open_split_groups(self, model, inputs: dict) -> None:
        """Ranks agree on the groups of this microbatch that several of them hold (an all-gather of its prompt keys)
        and open them, owner first (`placement.open_split`); they stay open until the accumulation boundary."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        local = {g.key: g for g in find_groups(ids, mask, inputs["completion_ids"].shape[1]) if len(g.prefix_ids) > 1}
        holders = placement.holders(local)
        spread = {key: ranks for key, ranks in holders.items() if len(ranks) > 1 or key in self._splits}
        for key, ranks in spread.items():
            if key in self._splits and not set(ranks) <= set(self._splits[key].holders):
                raise PrefixFlowError(
                    f"a group split across processes {self._splits[key].holders} reappeared on processes {ranks} in "
                    "the same accumulation window; its prefix K/V live only on the first. " + _WHOLE_GROUPS)
        if self._session is None:
            self._session = GroupSession(model).__enter__()
        for key in sorted(k for k in spread if k not in self._splits):  # the same order on every rank
            g = local.get(key)
            with self.accelerator.autocast():  # Phase A under the waves' autocast, as in `_open_group`
                self._splits[key] = placement.open_split(self._session, None if g is None else g.prefix_ids,
                                                         spread[key], position_offset=key[0])
        self._metrics["train"]["prefixflow/split_groups"].append(float(sum(len(r) > 1 for r in spread.values())))

    def _end_boundary(self) -> None:
        if not (self._deepspeed or self._fsdp):
            self._end_session()
            return
        session, self._session, self._open = self._session, None, {}
        fsdp.check_same_schedule(self.model, "the prefix groups closing at the boundary",
                                 [len(session.groups) if session else 0])
        fed = 0
        if session is not None:
            try:
                fed = self._reducing_phase_c(session)
            finally:
                session.__exit__(None, None, None)
        if not fed:
            effect = "the engine would not step" if self._deepspeed else "FSDP2 would reduce no gradient"
            raise PrefixFlowError(
                f"no prefix group reached this accumulation boundary, so {effect} (the boundary's Phase C is its "
                "reducing backward). Every microbatch must hold shareable prompts (more than one token); use "
                "GRPOTrainer otherwise."
            )

    def _reducing_phase_c(self, session: GroupSession) -> int:
        """The boundary's Phase C as the engine's reducing backward; returns the tensors that backward fed."""
        if self._deepspeed:
            return session.close(backward=zero.boundary_backward(self.accelerator))
        if not session.groups:
            return 0
        # FSDP2 reduces a unit in each post-backward: one prefix graph reaches each unit once, so close the others
        # unreduced first and let the last one reduce everything, one reduce-scatter per unit.
        *earlier, last = session.groups
        session.close(earlier)
        with fsdp.reducing(self.model):
            return session.close([last])

    def _close_groups_not_in_next_microbatch(self) -> None:
        if self._session is None:
            return
        upcoming = self._next_microbatch()
        keep = set()
        if upcoming is not None:
            ids = torch.cat([upcoming["prompt_ids"], upcoming["completion_ids"]], dim=1)
            mask = torch.cat([upcoming["prompt_mask"], upcoming["completion_mask"]], dim=1)
            keep = {g.key for g in find_groups(ids, mask, upcoming["completion_ids"].shape[1])}
        closing = [key for key in self._open if key not in keep]
        fsdp.check_same_schedule(self.model, "the prefix groups closing after a microbatch", [len(closing)])
        self._session.close([self._open.pop(key) for key in closing])

    def _next_microbatch(self) -> dict | None:
        """The buffered microbatch the next step trains on, unless a new generation comes first."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._buffered_inputs is None or self._step % generate_every == 0:
            return None
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _end_session(self, exc: BaseException | None = None) -> None:
        session, self._session = self._session, None
        self._open, self._splits = {}, {}
        if session is not None:
            session.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)

    # -- metrics -----------------------------------------------------------------------------------------------

    def _count_fallback(self, reason: str, rows: int) -> None:
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["prefixflow/fallback_rows"].append(float(rows))
        if not self._fallbacks[reason]:
            logger.warning("PrefixFlow: rows take the plain GRPO path (%s); counted in prefixflow/fallback_rows.", reason)
        self._fallbacks[reason] += rows

    def _log_groups(self, groups: list[BatchGroup], completion_mask: torch.Tensor, training: bool, seconds: float):
        if not groups:
            return
        mode = "train" if self.model.training else "eval"
        lengths = completion_mask.sum(dim=1).tolist()
        prefix_tokens = sum(len(g.prefix_ids) * len(g.rows) for g in groups)
        suffix_tokens = sum(lengths[r] for g in groups for r in g.rows)
        full = sum(self._shape.full_sequence(len(g.prefix_ids), [lengths[r] for r in g.rows]) for g in groups)
        shared = sum(self._shape.prefixflow(len(g.prefix_ids), [lengths[r] for r in g.rows]) for g in groups)
        prefix = "prefixflow/" if training else "prefixflow/scoring_"
        metrics = self._metrics[mode]
        metrics[prefix + "groups"].append(float(len(groups)))
        metrics[prefix + "prefix_ratio"].append(prefix_tokens / max(prefix_tokens + suffix_tokens, 1))
        metrics[prefix + "tokens_saved"].append(float(sum(len(g.prefix_ids) * (len(g.rows) - 1) for g in groups)))
        metrics[prefix + "flops_saved"].append(1.0 - shared / full)
        metrics[prefix + ("phase_ab_s" if training else "s")].append(seconds)


_WHOLE_GROUPS = ("keep groups whole per process: make per_device_train_batch_size * steps_per_generation a multiple "
                 "of num_generations.")


def _pack(labels: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.cat([row[:n] for row, n in zip(labels, lengths)])[None]


def _unpack(values: torch.Tensor | None, lengths: list[int], width: int) -> torch.Tensor | None:
    if values is None:
        return None
    rows = values[0].split(lengths)
    return torch.stack([torch.nn.functional.pad(row, (0, width - len(row))) for row in rows])

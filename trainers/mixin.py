"""PrefixFlowTrainerMixin: the PrefixFlow machinery a TRL group-sampling trainer (GRPO, RLOO) composes with.

`class PrefixFlowXTrainer(PrefixFlowTrainerMixin, XTrainer)` turns TRL's `XTrainer` into one whose actor update and
scoring passes run each prompt as a prefix group; the config, data, loss, metrics and checkpoints stay TRL's. What
changes: batches are shuffled and split by whole groups instead of rows, and the per-token log-probs come from
prefix groups: a prompt runs forward once (Phase A), its completions run as a suffix wave through TRL's own fused
LM head (Phase B); TRL's loss and backward follow untouched, and the delayed prefix backward (Phase C) runs once
the last microbatch that reads the prompt has been backpropagated, before the optimizer step. Consecutive
microbatches of an accumulation window that share a prompt train as one run: one forward and one backward of all
their rows, each microbatch's loss with TRL's own normaliser and metrics (`_run_loss`). MoE models also
record their routes during generation and replay them (`trainers/routing.py`); under DDP the gradients are reduced
once, after Phase C, and under FSDP2 inside the boundary's Phase C (the engine's rule, chosen once at construction:
`trainers/engine_rule.py`). Under plain DDP a group may straddle processes: its owner's prefix K/V are shared with
the other holders and their gK/gV summed back (`hf_prefixflow/distributed/placement.py`).

The mixin relies on what TRL's GRPO and RLOO trainers share (TRL 1.14.1-1.16): `_prepare_inputs`, `training_step`,
`_get_per_token_logps_and_entropies`, `_compute_loss(model, inputs)`, `_generate(prompts)` returning completion ids
second, and the buffer of `steps_per_generation` microbatches (their private state read through `_compat`). What
differs, the single-turn generation call, the concrete class says (`_turn_completions`, `_turn_generations`).
`PrefixFlowArguments` (`trainers/config.py`) holds the settings; a trainer's config class is
`@dataclass class C(PrefixFlowArguments, XConfig)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from hf_prefixflow import _compat
from hf_prefixflow.core import moe
from hf_prefixflow.planning import defaults
from hf_prefixflow.distributed import placement
from hf_prefixflow.planning.flops import PASS_FLOOR_TOKENS, ModelShape
from hf_prefixflow.core.layouts import padded_segments
from hf_prefixflow.errors import PrefixFlowError
from hf_prefixflow.apply import apply_prefixflow
from hf_prefixflow.core.access import config_of, unwrap
from hf_prefixflow.core.offload import available_host_bytes
from hf_prefixflow.planning.planner import (TokenBytes, keeps_suffix_activations, offload_for, run_need, static_bytes,
                                   token_bytes)
from hf_prefixflow.core.scheduler import STATES_ON_ONE_PROCESS, GroupSession, host_pool
from hf_prefixflow.core.states import has_states
from hf_prefixflow.core.waves import AutoWaves

from . import compiling, engine_rule, multimodal, processing, routing, sequence_parallel
from .config import PrefixFlowArguments, kv_grad_dtype, merge_limit, suffix_policy, wave_size
from .grouping import BatchGroup, BatchIndex, check_geometry, index_batch, shuffle_groups
from .window import OpenWindow

logger = logging.getLogger(__name__)

# The default memory rule's byte model counts recurrent layers as attention layers of the same width; measured on a
# Qwen3.5 shape (benchmarks/results/2026-12-05_qwen3_5_fla) it kept the prompt on the device and peaked above the stock.
UNCALIBRATED_STATES = (
    "PrefixFlow: the default memory rule's byte model is not calibrated on recurrent layers; on a Qwen3.5 shape its "
    "choice peaked 2-3% above the stock trainer's device memory."
    " Leave that margin where the stock trainer fits only just.")


MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                   "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


# The settings the trainer reads as attributes (a plain TRL config: these defaults); prefixflow_sp_size is read where
# sequence parallelism is set up.
DEFAULTS = {f.name: f.default for f in dataclasses.fields(PrefixFlowArguments) if f.name != "prefixflow_sp_size"}


AUTO_OFFLOAD_MARGIN = 0.9  # of the free device memory, what prefixflow_offload_auto plans a run to fill at most


def free_device_bytes(model: torch.nn.Module) -> float:
    """Device bytes a run may still add: free CUDA memory and the allocator's unused cache, less the gradients the
    backward has yet to allocate, times `AUTO_OFFLOAD_MARGIN`; unbounded off CUDA."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return float("inf")
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    pending = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)
    return AUTO_OFFLOAD_MARGIN * (free + cached - pending)


def free_host_bytes(model: torch.nn.Module) -> float | None:
    """Host bytes this process's offload pool may hold: the host memory available (`offload.available_host_bytes`)
    shared among the node's processes (`LOCAL_WORLD_SIZE`), plus the pool's free buffers, times
    `AUTO_OFFLOAD_MARGIN`; None where the OS does not say."""
    available = available_host_bytes()
    if available is None:
        return None
    pool = host_pool(model)
    share = available / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return AUTO_OFFLOAD_MARGIN * (share + (pool.free_bytes if pool is not None else 0))


class PrefixFlowTrainerMixin:
    """Training-time KV caching of each group's shared prompt for a TRL trainer whose batches hold groups of
    `num_generations` completions per prompt: `class PrefixFlowXTrainer(PrefixFlowTrainerMixin, XTrainer)`.

    A concrete class says how its TRL trainer's single-turn generation call reads (`_turn_completions`,
    `_turn_generations`), for MoE routing replay.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rows_once = processing.RowsOnce()  # the processor runs once per distinct row of a batch
        _compat.add_fused_lm_head(self)  # the suffix waves' scoring call (TRL 1.15 on adds it itself)
        self._engine = engine_rule.select(self.accelerator, self.model, type(self).__name__)
        self._check_supported()
        for name, default in DEFAULTS.items():
            setattr(self, name, getattr(self.args, name, default))
        self._auto_waves = self._check_wave_size()
        self._merge_limit = self._check_merge()
        self._suffix_policy = self._check_suffix_checkpointing()
        if self.args.torch_compile:
            self._compile_layers()
        apply_prefixflow(self.model, offload=self.prefixflow_offload, offload_kv=self.prefixflow_offload_kv,
                         prefix_recompute=self.prefixflow_prefix_recompute,
                         suffix_checkpointing=self._suffix_policy is not False, kv_grad_dtype=self._kv_grad_dtype())
        if self.ref_model is not None:
            apply_prefixflow(self.ref_model)
        self._check_states()
        self._shape = ModelShape.from_config(unwrap(self.model).config)
        self._window = OpenWindow()  # this accumulation window's open prefix groups
        self._fallbacks: Counter = Counter()
        self._image_refusal = multimodal.refusal(self)  # if set, image rows take the plain path whatever the batch
        self._group_inputs: dict[tuple, dict] = {}  # image groups' prompt tensors for their Phase A, by group key
        # PrefixFlow reads router logits (for the load-balancing loss) and replays routes of the routers moe.py knows.
        self._known_routers = bool(moe.routers(unwrap(self.model)))
        self._replay = self.prefixflow_routing_replay and self._known_routers
        self._routes: torch.Tensor | str | None = None  # routes of the rows being scored or trained
        self._turns, self._recording = 0, None  # generation's turns (tool calls), its first turn's recording
        if self._replay:
            moe.check_replay_supported(unwrap(self.model))
        # Runs (`_run_loss`): one process or plain DDP, text-only; ZeRO, FSDP2, SP and split groups keep TRL's
        # microbatches, and so does the load-balancing loss, which is not linear in its tokens.
        self._runs = self._engine.merges_runs and not (self._sp is not None or self._split or self.aux_loss_enabled)
        self._generation: BatchIndex | None = None  # the buffered generation batch's groups and lengths
        self._merge_cap = 1  # microbatches per run for the buffered generation
        self._token_bytes: TokenBytes | None = None  # the planner's byte model, for prefixflow_suffix_checkpointing
        self._window_position = 0  # microbatches of this accumulation window already trained
        self._served: tuple | None = None  # a run's log-probs and entropies of the microbatch TRL's loss reads next
        self._follow: list[torch.Tensor] = []  # losses of the current run's microbatches still to come
        self._run_step: str | None = None  # this step's part in a run: "computed" it or "followed" it
        self._after_run: int | None = None  # the buffer position the next run starts at, if in this window
        self._anchor: torch.Tensor | None = None
        if self._split and moe.routers(unwrap(self.model)):
            raise PrefixFlowError("groups split across processes are supported for dense models only (MoE routes and "
                                  "router logits are per rank); " + _WHOLE_GROUPS)

    def _build_accelerator_args(self, **kwargs) -> dict:
        options = super()._build_accelerator_args(**kwargs)
        return compiling.layerwise_accelerator_args(options) if self.args.torch_compile else options

    def _compile_layers(self) -> None:
        if not self._engine.compiles:
            raise PrefixFlowError(f"torch_compile with DeepSpeed or FSDP is not supported by {type(self).__name__} "
                                  "(untested with their hooks); turn torch_compile off, or train with DDP.")
        compiling.compile_decoder_layers([m for m in (self.model, self.ref_model) if m is not None],
                                         self.args.torch_compile_backend, self.args.torch_compile_mode)

    def _kv_grad_dtype(self) -> torch.dtype | None:
        if self.prefixflow_kv_grad_dtype is None:
            return self._engine.kv_grad_dtype
        return kv_grad_dtype(self.prefixflow_kv_grad_dtype)

    def _check_supported(self) -> None:
        plain_ddp = self._engine.can_split and getattr(self.args, "prefixflow_sp_size", 1) == 1
        self._split = check_geometry(self.args.per_device_train_batch_size, self.num_generations,
                                     self.args.steps_per_generation, can_split=plain_ddp)
        self._sp = sequence_parallel.setup(self, getattr(self.args, "prefixflow_sp_size", 1))
        if getattr(self.args, "prefixflow_offload_kv", False) and not (
                self._engine.streams_kv and self._sp is None and not self._split):
            raise PrefixFlowError(
                "prefixflow_offload_kv streams each process's prompt K/V from its own host memory; DeepSpeed, FSDP, "
                "sequence parallelism and groups split across processes shard or send K/V between processes and "
                "do not stream it yet. Use prefixflow_offload=True there, or keep each group's rows on one process.")
        self._engine.check_config(self.model, self.args)
        kwargs = self.args.gradient_checkpointing_kwargs or {}
        if self.args.gradient_checkpointing and kwargs.get("use_reentrant", False):
            raise PrefixFlowError(
                "reentrant activation checkpointing detaches the prefix K/V from the prefix graph. Set "
                "gradient_checkpointing_kwargs={'use_reentrant': False} (TRL's default)."
            )

    def _check_states(self) -> None:
        """Refuse at construction what a model with recurrent layers cannot train exactly (`states`)."""
        if not has_states(unwrap(self.model)):
            return
        if self.prefixflow_layout == "packed":
            raise PrefixFlowError(
                "prefixflow_layout='packed' puts a group's completions end to end in one row, and this model's "
                "recurrent layers would carry one completion's state into the next; use prefixflow_layout='padded'.")
        if self._sp is not None or self._split:
            raise PrefixFlowError(STATES_ON_ONE_PROCESS)

    # -- MoE routing replay: record during generation, carry with the batch -----------------------------------

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        # The compiled layers are for training: a generation cache read by layer index would make each layer a graph
        # of its own and use up torch.compile's recompile limit (`_compile_layers`).
        eager = torch.compiler.set_stance("force_eager") if self.args.torch_compile else contextlib.nullcontext()
        with eager:
            return self._generate_recording_routes(prompt_ids, *args, **kwargs)

    def _generate_recording_routes(self, prompt_ids, *args, **kwargs):
        """TRL's `_generate_single_turn(prompt_ids, *args, **kwargs)`, its output as is; on the first turn of
        transformers generation the routes are recorded into `self._recording` (`routing.record_turn`: routes
        `[B, layers, prompt width + completion width, k]`, or the gap that makes the rows route afresh)."""
        first, self._turns = self._turns == 0, self._turns + 1
        # Recorded: the first turn of transformers generation. Tool calls' later turns run from prompts the recording
        # does not cover, and vLLM or continuous batching route outside this process's routers.
        if not (self._replay and first) or self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        with moe.record_routing() as recorder:
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        # A recording that cannot stand for the rows (a gap) is kept as such: `_generate` lets them route afresh.
        config = unwrap(self.model).config.get_text_config()
        self._recording = routing.record_turn(
            recorder, prompt_ids, self._turn_completions(out), config.num_hidden_layers,
            sorted({layer for layer, _, _ in moe.routers(unwrap(self.model))}),
            self._turn_generations(prompt_ids, *args, **kwargs), config.num_experts_per_tok,
            getattr(self, "pad_to_multiple_of", None))
        return out

    def _turn_completions(self, out) -> list[list[int]]:
        """The completion token ids in the output of the TRL trainer's `_generate_single_turn`."""
        raise NotImplementedError(f"{type(self).__name__} must say where its TRL trainer's `_generate_single_turn` "
                                  "returns the completion ids (`_turn_completions`).")

    def _turn_generations(self, prompt_ids, *args, **kwargs) -> int:
        """Completions per prompt in a call of the TRL trainer's `_generate_single_turn` with these arguments."""
        raise NotImplementedError(f"{type(self).__name__} must say how many completions per prompt its TRL trainer's "
                                  "`_generate_single_turn` generates (`_turn_generations`).")

    def _generate(self, prompts):
        self._turns, self._routes, self._recording = 0, None, None
        out = super()._generate(prompts)
        if self._replay:  # the recording aligned with the rollouts (prompts first, completions second); never raises
            self._routes, fallbacks = routing.for_rollouts(self._recording, out[0], out[1],
                                                           getattr(self, "pad_to_multiple_of", None))
            for reason, rows in fallbacks:
                self._count_fallback(reason, rows)
        self._recording = None
        return out

    def _generate_and_score_completions(self, inputs):
        with self._rows_once.applied(self):
            batch = super()._generate_and_score_completions(inputs)  # scoring passes inside use self._routes
        if self._replay:
            routes, width = self._routes, batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
            if routes is not routing.UNRECORDED and (routes is None or routes.shape[0] != batch["prompt_ids"].shape[0]
                                                     or routes.shape[2] != width):
                self._count_fallback(f"{routing.FALLBACK}: the recorded routes do not match the generated batch; it "
                                     "routes afresh", batch["prompt_ids"].shape[0])
                routes = routing.UNRECORDED
            batch[routing.BATCH_KEY] = None if routes is routing.UNRECORDED else routes
        self._routes = None
        return batch

    def _compute_loss(self, model, inputs):
        actor_update = model.training and torch.is_grad_enabled()
        if actor_update and self._runs and not any(inputs.get(key) is not None for key in MULTIMODAL_KEYS):
            return self._run_loss(model, inputs)
        self._routes = _batch_routes(inputs)
        if self._split and actor_update:
            self._open_split_groups(model, inputs)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._routes = None

    def _rows_routes(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        if not self._replay or self._routes is routing.UNRECORDED:
            return None
        routes = self._routes
        if routes is None or routes.shape[0] != input_ids.shape[0] or routes.shape[2] != input_ids.shape[1]:
            self._count_fallback(f"{routing.FALLBACK}: no recorded routes match this forward's rows; they route afresh",
                                 input_ids.shape[0])
            return None
        return routes.to(input_ids.device)

    # -- data flow: whole groups ------------------------------------------------------------------------------

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if _compat.trl_step(self) % generate_every == 0 or _compat.buffered_inputs(self) is None:
            batch = split_pixel_values_by_grid(self._generate_and_score_completions(generation_batch))
            # The stock trainer shuffles rows here. This process's rows start `offset` rows into their group.
            offset = self.accelerator.process_index * len(batch["prompt_ids"]) % self.num_generations
            batch = shuffle_groups(batch, self.num_generations, offset=offset)
            chunks = split_tensor_dict(batch, self.args.steps_per_generation)
            _compat.set_buffered_inputs(self, [unsplit_pixel_values_by_grid(chunk) for chunk in chunks])
            self._index_generation(batch)
        return _compat.buffered_inputs(self)[_compat.trl_step(self) % self.args.steps_per_generation]

    def _index_generation(self, batch: dict) -> None:
        """The buffered generation's groups and completion lengths, read on the host once, and how many
        microbatches a run may merge ('auto': while a run's completion tokens fit in one microbatch's full
        sequences, so Phase B holds no more activations than the stock trainer's microbatch)."""
        self._generation = index_batch(torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
                                       torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
                                       batch["completion_ids"].shape[1])
        self._stock_widths = (batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1])  # the stock's padding
        if not self._runs:
            return
        prompt, completion = batch["prompt_ids"].shape[1], max(batch["completion_ids"].shape[1], 1)
        cap = (prompt + completion) // completion if self._merge_limit is None else self._merge_limit
        cap = self._stock_merge_cap(cap)
        if self.accelerator.num_processes > 1:  # every process runs the same schedule (DDP's forwards talk)
            shared = torch.tensor(cap, device=self.accelerator.device)
            dist.all_reduce(shared, op=dist.ReduceOp.MIN)
            cap = int(shared)
        self._merge_cap = cap

    def _microbatch_index(self, position: int) -> BatchIndex:
        size = self.args.per_device_train_batch_size
        return self._generation.rows_in(position * size, (position + 1) * size)

    # -- runs: several microbatches, one forward and one backward ------------------------------------------------

    def _run_loss(self, model, inputs):
        """TRL's loss of this microbatch. The first microbatch of a run computes the log-probs of every row of the
        run in one forward (a group's rows of all its microbatches in one wave), then TRL's loss of each microbatch
        with that microbatch's own normaliser and metrics, and returns a loss whose value is its own and whose
        gradient is the run's sum: one backward. The run's other microbatches return their losses, their gradients
        already accumulated."""
        if self._follow:
            self._run_step = "followed"
            if self._anchor is None:
                self._anchor = torch.zeros((), device=self.accelerator.device, requires_grad=True)
            return self._follow.pop(0) + 0 * self._anchor  # a backward that touches no parameter
        position = _compat.trl_step(self) % self.args.steps_per_generation
        run = _compat.buffered_inputs(self)[position : position + self._run_length(position)]
        if run[0] is not inputs:
            raise PrefixFlowError("internal: the microbatch TRL trains is not the buffered one the run starts with.")
        logps, entropies = self._run_logps(model, run, position)
        losses = self._microbatch_losses(model, run, logps, entropies)
        window_goes_on = self._window_position + len(run) < self.current_gradient_accumulation_steps
        self._after_run = self._position_at(_compat.trl_step(self) + len(run)) if window_goes_on else None
        self._run_step = "computed"
        self._metric("prefixflow/run_microbatches", float(len(run)))
        self._follow = [loss.detach() for loss in losses[1:]]
        if not self._follow:
            return losses[0]
        rest = torch.stack(losses[1:]).sum()
        return losses[0] + (rest - rest.detach())  # the value stays this microbatch's, exactly

    def _run_length(self, position: int) -> int:
        """Microbatches from buffer `position` that train as one run: within the accumulation window and the
        buffered generation, up to the merge cap, and only while the run's last microbatch ends inside a group
        (a process's groups start at multiples of num_generations): merging whole groups saves nothing."""
        window_left = self.current_gradient_accumulation_steps - self._window_position
        limit = min(window_left, self.args.steps_per_generation - position, self._merge_cap)
        length = 1
        while length < limit and (position + length) * self.args.per_device_train_batch_size % self.num_generations:
            length += 1
        return length

    def _run_logps(self, model, run: list[dict], position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies of every row of a run: each group's rows of all its microbatches in one wave."""
        keys = ("prompt_ids", "completion_ids", "prompt_mask", "completion_mask")
        prompt_ids, completion_ids, prompt_mask, completion_mask = (torch.cat([mb[k] for mb in run]) for k in keys)
        routes = [_batch_routes(mb) for mb in run]
        self._routes = torch.cat(routes) if isinstance(routes[0], torch.Tensor) else routes[0]
        size = self.args.per_device_train_batch_size
        index = self._generation.rows_in(position * size, (position + len(run)) * size)
        try:
            logps, entropies, _ = self._logps(model, torch.cat([prompt_ids, completion_ids], dim=1),
                                              torch.cat([prompt_mask, completion_mask], dim=1),
                                              completion_ids.shape[1], compute_entropy=True, index=index)
        finally:
            self._routes = None
        return logps, entropies

    def _microbatch_losses(self, model, run: list[dict], logps: torch.Tensor,
                           entropies: torch.Tensor) -> list[torch.Tensor]:
        """TRL's loss of each microbatch of a run, read from the run's log-probs. TRL's end-of-window work (the
        adaptive entropy controller, the entropy_coef metric) runs with the window's last microbatch, as stock."""
        sizes = [len(mb["completion_ids"]) for mb in run]
        ends_window = self._window_position + len(run) == self.current_gradient_accumulation_steps
        sync = self.accelerator.sync_gradients
        losses = []
        try:
            for index, (mb, served) in enumerate(zip(run, zip(logps.split(sizes), entropies.split(sizes)))):
                if len(run) > 1:
                    _compat.set_sync_gradients(self.accelerator, ends_window and index == len(run) - 1)
                self._served = served
                losses.append(super(PrefixFlowTrainerMixin, self)._compute_loss(model, mb))
        finally:
            _compat.set_sync_gradients(self.accelerator, sync)
            self._served = None
        return losses

    # -- log-probs through prefix groups ----------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        if self._served is not None:  # a microbatch of a run: its rows' values were computed with the run's
            (logps, entropies), self._served = self._served, None
            if logps.shape[0] != input_ids.shape[0]:
                raise PrefixFlowError("internal: a run served log-probs of another microbatch.")
            return logps, (entropies if compute_entropy else None), None
        if self._sp is not None:  # Ulysses: the SP group pools its rows and runs them sharded
            if any(extra.get(key) is not None for key in MULTIMODAL_KEYS) or compute_aux_loss:
                raise PrefixFlowError("sequence parallelism supports text-only dense models; multimodal inputs and "
                                      "MoE auxiliary losses are not sharded yet.")
            return sequence_parallel.logps(self._window, self._sp, self.accelerator.autocast, model, input_ids,
                                          attention_mask, logits_to_keep, compute_entropy)
        return self._logps(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                           compute_aux_loss, **extra)

    def _logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
               compute_aux_loss=False, index: BatchIndex | None = None, **extra):
        """Log-probs (entropies, load-balancing loss) of a batch: groups worth sharing as prefix groups, the other
        rows on TRL's plain path. `index`: the batch's groups and lengths when the host knows them already."""
        routes = self._rows_routes(input_ids)

        def plain(rows):
            ids, mask = _take(input_ids, rows), _take(attention_mask, rows)
            if routes is not None:
                return routing.plain_logps(self, model, ids, mask, logits_to_keep, _take(routes, rows),
                                           compute_entropy, compute_aux_loss)
            return super(PrefixFlowTrainerMixin, self)._get_per_token_logps_and_entropies(
                model, ids, mask, logits_to_keep, batch_size=batch_size, compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss, **multimodal.plain_kwargs(extra, rows, input_ids.shape[0]))

        training = torch.is_grad_enabled()
        reason = self._plain_path_reason(extra, training, compute_aux_loss)
        if reason and training and self._split:
            raise PrefixFlowError(f"{reason} cannot train groups split across processes; " + _WHOLE_GROUPS)
        shared, fallback = [], []
        if not reason:
            index = index or index_batch(input_ids, attention_mask, logits_to_keep)
            if multimodal.present(extra):  # image rows: groups told apart by their images too
                index, self._group_inputs, reason = multimodal.image_groups(self, index, input_ids, logits_to_keep,
                                                                            extra, self._window.open_groups)
        if not reason:
            # The load-balancing loss spans the microbatch, and an engine may need a group at every boundary or the
            # same forwards on every rank (`EngineRule.every_group`): then every group with a prompt to share is shared.
            every_group = compute_aux_loss or self._engine.every_group(training)
            split = self._window.splits if training else {}
            shared, fallback = self._choose(index, every_group=every_group, split=split)
            if compute_aux_loss and fallback:  # the load-balancing loss spans the whole microbatch: one path for all
                reason = "router auxiliary loss with a one-token prompt"
        fresh = sum(g.key not in self._window.open_groups for g in shared) if training else len(shared)
        # Before any forward: under FSDP2 a rank taking another path would mismatch the others' collectives.
        schedule = [1, 0, 0, 0] if reason else [0, fresh, sum(len(g.rows) for g in shared), int(bool(fallback))]
        self._engine.check_same_schedule(
            model, "a microbatch's paths, prefix forwards, suffix-wave rows and plain forwards", schedule)
        if reason:
            self._count_fallback(reason, input_ids.shape[0])
            return plain(list(range(input_ids.shape[0])))
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
            waves = WaveInputs(completions, completion_mask, suffix_routes, index.lengths, compute_entropy, aux_parts)
            if training:
                pieces += self._training_waves(model, shared, routes, width, waves)
            else:
                with GroupSession(model) as session:
                    pieces += [self._wave(self._open_group(session, g, routes, width, aux_parts is not None), g.rows,
                                          waves) for g in shared]
        self._log_groups(shared, index.lengths if shared else [], training, time.perf_counter() - start)
        order = [r for rows, _, _ in pieces for r in rows]
        logps = _in_order(torch.cat([p[1] for p in pieces]), order)
        entropies = _in_order(torch.cat([p[2] for p in pieces]), order) if compute_entropy else None
        aux = None
        if aux_parts is not None:
            config = unwrap(self.model).config.get_text_config()
            aux = moe.load_balancing_loss(aux_parts, config.num_experts, config.num_experts_per_tok)
        return logps, entropies, aux

    def _plain_path_reason(self, extra: dict, training: bool, compute_aux_loss: bool) -> str | None:
        if any(extra.get(key) is not None for key in MULTIMODAL_KEYS):
            if self._replay:
                raise PrefixFlowError("MoE routing replay with multimodal inputs is not supported; set "
                                      "prefixflow_routing_replay=False.")
            if self._image_refusal:
                return self._image_refusal
        if not training and not self.prefixflow_scoring:
            return "prefixflow_scoring=False"
        if compute_aux_loss and not self._known_routers:
            return ("router auxiliary loss of a router whose logits PrefixFlow does not read (Qwen3-MoE and Mixtral "
                    "routers; others: hf_prefixflow.core.moe.register_router)")
        return None

    def _choose(self, index: BatchIndex, every_group: bool = False, split: dict | None = None):
        """Groups worth sharing (in row order), and the rows that train on the plain path (the FLOP model's verdict,
        unless `every_group`: then only one-token prompts, which leave nothing to share). Groups split across
        processes (keys in `split`) are always shared: their other holders read this rank's K/V or send it gK/gV."""
        shared, fallback = [], []
        for group in sorted(index.groups, key=lambda g: g.rows[0]):
            pays = self._shape.pays(len(group.prefix_ids), [index.lengths[r] for r in group.rows],
                                    self.prefixflow_min_speedup, self.args.per_device_train_batch_size,
                                    PASS_FLOOR_TOKENS if self.accelerator.device.type == "cuda" else 0)
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
                                collect_router_logits=collect_router_logits, **self._group_inputs.get(group.key, {}))

    def _wave(self, group, rows: list[int], waves: WaveInputs):
        """One suffix wave of `rows` through TRL's fused LM head; log-prob `t` scores completion token `t`."""
        ids, mask = _take(waves.completions, rows), _take(waves.completion_mask, rows)
        labels = ids.masked_fill(mask == 0, -100)
        routes = None if waves.suffix_routes is None else _take(waves.suffix_routes, rows).transpose(0, 1).long()
        compute_entropy, lengths = waves.compute_entropy, waves.lengths
        if waves.aux_parts is not None:
            return rows, *self._wave_with_router_logits(group, ids, mask, labels, routes, compute_entropy,
                                                        waves.aux_parts)
        with self.accelerator.autocast():
            if self.prefixflow_layout == "packed":
                real = [max(lengths[r], 1) for r in rows]
                suffixes = [row[:n] for row, n in zip(ids, real)]
                per_suffix = None if routes is None else [routes[:, i, :n] for i, n in enumerate(real)]
                out = group.packed(suffixes, routes=per_suffix, shift_labels=_pack(labels, real),
                                   fused_lm_head=True).raw
                logps, entropy = _unpack(out.log_probs, real, ids.shape[1]), _unpack(out.entropy, real, ids.shape[1])
            else:
                out = group.run_wave(_padded_wave(group, ids, mask, routes), shift_labels=labels, fused_lm_head=True)
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
            wave = _padded_wave(group, ids, mask, routes)
            wave.router_logits = {}
            out = group.run_wave(wave, shift_labels=labels, fused_lm_head=True)
        count = float(len(ids))
        aux_parts.append(({l: t.leaf for l, t in group.cache.router_logits.items()},
                          torch.full((group.cache.prefix_length,), count, device=ids.device)))
        aux_parts.append((wave.router_logits, (wave.segment_ids >= 0).reshape(-1)))
        entropy = out.entropy[:, :-1] if compute_entropy else None
        return out.log_probs[:, :-1], entropy

    # -- the actor update: groups live across the microbatches of one accumulation window ----------------------

    def _training_waves(self, model, groups: list[BatchGroup], routes, width: int, waves: WaveInputs):
        window, pieces = self._window, []
        session = window.started(model)
        if self.prefixflow_offload_auto:
            opening = [g for g in groups if g.key not in window.open_groups and g.key not in window.splits]
            self._choose_offload(model, opening, waves.completions.shape[1])
        elif self._stock_rule:
            self._choose_under_stock(model, groups, waves.completions.shape[1])
        checkpointed = self._suffix_checkpointed(model, groups, waves.completions.shape[1])
        for g in groups:
            split = window.splits.get(g.key)
            group = split.group if split is not None else window.open_groups.get(g.key)
            if group is None:
                group = self._open_group(session, g, routes, width, waves.aux_parts is not None)
                window.open_groups[g.key] = group
            # A group streaming its K/V (opened by an earlier run under prefixflow_offload_auto) never keeps its
            # waves' activations: they would hold every layer's K/V through the wave.
            group.suffix_checkpointing = True if checkpointed is False and group.cache.host is not None \
                else checkpointed
            pieces += [self._wave(group, rows, waves) for rows in self._wave_rows(g, waves.lengths, waves.device)]
        self._metric("prefixflow/wave_size", sum(len(p[0]) for p in pieces) / len(pieces))
        return pieces

    def _check_wave_size(self) -> AutoWaves | None:
        size = wave_size(self.prefixflow_wave_size)
        if size == "auto":
            if self.accelerator.device.type != "cuda":
                raise PrefixFlowError("prefixflow_wave_size='auto' reads free CUDA memory; on "
                                      f"{self.accelerator.device.type} give a number of rows or None.")
            if self.accelerator.num_processes > 1:  # DDP buffers and sharded weights talk in every forward
                raise PrefixFlowError("prefixflow_wave_size='auto' could pick different wave counts on different "
                                      "processes, whose per-forward collectives would then hang; give a number.")
            return AutoWaves()
        self.prefixflow_wave_size = size
        return None

    def _check_suffix_checkpointing(self) -> bool | str:
        """The suffix-checkpointing policy: True, False or 'auto' (`_suffix_checkpointed`)."""
        policy = suffix_policy(self.prefixflow_suffix_checkpointing)
        # Nothing to suspend; checkpoint wrappers transformers' switch does not reach; or engines whose recompute
        # runs collectives (ZeRO-3 and FSDP gather weights in its forward, Ulysses exchanges heads), which every
        # rank must then run alike while "auto" decides from each rank's own rows.
        # With prefixflow_offload_kv, kept activations would hold every layer's K/V on the device through a wave.
        if policy == "auto" and (not self.args.gradient_checkpointing or not self._engine.rank_local_recompute
                                 or self._sp is not None or self.prefixflow_offload_kv
                                 or any(type(m).__name__ == "CheckpointWrapper" for m in self.model.modules())):
            return True
        return policy

    def _planner_tokens(self, model) -> TokenBytes:
        """The planner's byte model of the trained model, built once."""
        if self._token_bytes is None:
            # TRL 1.15 on scores through its fused head (no logits tensor); 1.14 through the model's logits
            self._token_bytes = token_bytes(unwrap(model),
                                            scoring="fused" if _compat.trl_fused_lm_head() else "logits")
        return self._token_bytes

    def _choose_offload(self, model, opening: list[BatchGroup], completion_width: int) -> None:
        """prefixflow_offload_auto: the offload mode the groups this run opens get (`planner.offload_for`), from
        the device memory free now less the gradients not yet allocated, and the host memory available to the pool;
        groups already open keep theirs."""
        if not opening:
            return
        offload, kv = offload_for(self._planner_tokens(model), [len(g.prefix_ids) for g in opening],
                                  completion_width, [len(g.rows) for g in opening], free_device_bytes(model),
                                  self._checkpointing_policy(), self.prefixflow_prefix_recompute,
                                  allow_kv=self._engine.streams_kv and self._sp is None and not self._split,
                                  host_budget=free_host_bytes(model))
        apply_prefixflow(model, offload=offload, offload_kv=kv)
        self._metric("prefixflow/offload", float(offload) + float(kv))

    def _suffix_checkpointed(self, model, groups: list[BatchGroup], completion_width: int) -> bool | None:
        """Whether this run's suffix waves recompute their activations in the backward. 'auto': not while keeping
        them fits in the memory TRL's microbatch of full sequences needs under the same checkpointing
        (`planner.keeps_suffix_activations`); the prompt freed that memory. Never under offload_kv, nor where
        prefixflow_offload_auto offloaded or found no room for them. Logged as prefixflow/suffix_checkpointing."""
        if self._suffix_policy != "auto":
            return None
        config = config_of(unwrap(model))
        # With offload_kv kept activations would hold every layer's K/V through a wave; prefixflow_offload_auto
        # planned the run's waves recomputing where it offloaded or where keeping them would not fit.
        tight = config.offload_kv or (self.prefixflow_offload_auto and (
            config.offload or not self._keeping_fits(model, groups, completion_width)))
        keep = not tight and keeps_suffix_activations(
            self._planner_tokens(model), [len(g.prefix_ids) for g in groups], completion_width,
            [len(g.rows) for g in groups], self.args.per_device_train_batch_size, offload=config.offload,
            share=config.recompute_share)
        self._metric("prefixflow/suffix_checkpointing", float(not keep))
        return not keep

    def _keeping_fits(self, model, groups: list[BatchGroup], completion_width: int) -> bool:
        """prefixflow_offload_auto: whether the run's waves keeping their activations fits the free device memory
        (`planner.run_need`; the state of groups already open is allocated and counted again: conservative)."""
        need = run_need(self._planner_tokens(model), [len(g.prefix_ids) for g in groups], completion_width,
                        [len(g.rows) for g in groups], self._checkpointing_policy(),
                        prefix_recompute=self.prefixflow_prefix_recompute, suffix_checkpointing=False)
        return need <= free_device_bytes(model)

    @property
    def _stock_rule(self) -> bool:
        """The default memory rule (`hf_prefixflow/defaults.py`): prefixflow_offload and prefixflow_offload_kv unset,
        prefixflow_offload_auto off, one process or DDP without split groups (elsewhere groups stay open across
        microbatches or K/V moves between processes, which the run's plan does not model)."""
        return (self.prefixflow_offload is None and self.prefixflow_offload_kv is None
                and not self.prefixflow_offload_auto
                and self._engine.stock_rule and self._sp is None and not self._split)

    def _stock_choice_kwargs(self, model) -> dict:
        if getattr(self, "_stock_static", None) is None:  # weights and gradients, for the rule's margin
            self._stock_static = static_bytes(unwrap(model))
        return dict(prefix_recompute=self.prefixflow_prefix_recompute, static=self._stock_static,
                    suffix_checkpointing=self._suffix_policy is not False, host_budget=free_host_bytes(model))

    def _stock_merge_cap(self, cap: int) -> int:
        """The default memory rule with prefixflow_merge_microbatches='auto': the longest run up to `cap` whose
        planned need fits the stock microbatch's (`defaults.merge_cap`); `cap` otherwise. Logged when it changes."""
        if not self._stock_rule or self._merge_limit is not None:
            return cap
        (prompt, completion), model = self._stock_widths, self.model
        batch, completion = self.args.per_device_train_batch_size, max(completion, 1)
        floor = PASS_FLOOR_TOKENS if self.accelerator.device.type == "cuda" else 0
        sharing = [m for m in range(1, cap + 1) if self._shape.pays(  # as `_choose` rules on a run's groups
            prompt, [completion] * min(m * batch, self.num_generations), self.prefixflow_min_speedup, batch, floor)]
        if not sharing:  # every run trains on the plain path, as the stock trainer does
            return cap
        fitted = defaults.merge_cap(self._planner_tokens(model), prompt, completion, batch, self.num_generations,
                                    cap, self._checkpointing_policy(), min_microbatches=sharing[0],
                                    **self._stock_choice_kwargs(model))
        if fitted != getattr(self, "_stock_cap_logged", cap):
            logger.info("PrefixFlow: runs merge at most %d microbatches (of %d) so that a run plans no more device "
                        "memory than the stock trainer's microbatch (%d / %d tokens).", fitted, cap, prompt, completion)
        self._stock_cap_logged = fitted
        return fitted

    def _choose_under_stock(self, model, groups: list[BatchGroup], completion_width: int) -> None:
        """The default memory rule: the groups this run opens get the cheapest setting (`defaults.SETTINGS`) under
        which the run plans no more device memory than the stock trainer's microbatch of the same generation batch
        (`defaults.choose`; groups already open keep theirs). Logged as prefixflow/offload_mode (the setting's index in
        `defaults.SETTING_NAMES`) and in an info line whenever it changes."""
        if all(g.key in self._window.open_groups for g in groups):
            return
        tokens = self._planner_tokens(model)
        budget = defaults.stock_need(tokens, *self._stock_widths, self.args.per_device_train_batch_size,
                                     self._checkpointing_policy())
        choice = defaults.choose(tokens, [len(g.prefix_ids) for g in groups], completion_width,
                                 [len(g.rows) for g in groups], budget, self._checkpointing_policy(),
                                 **self._stock_choice_kwargs(model))
        setting = choice.setting
        apply_prefixflow(model, dataclasses.replace(config_of(unwrap(model)), offload=setting.offload,
                                                    offload_kv=setting.offload_kv,
                                                    prefix_recompute=setting.prefix_recompute))
        self._metric("prefixflow/offload_mode", setting.code)
        if setting.name != getattr(self, "_stock_mode_logged", None):
            logger.log(logging.INFO if choice.fits else logging.WARNING,
                       "PrefixFlow: prompts held as %r (prefixflow/offload_mode %d): planned %.2f GiB against the "
                       "stock trainer's microbatch %.2f GiB (static state aside)%s.", setting.name, setting.code,
                       choice.need / 2**30, budget / 2**30, "" if choice.fits else "; no setting fits, least taken")
            self._stock_mode_logged = setting.name
        if getattr(self, "_warn_uncalibrated", None) is None and has_states(unwrap(model)):  # one model walk
            logger.warning(UNCALIBRATED_STATES)
        self._warn_uncalibrated = False

    def _checkpointing_policy(self) -> str:
        return "full" if self.args.gradient_checkpointing else "none"

    def _check_merge(self) -> int | None:
        """The microbatches a run may merge: None for 'auto' (`_index_generation`), else the given cap."""
        return merge_limit(self.prefixflow_merge_microbatches)

    def _wave_rows(self, g: BatchGroup, lengths: list[int], device: torch.device):
        """A group's rows of this microbatch (or run), wave by wave (any split is exact). They backpropagate
        together, so their waves' graphs coexist: a smaller wave bounds one forward's working set, not their sum;
        'auto' measures a wave's forward and sizes each wave to the memory free when it starts."""
        if self._auto_waves is None:
            size = self.prefixflow_wave_size or len(g.rows)
            yield from (g.rows[i : i + size] for i in range(0, len(g.rows), size))
            return
        for rows in self._auto_waves.waves([lengths[r] for r in g.rows], len(g.prefix_ids), device):
            yield [g.rows[i] for i in rows]

    def training_step(self, model, inputs, num_items_in_batch):
        # DDP and FSDP2 accumulate every backward locally; DDP reduces once after Phase C, FSDP2 in its last backward.
        with self._engine.accumulating(model):
            try:
                with self._engine.microbatch():
                    loss = super().training_step(model, inputs, num_items_in_batch)
            except BaseException as exc:
                self._end_session(exc)
                self._window_position = 0
                raise
            start = time.perf_counter()
            if self.accelerator.sync_gradients:
                placement.reduce_gradients(list(self._window.splits.values()))  # every rank, in the order they opened
                self._end_boundary()  # Phase C for every open group, before the optimizer step
            elif self._run_step == "computed":  # Phase C for the run's groups that the next run does not read
                self._close_groups_not_in(self._after_run)
            elif self._run_step is None and self._engine.closes_after_microbatch and self._sp is None:
                # under ZeRO and SP, groups stay open
                self._close_groups_not_in(self._position_at(_compat.trl_step(self)))
            self._metric("prefixflow/phase_c_s", time.perf_counter() - start)
            self._log_host_pool(model)
        self._run_step = None
        self._window_position = 0 if self.accelerator.sync_gradients else self._window_position + 1
        if self.accelerator.sync_gradients:
            self._engine.reduce(model)
        return loss

    def _log_host_pool(self, model) -> None:
        """Offload's host memory (prefixflow/host_pool_gib) and the buffers it took from torch's pinned allocator
        because page-locking in place failed (prefixflow/pin_fallbacks)."""
        pool = host_pool(model)
        if pool is not None:
            self._metric("prefixflow/host_pool_gib", pool.allocated_bytes / 2**30)
            self._metric("prefixflow/pin_fallbacks", float(pool.pin_fallbacks))

    def _open_split_groups(self, model, inputs: dict) -> None:
        """Ranks agree on the groups of this microbatch that several of them hold (an all-gather of its prompt keys)
        and open them, owner first (`placement.open_split`); they stay open until the accumulation boundary."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        groups = index_batch(ids, mask, inputs["completion_ids"].shape[1]).groups
        local = {g.key: g for g in groups if len(g.prefix_ids) > 1}
        holders = placement.holders(local)
        splits = self._window.splits
        spread = {key: ranks for key, ranks in holders.items() if len(ranks) > 1 or key in splits}
        for key, ranks in spread.items():
            if key in splits and not set(ranks) <= set(splits[key].holders):
                raise PrefixFlowError(
                    f"a group split across processes {splits[key].holders} reappeared on processes {ranks} in "
                    "the same accumulation window; its prefix K/V live only on the first. " + _WHOLE_GROUPS)
        session = self._window.started(model)
        for key in sorted(k for k in spread if k not in splits):  # the same order on every rank
            g = local.get(key)
            with self.accelerator.autocast():  # Phase A under the waves' autocast, as in `_open_group`
                splits[key] = placement.open_split(session, None if g is None else g.prefix_ids,
                                                         spread[key], position_offset=key[0])
        self._metric("prefixflow/split_groups", float(sum(len(r) > 1 for r in spread.values())))

    def _end_boundary(self) -> None:
        """Phase C for every group still open, as the engine's rule closes an accumulation window."""
        self._engine.end_window(self.model, self._forget_window(), f"{self._name}Trainer")

    def _close_groups_not_in(self, position: int | None) -> None:
        """Phase C for the open groups that the buffered microbatch at `position` (None: none) does not read."""
        window = self._window
        if window.session is None:
            return
        keep = set() if position is None else {g.key for g in self._microbatch_index(position).groups}
        # an image group's key: prompt key + number
        closing = [key for key in window.open_groups if key[:2] not in keep]
        self._engine.check_same_schedule(self.model, "the prefix groups closing after a microbatch", [len(closing)])
        window.session.close([window.open_groups.pop(key) for key in closing])

    def _position_at(self, step: int) -> int | None:
        """The buffer position TRL's microbatch `step` trains, unless a new generation comes first (None)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        if _compat.buffered_inputs(self) is None or step % generate_every == 0:
            return None
        return step % self.args.steps_per_generation

    def _end_session(self, exc: BaseException | None = None) -> None:
        session = self._forget_window()
        if session is not None:
            session.finish(exc)

    def _forget_window(self) -> GroupSession | None:
        """A new accumulation window and no run in progress; returns the old window's session."""
        session, self._window = self._window.session, OpenWindow()
        self._follow, self._served, self._run_step = [], None, None
        return session

    # -- metrics -----------------------------------------------------------------------------------------------

    def _metric(self, name: str, value: float, mode: str = "train") -> None:
        """One value of a metric TRL logs as its mean over the logging step."""
        _compat.trl_metrics(self, mode)[name].append(value)

    def _count_fallback(self, reason: str, rows: int) -> None:
        mode = "train" if self.model.training else "eval"
        self._metric("prefixflow/fallback_rows", float(rows), mode)
        afresh = reason.startswith(routing.FALLBACK)  # MoE rows that route afresh instead of replaying generation's
        if afresh:
            self._metric("prefixflow/routing_fallbacks", float(rows), mode)
        if not self._fallbacks[reason] and afresh:
            logger.warning("PrefixFlow: %s; counted in prefixflow/routing_fallbacks and fallback_rows.", reason)
        elif not self._fallbacks[reason]:
            logger.warning("PrefixFlow: rows take the plain %s path (%s); counted in prefixflow/fallback_rows.",
                           self._name, reason)
        self._fallbacks[reason] += rows

    def _log_groups(self, groups: list[BatchGroup], lengths: list[int], training: bool, seconds: float):
        if not groups:
            return
        mode = "train" if self.model.training else "eval"
        prefix_tokens = sum(len(g.prefix_ids) * len(g.rows) for g in groups)
        suffix_tokens = sum(lengths[r] for g in groups for r in g.rows)
        full = sum(self._shape.full_sequence(len(g.prefix_ids), [lengths[r] for r in g.rows]) for g in groups)
        shared = sum(self._shape.prefixflow(len(g.prefix_ids), [lengths[r] for r in g.rows]) for g in groups)
        prefix = "prefixflow/" if training else "prefixflow/scoring_"
        metrics = _compat.trl_metrics(self, mode)
        metrics[prefix + "groups"].append(float(len(groups)))
        metrics[prefix + "prefix_ratio"].append(prefix_tokens / max(prefix_tokens + suffix_tokens, 1))
        metrics[prefix + "tokens_saved"].append(float(sum(len(g.prefix_ids) * (len(g.rows) - 1) for g in groups)))
        metrics[prefix + "flops_saved"].append(1.0 - shared / full)
        metrics[prefix + ("phase_ab_s" if training else "s")].append(seconds)


_WHOLE_GROUPS = ("keep groups whole per process: make per_device_train_batch_size * steps_per_generation a multiple "
                 "of num_generations.")


@dataclass(frozen=True)
class WaveInputs:
    """What every suffix wave of a batch takes its rows from: the completions and their mask `[B, C]`, their
    recorded routes (`[B, layers, C, k]`, None: routed afresh), each row's completion length, whether entropies are
    wanted, and the router-logit parts the load-balancing loss collects (None: not computed; waves append)."""

    completions: torch.Tensor
    completion_mask: torch.Tensor
    suffix_routes: torch.Tensor | None
    lengths: list[int]
    compute_entropy: bool
    aux_parts: list | None

    @property
    def device(self) -> torch.device:
        return self.completion_mask.device


def _pack(labels: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.cat([row[:n] for row, n in zip(labels, lengths)])[None]


def _unpack(values: torch.Tensor | None, lengths: list[int], width: int) -> torch.Tensor | None:
    if values is None:
        return None
    rows = values[0].split(lengths)
    return torch.stack([torch.nn.functional.pad(row, (0, width - len(row))) for row in rows])


def _batch_routes(inputs: dict) -> torch.Tensor | str | None:
    """A microbatch's recorded routes: `routing.UNRECORDED` if it was generated without recording, None if absent."""
    if routing.BATCH_KEY in inputs and inputs[routing.BATCH_KEY] is None:
        return routing.UNRECORDED
    return inputs.get(routing.BATCH_KEY)


def _take(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`tensor[rows]` without waiting for the device: a view of consecutive rows, else an index sent from pinned
    memory (a list index would be copied synchronously)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return tensor[rows[0] : rows[0] + len(rows)]
    index = torch.tensor(rows, pin_memory=tensor.is_cuda).to(tensor.device, non_blocking=True)
    return tensor.index_select(0, index)


def _in_order(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """`values`, whose rows are the batch rows `order` (a permutation), back in batch order."""
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return _take(values, inverse)


def _padded_wave(group, ids: torch.Tensor, mask: torch.Tensor, routes: torch.Tensor | None):
    """`group.padded_wave(ids, mask, routes)` for a mask the host has checked right-padded (`index_batch`): the
    device-side check, one synchronisation per wave, is skipped."""
    wave = group.padded_wave(ids, None, routes)
    wave.segment_ids = padded_segments(mask)
    return wave

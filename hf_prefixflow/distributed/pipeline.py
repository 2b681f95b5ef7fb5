"""Pipeline parallelism: every stage switches phases on its own; Phase B is torch's 1F1B over suffix waves.

A stage holds a contiguous run of decoder layers, the embeddings on the first stage, the final norm and LM head on
the last. For one group (paper section 4.6, stage-local phase switching):
- Phase A: the prefix's hidden states go forward stage by stage (send/recv); each stage caches its own layers' K/V
  and keeps its prefix graph, then starts Phase B at once, with no barrier across stages.
- Phase B: the suffix waves are microbatches of `torch.distributed.pipelining.Schedule1F1B`. K/V caches are
  stage-local, so reuse does not depend on how many microbatches the pipeline runs.
- Phase C: in reverse stage order; a stage injects its gK/gV together with the gradient of its prefix output
  (received from the next stage) in one backward, and sends the gradient of its prefix input back.

    model = pipeline.split_model(model, stage_index, num_stages)     # this rank's stage; the rest is dropped
    hf_prefixflow.apply_prefixflow(model)
    loss = pipeline.train_group(model, prompt_ids, completion_ids, completion_mask, loss_fn, microbatches=4)

Every rank of the pipeline passes the same prompt ids and completion mask (the first stage also reads the ids);
`loss_fn(logits, rows)` runs on the last stage per microbatch, `rows` indexing the group's completions, and the
losses are summed, not averaged, so gradients equal the full-sequence sum exactly. Each stage's parameters keep
their names in the full model, so the stages' state dicts together are the full model's. Pipeline replicas (data
parallel) each pass their own process group as `group`, then reduce each stage's gradients over its replicas
(`data_parallel.reduce_trainable_gradients`).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from ..core.attention import PASS_KWARG, PrefixPass
from ..errors import PrefixFlowError
from ..core.layouts import right_padded
from ..core.access import decoder_of, unwrap
from ..core.scheduler import STATES_ON_ONE_PROCESS, GroupRunner, GroupSession, PrefixGroup
from ..core.states import has_states
from .collectives import all_gather, refuse_offload_kv

# Phase A/C messages: a tag of their own on gloo; NCCL ignores tags and matches a pair's messages in issue order,
# which both ends share (Phase A, then the schedule's, then Phase C).
PREFIX_TAG = 7
# The last stage's logits only feed the loss; torch 2.13 can be told not to keep every microbatch's to the end.
_NO_OUTPUTS = {"return_outputs": False} if "return_outputs" in inspect.signature(Schedule1F1B.step).parameters else {}


class LayerElsewhere(torch.nn.Module):
    """A decoder layer held by another stage: here the hidden states pass through it unchanged (it keeps its slot,
    so the decoder's per-layer attention types and every parameter name stay aligned)."""

    def __init__(self, stage: int):
        super().__init__()
        self.stage = stage

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states

    def extra_repr(self) -> str:
        return f"on stage {self.stage}"


def stage_bounds(num_layers: int, num_stages: int) -> list[int]:
    """Layer boundaries of an even split: stage `s` holds layers `[bounds[s], bounds[s+1])`."""
    if not 1 <= num_stages <= num_layers:
        raise PrefixFlowError(f"{num_stages} pipeline stages cannot split {num_layers} decoder layers: use between 1 "
                              f"and {num_layers} stages.")
    return [s * num_layers // num_stages for s in range(num_stages + 1)]


def split_model(model: torch.nn.Module, stage_index: int, num_stages: int, bounds: list[int] | None = None):
    """Keep stage `stage_index`'s part of `model` (in place; returns it): its layers `[bounds[s], bounds[s+1])`
    (default: an even split), the embeddings if first, the final norm and LM head if last."""
    inner = unwrap(model)
    decoder = decoder_of(inner)
    _check_splittable(inner, decoder)
    layers = decoder.layers
    bounds = stage_bounds(len(layers), num_stages) if bounds is None else list(bounds)
    if len(bounds) != num_stages + 1 or bounds[0] != 0 or bounds[-1] != len(layers) or bounds != sorted(set(bounds)):
        raise PrefixFlowError(f"stage bounds must rise strictly from 0 to {len(layers)} in {num_stages} steps; got "
                              f"{bounds}.")
    for index in range(len(layers)):
        owner = next(s for s in range(num_stages) if bounds[s] <= index < bounds[s + 1])
        if owner != stage_index:
            layers[index] = LayerElsewhere(owner)
    if stage_index > 0:
        decoder.embed_tokens = None
    if stage_index < num_stages - 1:
        decoder.norm = torch.nn.Identity()
        inner.lm_head = None
    inner._prefixflow_stage = (stage_index, num_stages)
    return model


def _check_splittable(inner: torch.nn.Module, decoder: torch.nn.Module) -> None:
    """A Llama-style decoder (`embed_tokens`, `layers`, `norm`, `lm_head`) whose forward feeds `inputs_embeds` to
    the layers unchanged: later stages enter it with hidden states in place of embeddings."""
    if getattr(inner, "_prefixflow_stage", None) is not None:
        raise PrefixFlowError("this model is already one pipeline stage; split the full model once per rank.")
    names = ("embed_tokens", "layers", "norm")
    if not all(isinstance(getattr(decoder, n, None), torch.nn.Module) for n in names) or not isinstance(
            getattr(inner, "lm_head", None), torch.nn.Module):
        raise PrefixFlowError(f"pipeline stages split a decoder with embed_tokens, layers, norm and lm_head (Llama, "
                              f"Qwen, Mistral style); {type(inner).__name__} is not one.")
    if inner.config.get_text_config().tie_word_embeddings:
        raise PrefixFlowError("tied input and output embeddings would live on the first and last stage, and the "
                              "pipeline does not sum their gradients: untie them (tie_word_embeddings=False) first.")
    with torch.no_grad():  # a forward with every layer elsewhere and no norm must return its input
        layers, norm = decoder.layers, decoder.norm
        decoder.layers = torch.nn.ModuleList(LayerElsewhere(-1) for _ in layers)
        decoder.norm = torch.nn.Identity()
        try:
            weight = decoder.embed_tokens.weight
            probe = torch.randn(1, 2, weight.shape[1], dtype=weight.dtype, device=weight.device)
            out = decoder(inputs_embeds=probe, position_ids=torch.arange(2, device=weight.device)[None],
                          use_cache=False)[0]
        finally:
            decoder.layers, decoder.norm = layers, norm
    if not torch.equal(out, probe):
        raise PrefixFlowError(f"{type(decoder).__name__} transforms inputs_embeds before its layers (scaling, "
                              "position embeddings), so a later stage's hidden states cannot enter it: not supported.")


def stage_of(model: torch.nn.Module) -> tuple[int, int]:
    stage = getattr(unwrap(model), "_prefixflow_stage", None)
    if stage is None:
        raise PrefixFlowError("call pipeline.split_model(model, stage_index, num_stages) before training a group on a "
                              "pipeline stage.")
    return stage


class StageRunner(GroupRunner):
    """Runs a stage's part of each forward: from the ids (first stage) or the hidden states received (later stages),
    to the logits (last stage) or the hidden states sent on."""

    def device(self, group: "StageGroup") -> torch.device:
        return next(group.hf_model.parameters()).device  # later stages hold no embeddings

    def forward(self, group: "StageGroup", module: torch.nn.Module, input_ids: torch.Tensor,
                position_ids: torch.Tensor, **kwargs):
        inputs = {"input_ids": input_ids} if group.is_first else {"inputs_embeds": group.incoming}
        if not group.is_last:  # no LM head here: the decoder's hidden states go to the next stage
            module = decoder_of(group.model)
        out = module(position_ids=position_ids, use_cache=False, **inputs, **kwargs)
        if isinstance(kwargs[PASS_KWARG], PrefixPass):
            group.prefix_output = out[0]
        return out


class StageGroup(PrefixGroup):
    """A prefix group on one pipeline stage: its own layers' K/V; hidden states in from the stage before it."""

    def __init__(self, model: torch.nn.Module, prefix_ids: torch.Tensor):
        if has_states(unwrap(model)):
            raise PrefixFlowError(STATES_ON_ONE_PROCESS)
        self.stage_index, self.num_stages = stage_of(model)
        super().__init__(model, prefix_ids, runner=StageRunner())
        self.incoming: torch.Tensor | None = None  # the hidden states the next forward starts from (later stages)
        self.prefix_input: torch.Tensor | None = None  # Phase A's, received: its gradient goes back in Phase C
        self.prefix_output: torch.Tensor | None = None  # Phase A's: the next stage returns its gradient

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


class _WaveStage(torch.nn.Module):
    """What `PipelineStage` runs per microbatch: one suffix wave through this stage's part of the model."""

    def __init__(self, group: StageGroup):
        super().__init__()
        self.model = group.model
        self.group = [group]  # not a submodule

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        group = self.group[0]
        ids = inputs if group.is_first else torch.zeros_like(attention_mask, dtype=torch.long)
        group.incoming = None if group.is_first else inputs
        out = group(ids, attention_mask=attention_mask)
        if group.is_last:
            return out.logits
        return _checked_hidden(group, out[0], (*attention_mask.shape, _hidden_size(group)))


class _VotelessStage(PipelineStage):
    """A stage whose every shape is given. At a schedule's first step torch 2.13 still polls every stage on that (a
    round trip from the first stage to the last and back), and torch 2.11 exchanges a warm-up message with each
    neighbour; either would hold each stage's Phase B until every later stage had finished its Phase A. Each stage
    answers for itself instead, as all would (shapes given, no DTensors), and sends no warm-up: `_agree`'s all-gather
    over the group and Phase A's messages came first."""

    def _get_init_p2p_neighbors_ops(self) -> list:
        return []

    def _warmup_forward_vote(self, has_backward: bool, received_acc: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ones(1, dtype=torch.int32, device=self.device)

    def _warmup_backward_result(self, received_result: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ones(1, dtype=torch.int32, device=self.device)


def _hidden_size(group: StageGroup) -> int:
    return group.hf_model.config.get_text_config().hidden_size


def _checked_hidden(group: StageGroup, hidden: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Hidden states about to go to the next stage, which expects them in the model's dtype: NCCL would not say."""
    if hidden.dtype != group.hf_model.dtype or tuple(hidden.shape) != shape:
        raise PrefixFlowError(f"stage {group.stage_index} made hidden states {tuple(hidden.shape)} in {hidden.dtype}; "
                              f"the next stage expects {shape} in the model's dtype {group.hf_model.dtype}. Keep the "
                              "residual stream in the weights' dtype (autocast over fp32 weights does).")
    return hidden


def train_group(
    model: torch.nn.Module, prefix_ids: torch.Tensor, suffix_ids: torch.Tensor | None, attention_mask: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], microbatches: int, group=None,
) -> torch.Tensor | None:
    """Train one group on this rank's stage: Phase A, the waves as `microbatches` 1F1B microbatches, Phase C.

    `suffix_ids [N, S]` (first stage; None elsewhere) and `attention_mask [N, S]` (every stage) are right-padded;
    `N` must divide into `microbatches` equal waves. `group` is the pipeline's process group, stage `s` on its rank
    `s` (default: the world). Returns the summed loss on the last stage, None on the others; gradients accumulate
    into `.grad` like one backward of the full-sequence loss sum."""
    if not torch.is_grad_enabled():
        raise PrefixFlowError("pipeline.train_group trains: call it with gradients enabled.")
    refuse_offload_kv(model, "pipeline stages")  # the same config on every stage: all refuse alike
    stage = StageGroup(model, prefix_ids)
    _agree(stage, suffix_ids, attention_mask, microbatches, group)
    link = _Link(stage.stage_index, group)
    with GroupSession(model) as session:
        _phase_a(session, stage, link)
        losses = _phase_b(stage, suffix_ids, attention_mask, loss_fn, microbatches, group)
        _phase_c(session, stage, link)
    return torch.stack(losses).sum().detach() if stage.is_last else None


def _problem(stage: StageGroup, suffix_ids, attention_mask: torch.Tensor, microbatches: int, group) -> str | None:
    """What is wrong with this stage's inputs, if anything."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (stage.num_stages, stage.stage_index):
        return (f"this is stage {stage.stage_index} of {stage.num_stages} but rank {rank} of a process group of "
                f"{size}: pass group= the pipeline's own group, its rank s holding stage s.")
    if attention_mask.dim() != 2:
        return f"the completion mask must be [N, S], got shape {tuple(attention_mask.shape)}."
    if not right_padded(attention_mask):
        return "completions must be right-padded (mask 1...1 0...0)."
    rows = attention_mask.shape[0]
    if microbatches < stage.num_stages or rows % microbatches:
        return (f"{rows} completions in {microbatches} microbatches over {stage.num_stages} stages: 1F1B needs "
                "equal microbatches, at least one per stage; pass a divisor of the group size of at least the "
                "number of stages.")
    if stage.is_first and (suffix_ids is None or suffix_ids.shape != attention_mask.shape):
        return "the first stage needs suffix_ids of the attention mask's shape [N, S]."
    return None


def _agree(stage: StageGroup, suffix_ids, attention_mask: torch.Tensor, microbatches: int, group) -> None:
    """Each stage checks its inputs, then all of them compare notes (one all_gather), so that a bad group raises on
    every rank: an error on one alone would leave its neighbours waiting for its messages."""
    if not dist.is_initialized():
        raise PrefixFlowError("pipeline.train_group runs one process per stage: initialise torch.distributed first "
                              "(torchrun, then dist.init_process_group).")
    problem = _problem(stage, suffix_ids, attention_mask, microbatches, group)
    shape = tuple(attention_mask.shape) if attention_mask.dim() == 2 else (-1, -1)
    facts = [problem is None, stage.stage_index, stage.prefix_ids.shape[1], *shape, microbatches,
             _checksum(stage.prefix_ids), _checksum(attention_mask)]
    gathered = all_gather(mine := torch.tensor(facts, dtype=torch.long, device=stage.prefix_ids.device), group)
    if problem is not None:
        raise PrefixFlowError(problem)
    if not all(g[0] for g in gathered):
        raise PrefixFlowError("another pipeline stage refused this group (its error says why); none trains it.")
    if any(not torch.equal(g[2:], mine[2:]) for g in gathered):
        raise PrefixFlowError("the pipeline stages were given different groups (prompt ids, completion mask or "
                              "microbatches): every rank passes the same prompt ids, completion mask and microbatches.")


def _checksum(tensor: torch.Tensor) -> int:
    """A position-weighted sum of integer ids: equal groups agree, different ones almost surely not."""
    flat = tensor.reshape(-1).long()
    return int((flat * torch.arange(1, flat.numel() + 1, device=flat.device)).sum())


class _Link:
    """Point-to-point messages with the neighbouring stages, outside the 1F1B schedule's own."""

    def __init__(self, stage_index: int, group):
        self.stage_index, self.group = stage_index, group

    def _peer(self, offset: int) -> int:
        stage = self.stage_index + offset
        return dist.get_global_rank(self.group, stage) if self.group is not None else stage

    def send(self, tensor: torch.Tensor, offset: int) -> None:
        dist.send(tensor.contiguous(), self._peer(offset), group=self.group, tag=PREFIX_TAG)

    def recv(self, like: torch.Tensor, offset: int) -> torch.Tensor:
        buffer = torch.empty_like(like, memory_format=torch.contiguous_format)
        dist.recv(buffer, self._peer(offset), group=self.group, tag=PREFIX_TAG)
        return buffer


def _phase_a(session: GroupSession, stage: StageGroup, link: _Link) -> None:
    """Receive the prefix hidden states (later stages), run this stage's prefix forward, send its output on."""
    passes = stage.cache.prefix_length > 0
    shape = (1, stage.cache.prefix_length, _hidden_size(stage))
    if passes and not stage.is_first:
        like = torch.empty(shape, dtype=stage.hf_model.dtype, device=stage.prefix_ids.device)
        stage.incoming = link.recv(like, -1).requires_grad_()
    session.add(stage)
    if passes and not stage.is_last:
        link.send(_checked_hidden(stage, stage.prefix_output, shape).detach(), +1)
    stage.prefix_input, stage.incoming = stage.incoming, None


def _phase_b(stage: StageGroup, suffix_ids, attention_mask, loss_fn, microbatches: int, group) -> list[torch.Tensor]:
    """The waves as microbatches of a 1F1B schedule over this stage (shapes given, so torch infers nothing)."""
    rows, length = attention_mask.shape
    batch = rows // microbatches
    device = stage.prefix_ids.device
    # Shapes only (meta tensors): the receive buffers are torch's. Gradients flow back along the hidden states.
    hidden = torch.empty(batch, length, _hidden_size(stage), dtype=stage.hf_model.dtype, device="meta",
                         requires_grad=True)
    inputs = torch.empty(batch, length, dtype=torch.long, device="meta") if stage.is_first else hidden
    vocab = stage.hf_model.config.get_text_config().vocab_size
    outputs = torch.empty(batch, length, vocab, dtype=_logits_dtype(stage), device="meta") if stage.is_last else hidden
    pipe = _VotelessStage(_WaveStage(stage), stage.stage_index, stage.num_stages, device, input_args=(inputs,),
                          output_args=(outputs,), group=group)
    losses: list[torch.Tensor] = []
    schedule = Schedule1F1B(pipe, microbatches, loss_fn=loss_fn, scale_grads=False)
    index = torch.arange(rows, device=device)
    args = (suffix_ids,) if stage.is_first else ()
    target = {"target": index, "losses": losses} if stage.is_last else {}
    schedule.step(*args, attention_mask=attention_mask, **target, **_NO_OUTPUTS)
    stage.incoming = None  # the last microbatch's received hidden states and their gradient
    return losses


def _logits_dtype(stage: StageGroup) -> torch.dtype:
    """The LM head's output dtype (torch 2.11 checks the last stage's output against the one declared)."""
    device_type = stage.prefix_ids.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return stage.hf_model.lm_head.weight.dtype


def _phase_c(session: GroupSession, stage: StageGroup, link: _Link) -> None:
    """One backward for this stage's prefix: its gK/gV and the next stage's gradient for its output; the gradient
    of its input goes to the previous stage."""
    boundary = []
    if stage.prefix_output is not None and not stage.is_last:
        grad = link.recv(stage.prefix_output, +1)
        if stage.prefix_output.requires_grad:  # else nothing up to here trains
            boundary = [(stage.prefix_output, grad)]

    def backward(outputs, grads):
        torch.autograd.backward(outputs + [t for t, _ in boundary], grads + [g for _, g in boundary])

    closing = [stage] if stage.state == "open" else []
    fed = session.close(closing, backward=backward)
    if not fed and boundary:  # no gK/gV here (nothing of this stage trains), yet the stages before it may
        backward([], [])
    inputs = stage.prefix_input
    if inputs is not None:
        link.send(inputs.grad if inputs.grad is not None else torch.zeros_like(inputs), -1)
    stage.prefix_input = stage.prefix_output = None

"""Ulysses sequence parallelism for PrefixFlow: sequence-sharded tokens, head-sharded attention, per-head-shard K/V.

Each rank of a sequence-parallel (SP) group runs a contiguous shard of every sequence: rank `r` holds tokens
`[r*L, (r+1)*L)` at their global positions. Inside attention an all-to-all turns the sequence shards of Q/K/V into
the full sequence of `1/sp` of the heads, and the PrefixFlow attention runs unchanged on that: Phase A caches the
full-length prefix K/V of this rank's heads, so suffix attention needs no prefix all-gather, and in Phase C gK/gV
return through the prefix's own all-to-all. A second all-to-all brings the attention output back to sequence shards.

    sp = SequenceParallel(group)                        # a torch.distributed group (None: the whole world)
    with prefix_group(model, prompt_ids, sp) as group:  # every rank of `group` passes the same ids
        out = group(completion_ids, attention_mask=mask)         # this rank's shard of the wave
        loss_fn(out.logits, out.token_index).backward()          # local positions -> completion tokens
    reduce_gradients(model, sp)                         # the shards' sum is the full-sequence gradient

Lengths need not divide by `sp`: the cache holds the largest multiple of `sp` prefix tokens below `P`, and the other
prompt tokens ride at the head of every suffix (exact: each full sequence runs them too); waves are padded at the
end, where causal attention never shows them to a real token, and padded positions predict nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ..core.attention import PASS_KWARG, SP_KWARG, PrefixPass, SuffixPass
from ..errors import PrefixFlowError
from ..core.kv_cache import TrainingKVCache
from ..core.layouts import PADDING, Wave
from ..core.access import unwrap
from ..core.moe import routers
from ..core.scheduler import STATES_ON_ONE_PROCESS, GroupRunner, GroupSession, PrefixGroup
from ..core.states import has_states
from .collectives import refuse_offload_kv
from .data_parallel import reduce_trainable_gradients


class _AllToAll(torch.autograd.Function):
    """`all_to_all` over dim 0 (slice `j` goes to rank `j`); the backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, chunks: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(chunks, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, chunks.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


@dataclass(frozen=True, eq=False)
class SequenceParallel:
    """One Ulysses SP group (`None`: the default, whole-world group) and, during Phase A, the prefix's geometry."""

    group: dist.ProcessGroup | None = None
    prefix_wave: Wave | None = None  # Phase A: the causal geometry of the whole cached prefix

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous shard of dim 1 (whose length must divide by the SP size)."""
        length = tensor.shape[1] // self.size
        return tensor[:, self.rank * length : (self.rank + 1) * length]

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, H, L, D]` (sequence shard, all heads) -> `[B, H/sp, sp*L, D]` (full sequence, this rank's heads)."""
        batch, heads, length, dim = x.shape
        chunks = x.reshape(batch, self.size, heads // self.size, length, dim).transpose(0, 1)
        out = _AllToAll.apply(chunks, self.group)  # [source rank = sequence shard, B, H/sp, L, D]
        return out.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.size, self.size * length, dim)

    def sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Attention output `[B, sp*L, H/sp, D]` (this rank's heads) -> `[B, L, H, D]` (this rank's tokens)."""
        batch, length, heads, dim = x.shape
        chunks = x.reshape(batch, self.size, length // self.size, heads, dim).transpose(0, 1)
        out = _AllToAll.apply(chunks, self.group)  # [source rank = head shard, B, L, H/sp, D]
        return out.permute(1, 2, 0, 3, 4).reshape(batch, length // self.size, self.size * heads, dim)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, L, ...]` -> `[B, sp*L, ...]` on every rank; the backward sends each rank the sum of all ranks'
        gradients for its shard."""
        out = _AllToAll.apply(x.unsqueeze(0).expand(self.size, *x.shape), self.group)
        return out.transpose(0, 1).reshape(x.shape[0], -1, *x.shape[2:])

    def attend(self, attention: Callable, module: torch.nn.Module, query, key, value, dropout, scaling, kwargs):
        """Called by `prefixflow_attention` for a sharded forward: all-to-all to head shards, attend, and back."""
        marker = kwargs.pop(PASS_KWARG, None)
        if not isinstance(marker, (PrefixPass, SuffixPass)):
            raise PrefixFlowError("a sequence-parallel forward runs inside a Ulysses group "
                                  "(hf_prefixflow.distributed.ulysses.prefix_group).")
        query, key, value = self.heads(query), self.heads(key), self.heads(value)
        if isinstance(marker, PrefixPass):
            # Capture this head shard's full-length K/V; attend causally over the prefix like a cache-less wave.
            marker.cache.capture(module.layer_idx, key, value)
            marker = SuffixPass(TrainingKVCache(0), self.prefix_wave)
        out, weights = attention(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                 **{PASS_KWARG: marker}, **kwargs)
        return self.sequence(out), weights


def consecutive_groups(size: int) -> SequenceParallel:
    """Split the world into SP groups of `size` consecutive ranks (every rank must call this); return this rank's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise PrefixFlowError(f"the SP size ({size}) must divide the number of processes ({world}).")
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return SequenceParallel(mine)


def check_model(model: torch.nn.Module, size: int) -> None:
    """Refuse, before any step, what Ulysses with PrefixFlow cannot shard exactly."""
    refuse_offload_kv(model, "Ulysses sequence parallelism")
    inner = unwrap(model)
    config = inner.config.get_text_config()
    query_heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or query_heads
    if query_heads % size or kv_heads % size:
        common = math.gcd(query_heads, kv_heads)
        divisors = [d for d in range(1, common + 1) if common % d == 0]
        raise PrefixFlowError(
            f"Ulysses shards attention heads: the model has {query_heads} query and {kv_heads} key/value heads, "
            f"which do not divide by the SP size {size}. Use an SP size in {divisors}."
        )
    if routers(inner):
        raise PrefixFlowError("MoE models are not supported with sequence parallelism yet (routing replay is not "
                              "sharded); train them without SP.")
    if any(getattr(module, "sinks", None) is not None for module in inner.modules()):
        raise PrefixFlowError("attention sinks are per head and not sharded by Ulysses yet; train without SP.")


def _padded_to(wave: Wave, multiple: int) -> Wave:
    """`wave` with padding columns at the end so its width divides by `multiple` (they see, and predict, nothing)."""
    extra = -wave.input_ids.shape[1] % multiple
    if not extra:
        return wave
    batch = wave.input_ids.shape[0]
    steps = torch.arange(1, extra + 1, device=wave.input_ids.device).expand(batch, -1)
    return dataclasses.replace(
        wave,
        input_ids=torch.cat([wave.input_ids, wave.input_ids[:, -1:].expand(batch, extra)], dim=1),
        position_ids=torch.cat([wave.position_ids, wave.position_ids[:, -1:] + steps], dim=1),
        segment_ids=torch.cat([wave.segment_ids, torch.full_like(steps, PADDING)], dim=1),
        _masks={},
    )


@dataclass
class ShardedOutput:
    """A wave's output on one rank: `raw` is the model's output for this rank's tokens, and `token_index[j]` the
    completion token local position `j` predicts (-1: none, a prompt or padding position)."""

    raw: object
    token_index: torch.Tensor  # [L]
    offset: int  # wave positions before the one that predicts completion token 0
    length: int  # completion width S
    sp: SequenceParallel

    @property
    def logits(self) -> torch.Tensor:
        return self.raw.logits

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Per-position `[B, L, ...]` of this rank -> per-completion-token `[B, S, ...]`, the same on every rank.
        Differentiable: the backward hands each rank the sum of every rank's gradient for its positions."""
        return self.sp.gather(tensor)[:, self.offset : self.offset + self.length]


class UlyssesRunner(GroupRunner):
    """Runs a group's forwards sharded along the sequence: each rank forwards its shard, attention all-to-alls."""

    def __init__(self, sequence_parallel: SequenceParallel):
        self.sp = sequence_parallel

    def forward(self, group, module: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs):
        prefix_wave = None
        if isinstance(kwargs[PASS_KWARG], PrefixPass):
            zeros = torch.zeros_like(input_ids)
            prefix_wave = Wave(input_ids, position_ids, zeros, cached_length=0, packed=False)
        sp = dataclasses.replace(self.sp, prefix_wave=prefix_wave)
        return super().forward(group, module, self.sp.shard(input_ids), self.sp.shard(position_ids),
                               **{SP_KWARG: sp}, **kwargs)


class UlyssesGroup(PrefixGroup):
    """A prefix group whose forwards are sharded along the sequence over an SP group."""

    def __init__(self, model: torch.nn.Module, prefix_ids: torch.Tensor, sequence_parallel: SequenceParallel,
                 position_offset: int = 0):
        check_model(model, sequence_parallel.size)
        if has_states(unwrap(model)):
            raise PrefixFlowError(STATES_ON_ONE_PROCESS)
        super().__init__(model, prefix_ids, position_offset, runner=UlyssesRunner(sequence_parallel))
        self.sp = sequence_parallel
        cached = (self.prefix_ids.shape[1] - 1) // self.sp.size * self.sp.size
        # The prompt tokens past the largest multiple of sp ride at the head of every suffix instead.
        self.prefix_ids, self.moved = self.prefix_ids[:, : cached + 1], self.prefix_ids[:, cached + 1 :]
        self.cache = TrainingKVCache(cached, self.cache.grad_dtype)

    def padded_wave(self, suffix_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    routes: torch.Tensor | None = None) -> Wave:
        """The full (unsharded) wave: the moved prompt tokens, then right-padded `suffix_ids`, padded to a multiple of
        sp at the end."""
        if routes is not None:
            raise PrefixFlowError("MoE routing replay is not supported with sequence parallelism.")
        batch = suffix_ids.shape[0]
        if attention_mask is None:
            attention_mask = torch.ones_like(suffix_ids)
        moved = self.moved.expand(batch, -1)
        wave = super().padded_wave(torch.cat([moved, suffix_ids], dim=1),
                                   torch.cat([torch.ones_like(moved), attention_mask.to(moved.dtype)], dim=1))
        return _padded_to(wave, self.sp.size)

    def packed(self, suffixes, routes=None, **model_kwargs):
        raise PrefixFlowError("packed waves are not supported with sequence parallelism; use padded waves.")

    def __call__(self, suffix_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, routes=None,
                 shift_labels: torch.Tensor | None = None, **model_kwargs) -> ShardedOutput:
        """A padded wave, sharded: `shift_labels [B, S]` (aligned with `suffix_ids`, as TRL passes them) reach the
        model as this rank's per-position labels, -100 where a position predicts no completion token."""
        wave = self.padded_wave(suffix_ids, attention_mask, routes)
        offset, length = self.moved.shape[1], suffix_ids.shape[1]
        index = torch.arange(wave.input_ids.shape[1], device=suffix_ids.device) - offset
        index = index.masked_fill((index < 0) | (index >= length), -1)
        if shift_labels is not None:
            labels = shift_labels[:, index.clamp(min=0)].masked_fill(index < 0, -100)
            model_kwargs["shift_labels"] = self.sp.shard(labels)
        raw = self.run_wave(wave, **model_kwargs)
        return ShardedOutput(raw, self.sp.shard(index[None])[0], offset, length, self.sp)

@contextlib.contextmanager
def _entered(model: torch.nn.Module, group: UlyssesGroup) -> Iterator[UlyssesGroup]:
    with GroupSession(model) as session:
        yield session.add(group)


def prefix_group(model: torch.nn.Module, prefix_ids: torch.Tensor, sequence_parallel: SequenceParallel,
                 position_offset: int = 0) -> contextlib.AbstractContextManager[UlyssesGroup]:
    """`hf_prefixflow.prefix_group` over an SP group: every rank of it passes the same ids and runs the same waves.
    The group is validated here, before the `with`."""
    return _entered(model, UlyssesGroup(model, prefix_ids, sequence_parallel, position_offset))


def reduce_gradients(model: torch.nn.Module, sequence_parallel: SequenceParallel) -> None:
    """Sum the trainable parameters' gradients over the SP group: each rank holds its shard's share of them."""
    reduce_trainable_gradients(model, sequence_parallel.group)

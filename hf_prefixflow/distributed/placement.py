"""Split a rollout group across data-parallel ranks: the owner's prefix K/V go out, gK/gV come back, nothing else.

A group stays on one rank by default. When its rows live on several ranks (the holders), the owner (the lowest
holder) runs Phase A; the post-RoPE K/V it cached (and MoE router logits, if captured) are broadcast to the other
holders, which open the group on them as detached leaves (no Phase A, no prefix graph there) and run their suffix
waves as usual. Before the groups close, `reduce_gradients` sums every holder's gK/gV onto the owner, in the
precision they were accumulated in (fp32, or fp64 for an fp64 model); the owner's Phase C then carries the whole
group's gradient into its prefix graph, and the peers' close frees their leaves without any backward.

    with data_parallel.local_gradients(ddp_model), GroupSession(ddp_model) as session:  # Phase C inside no_sync
        split = placement.open_split(session, prompt_ids, holders=(0, 1))  # every rank, same order
        if split.group is not None:                                         # this rank holds rows
            loss_fn(split.group(my_completions, attention_mask=my_mask).logits).backward()
        placement.reduce_gradients([split])                                 # every rank, same order
    data_parallel.all_reduce_gradients(ddp_model)                           # the DDP rule, after Phase C

Collective schedule: every rank calls `open_split` for every split group and `reduce_gradients` over all of them in
one agreed order, holder or not, on the default (world) group. Per group, opening costs one `all_gather_object` of
each rank's outcome (so a failure on one rank raises on all, instead of leaving the others waiting), one pickled
`broadcast_object_list` of the cached tensors' shapes and dtypes and one `broadcast` per dtype of the flattened K/V
from the owner; closing costs one `reduce` per gradient dtype to the owner. A rank that holds no rows of a group
receives K/V it drops and contributes zeros to the reduce: this costs it `|K/V|` bytes of traffic per split group,
in exchange for creating no process group per group (`dist.new_group` is itself a world-wide collective, and slow).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import PrefixFlowError
from ..core.kv_cache import CachedTensor, LayerKV, TrainingKVCache
from ..core.scheduler import GroupSession, PrefixGroup
from .collectives import device_of, per_dtype, refuse_offload_kv


@dataclass(frozen=True)
class Entry:
    """One cached prefix tensor as every rank knows it after the owner's Phase A."""

    kind: str  # "key", "value" or "router"
    layer: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def grad_dtype(self) -> torch.dtype:
        """Ranks sum gK/gV in at least fp32, whatever dtype each rank's waves summed in (`kv_cache.CachedTensor`)."""
        return torch.promote_types(self.dtype, torch.float32)


@dataclass
class SplitGroup:
    """A group whose rows several ranks hold; `group` is this rank's view of it (None if it holds no rows)."""

    owner: int
    holders: tuple[int, ...]
    prefix_length: int
    entries: list[Entry]
    group: PrefixGroup | None
    device: torch.device


def holders(keys: Iterable) -> dict:
    """Collective: which ranks hold each group (keys: any sortable, picklable group identifiers)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(keys))
    found: dict = {}
    for rank, mine in enumerate(everyone):
        for key in mine:
            found.setdefault(key, []).append(rank)
    return found


def open_split(session: GroupSession, prefix_ids: torch.Tensor | None, holders: Iterable[int], position_offset: int = 0,
               routes: torch.Tensor | None = None) -> SplitGroup:
    """Collective: the owner runs Phase A and broadcasts the prefix K/V; the other holders open the group on them.

    Every rank calls this for every split group in the same order; `prefix_ids` may be None on ranks outside
    `holders`. Returns this rank's `SplitGroup`.
    """
    refuse_offload_kv(session.model, "groups split across processes")  # every rank alike: one config
    holders = tuple(sorted({int(r) for r in holders}))
    rank, owner = dist.get_rank(), holders[0]
    holds = rank in holders
    group, error = None, None
    try:
        if holds and prefix_ids is None:
            raise PrefixFlowError(f"rank {rank} holds rows of this split group but passed no prefix_ids.")
        group = PrefixGroup(session.model, prefix_ids, position_offset, routes) if holds else None
        if rank == owner:
            session.add(group)  # Phase A
    except Exception as exc:  # every rank must learn of it, or the others would wait in the broadcast below
        error = exc
    _agree(error, group.cache.prefix_length if group is not None else None, holders)
    if rank == owner:
        tensors = _in_order(group.cache)
        header = [group.cache.prefix_length, [_entry(kind, layer, t) for kind, layer, t in tensors]]
    else:
        header = [None, None]
    dist.broadcast_object_list(header, src=owner)
    prefix_length, entries = header
    device = device_of(session.model)
    received = _broadcast_values(entries, [t.live for _, _, t in tensors] if rank == owner else None, owner, device)
    if holds and rank != owner:
        session.adopt(group, _peer_cache(prefix_length, entries, received))
    return SplitGroup(owner, holders, prefix_length, entries, group, device)


def _agree(error: BaseException | None, prefix_length: int | None, holders: tuple[int, ...]) -> None:
    """Collective: raise on every rank if opening failed on any, or if the holders' prompts differ in length."""
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (None if error is None else f"{type(error).__name__}: {error}", prefix_length))
    failures = [f"rank {r}: {message}" for r, (message, _) in enumerate(reports) if message]
    lengths = {r: reports[r][1] for r in holders}
    if not failures and len(set(lengths.values())) > 1:
        failures = [f"the holders' prompts have {sorted(n + 1 for n in lengths.values())} tokens; the holders of a "
                    "split group must pass the same prompt"]
    if failures:
        raise PrefixFlowError("opening a split group failed on every rank because of " + "; ".join(failures)) \
            from error


def reduce_gradients(splits: list[SplitGroup]) -> None:
    """Collective: sum each split group's gK/gV over all ranks onto its owner (every rank, same list and order).

    Call it after the last suffix backward and before closing the groups; the owner's close then runs Phase C with
    the whole group's gradient, and the other holders' close frees their leaves.
    """
    for split in splits:
        mine = _in_order(split.group.cache) if split.group is not None else None
        chosen = [i for i, e in enumerate(split.entries) if e.requires_grad]
        parts = [_grad_or_zeros(split, i, mine[i][2] if mine else None) for i in chosen]
        per_dtype(parts, lambda flat: dist.reduce(flat, dst=split.owner))
        if dist.get_rank() == split.owner:
            for i, total in zip(chosen, parts):
                mine[i][2].grad = total


def _in_order(cache: TrainingKVCache) -> list[tuple[str, int, CachedTensor]]:
    """A cache's tensors in the order the header lists them (layers, then router logits)."""
    kv = [(kind, layer, t) for layer, e in cache.layers.items() for kind, t in (("key", e.key), ("value", e.value))]
    return kv + [("router", layer, t) for layer, t in cache.router_logits.items()]


def _entry(kind: str, layer: int, tensor: CachedTensor) -> Entry:
    return Entry(kind, layer, tuple(tensor.live.shape), tensor.live.dtype, tensor.leaf.requires_grad)


def _broadcast_values(entries: list[Entry], values: list[torch.Tensor] | None, owner: int,
                      device: torch.device) -> list[torch.Tensor]:
    """The owner's cached values on every rank, one flattened broadcast per dtype."""
    if values is not None:
        out = [value.detach().clone() for value in values]
    else:
        out = [torch.empty(e.shape, dtype=e.dtype, device=device) for e in entries]
    per_dtype(out, lambda flat: dist.broadcast(flat, src=owner))
    return out


def _peer_cache(prefix_length: int, entries: list[Entry], values: list[torch.Tensor]) -> TrainingKVCache:
    """A cache of received K/V: leaves for the waves and their gK/gV, with no prefix graph (Phase C skips it)."""
    cache = TrainingKVCache(prefix_length)
    tensors = {(e.kind, e.layer): CachedTensor(v.detach().requires_grad_(e.requires_grad))
               for e, v in zip(entries, values)}
    for (kind, layer), tensor in tensors.items():
        if kind == "key":
            cache.layers[layer] = LayerKV(tensor, tensors[("value", layer)])
        elif kind == "router":
            cache.router_logits[layer] = tensor
    return cache


def _grad_or_zeros(split: SplitGroup, index: int, tensor: CachedTensor | None) -> torch.Tensor:
    """This rank's accumulated gradient of one cached tensor in the entry's gradient dtype (the same on every rank);
    zeros where it has none (no rows, or no path)."""
    dtype = split.entries[index].grad_dtype
    if tensor is not None and tensor.grad is not None:
        return tensor.grad.to(dtype)
    return torch.zeros(split.entries[index].shape, dtype=dtype, device=split.device)

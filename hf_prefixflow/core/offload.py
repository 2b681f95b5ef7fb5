"""Prefix activation offload: the prefix graph's saved tensors leave the device from Phase A until Phase C.

Phase B reads only the prefix K/V; every other tensor the prefix forward saves for its backward is dormant until Phase
C. `PrefixOffload` is a pair of `saved_tensors_hooks` active during the prefix forward: each saved tensor (not
parameters, not the cached K/V, not small ones) is copied to a reusable host pool on a side stream while the forward
goes on, and its device memory is released. A tensor saved by several ops (a layer input read by the q, k and v
projections) is copied once. In Phase C autograd unpacks them in about reverse order; each unpack starts copying back
the saves of the next `PREFETCH_LAYERS` layers, and a tensor that is not back yet is loaded on demand, so correctness
never depends on overlap. A restored tensor has the strides it left with (cuDNN's attention backward returns wrong
gradients for an output handed back in another layout: docs/offload.md) and is dropped after its last unpack, so
Phase C holds only what autograd still needs. On a CPU device the same hooks copy into the host pool (a stand-in that
exercises the bookkeeping).

Copying everything back makes Phase C wait on host bandwidth: a decoder layer's activations take longer to return
than its backward takes to run. By default Phase A therefore checkpoints the prefix layers (`hf_prefixflow.recompute`):
only their inputs (and attention outputs) leave the device, and Phase C recomputes the rest.

With `offload_kv` the offloader also parks the cached K/V and their gradient sums (`park`, `load`, `repark`): read
by every wave, not once, through the same pool and copy stream (`kv_cache.StreamedTensor`).
"""

from __future__ import annotations

import bisect
import logging
import mmap
import weakref
from dataclasses import dataclass, field

import torch

from .. import _compat
from .._compat import outside_dispatch_modes
from ..errors import PrefixFlowError

logger = logging.getLogger(__name__)

MIN_BYTES_ON_ACCELERATOR = 1 << 20  # below this, a copy costs more than the memory it frees
# Prefetch the saves of this many decoder layers ahead (at most PREFETCH_BYTES): enough to hide a copy behind a
# layer's backward. Counted in layers, so that a short prefix's whole stack is not brought back at once and a layer
# copied among recomputed ones is still prefetched whole.
PREFETCH_LAYERS = 2
PREFETCH_BYTES = 2 << 30
PAGE_BYTES = mmap.PAGESIZE
# A free buffer no group took in this many trims in a row goes back to the host: registering it again costs more
# than a step's copies, and two configurations taking turns (a benchmark's sides) each keep theirs.
IDLE_TRIMS = 2


class HostPool:
    """Host buffers reused across groups (page-locked when the device is an accelerator), and the copy stream per
    device.

    A tensor takes the smallest free buffer that holds it, if it fills at least half of it; once every buffer is back
    (the session's groups all closed), `trim` frees those no tensor took in the last `IDLE_TRIMS` trims. So prompts
    of changing lengths (or two configurations taking turns) neither reallocate the pool every group nor grow it
    without bound. One side stream per device for every group: the caching allocator keeps freed blocks per stream,
    and a new stream per group would strand each group's blocks in another stream's cache.

    A page-locked buffer is plain host memory of the size asked (in whole pages), registered with CUDA in place
    (`cudaHostRegister`) and unregistered when freed, so the host gets it back. torch's pinned allocator would round
    each buffer up to a power of two and keep it cached: a long prompt's pool would take up to twice its bytes. Where
    registration fails the pool falls back to torch's pinned allocator, logged and counted in `pin_fallbacks`.

    Args:
        pin: page-lock the buffers (for CUDA devices).

    Attributes:
        allocated_bytes: host bytes of every buffer the pool owns, taken or free.
        peak_bytes: the most `allocated_bytes` has been.
        pin_fallbacks: buffers taken from torch's pinned allocator because registration failed.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: list[torch.Tensor] = []  # by size
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.pin_fallbacks = 0
        self._cost: dict[int, int] = {}  # host bytes behind each buffer, by id
        self._registered: dict[int, torch.Tensor] = {}  # buffers registered with CUDA, by id
        self._taken: set[int] = set()  # ids of the buffers taken since the last trim
        self._idle: dict[int, int] = {}  # trims in a row each free buffer went untaken, by id
        self._out = 0  # buffers taken and not yet given back
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # at collection or, at the latest, at exit (while CUDA is up): the host gets the registered memory back
        weakref.finalize(self, _unregister_all, self._registered, self._streams)

    def take(self, nbytes: int) -> torch.Tensor:
        """Take a buffer until `give` returns it.

        Args:
            nbytes: bytes needed.

        Returns:
            A 1-D uint8 CPU tensor of `nbytes` to `2 * nbytes` bytes (page-locked if the pool pins): a free one, else
            new.
        """
        index = bisect.bisect_left(self.free, nbytes, key=torch.Tensor.numel)
        if index < len(self.free) and self.free[index].numel() <= 2 * nbytes:
            buffer = self.free.pop(index)
        else:
            buffer = self._allocate(nbytes)
        self._taken.add(id(buffer))
        self._out += 1
        return buffer

    def _allocate(self, nbytes: int) -> torch.Tensor:
        registering = self.pin and not self.pin_fallbacks and nbytes > 0  # CUDA refuses to register no bytes
        buffer, cost = (self._registered_buffer(nbytes) if registering else None), nbytes
        if buffer is not None:
            cost = buffer.numel() + PAGE_BYTES
        elif self.pin and nbytes > 0:
            self.pin_fallbacks += 1
            buffer, cost = _pinned_by_torch(nbytes), 1 << (nbytes - 1).bit_length()
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        self._cost[id(buffer)] = cost
        self.allocated_bytes += cost
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return buffer

    def _registered_buffer(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` rounded up to whole pages of plain host memory, page-aligned (two registrations never share a
        page) and registered with CUDA; None, logged, if registration fails."""
        span = -(-nbytes // PAGE_BYTES) * PAGE_BYTES
        allocation = torch.empty(span + PAGE_BYTES, dtype=torch.uint8)
        start = -allocation.data_ptr() % PAGE_BYTES
        buffer = allocation[start:start + span]  # the view keeps the allocation
        error = _compat.register_host_memory(buffer)
        if error:
            logger.warning("PrefixFlow: cudaHostRegister failed (CUDA error %d); the offload pool takes torch's pinned "
                           "buffers, rounded up to powers of two, from here on (counted in pin_fallbacks).", error)
            return None
        self._registered[id(buffer)] = buffer
        return buffer

    @property
    def free_bytes(self) -> int:
        """Host bytes of the buffers not taken."""
        return sum(self._cost[id(buffer)] for buffer in self.free)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer `take` handed out (one taken before `close` is forgotten)."""
        if id(buffer) in self._cost:
            bisect.insort(self.free, buffer, key=torch.Tensor.numel)
            self._out -= 1

    def trim(self) -> None:
        """Free the buffers no tensor took in the last `IDLE_TRIMS` trims, once all are back: groups closed one by
        one in a session must not free each other's. No copy may still use them (`PrefixOffload.release`
        synchronizes)."""
        if self._out:
            return
        kept = []
        for buffer in self.free:
            idle = self._idle[id(buffer)] = 0 if id(buffer) in self._taken else self._idle.get(id(buffer), 0) + 1
            (kept.append if idle < IDLE_TRIMS else self._drop)(buffer)
        self.free, self._taken = kept, set()

    def close(self) -> None:
        """Free every buffer, once every copy queued on the pool's streams is done. Buffers still taken are
        unregistered and forgotten too: whoever holds them reads plain memory."""
        for stream in self._streams.values():
            stream.synchronize()
        for buffer in self.free:
            self._drop(buffer)
        for buffer in list(self._registered.values()):  # taken ones
            self._drop(buffer)
        self.free, self._taken, self._out, self._cost, self._idle = [], set(), 0, {}, {}
        self.allocated_bytes = 0

    def _drop(self, buffer: torch.Tensor) -> None:
        if self._registered.pop(id(buffer), None) is not None:
            error = _compat.unregister_host_memory(buffer)
            if error:
                logger.warning("PrefixFlow: cudaHostUnregister failed (CUDA error %d).", error)
        self.allocated_bytes -= self._cost.pop(id(buffer), 0)
        self._idle.pop(id(buffer), None)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The pool's copy stream for a CUDA `device`, created on first use and shared by every group."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


MEMINFO = "/proc/meminfo"
# cgroup v2, then v1: a container's memory limit and use, which MemAvailable does not see
CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_host_bytes() -> int | None:
    """Host memory a process can still take: Linux's `MemAvailable`, capped by its cgroup's limit less its use;
    None where `/proc/meminfo` does not say (not Linux)."""
    try:
        with open(MEMINFO) as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    for limit_file, usage_file in CGROUP_MEMORY:
        try:
            with open(limit_file) as limit, open(usage_file) as usage:
                limit_text, used = limit.read().strip(), int(usage.read())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit():  # "max": no limit
            available = min(available, int(limit_text) - used)
        break
    return max(available, 0)


def _unregister_all(registered: dict[int, torch.Tensor], streams: dict) -> None:
    """A collected pool's registered buffers, once its copies are done (`HostPool.close` without the pool)."""
    for stream in streams.values():
        stream.synchronize()
    for buffer in registered.values():
        _compat.unregister_host_memory(buffer)
    registered.clear()


def _pinned_by_torch(nbytes: int) -> torch.Tensor:
    """A buffer from torch's pinned allocator (which rounds the request up to a power of two and caches it)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@dataclass(eq=False)
class Offloaded:
    """One saved tensor living on the host (what `PrefixOffload.pack` returns for it); `device_copy` is set once
    it is back (prefetched or loaded) and cleared after its last unpack."""

    index: int
    layer: int  # attention layers the prefix forward had run when this was saved
    buffer: torch.Tensor  # the pool's uint8 buffer
    host: torch.Tensor  # its first bytes, this tensor's
    shape: torch.Size
    stride: tuple[int, ...]  # the saved tensor's layout, restored with it
    dtype: torch.dtype
    device: torch.device
    source: weakref.ref  # the saved tensor's base: modified in place before Phase C, the copy would be stale
    version: int
    copied: object = None  # event that marks the device-to-host copy done
    device_copy: torch.Tensor | None = None
    ready: object = None  # event that marks the host-to-device copy done
    saves: int = 1  # how many saved-tensor slots share this copy
    unpacked: int = 0
    loaded_on_demand: bool = field(default=False)

    @property
    def consumed(self) -> bool:
        """Whether every saved-tensor slot sharing this copy has been unpacked."""
        return self.unpacked >= self.saves

    def host_view(self) -> torch.Tensor:
        """The host copy, viewed with the saved tensor's shape, strides and dtype."""
        return self.host.view(self.dtype).as_strided(self.shape, self.stride)


def _layout(tensor: torch.Tensor) -> tuple[int, ...]:
    """The strides a restored copy of `tensor` gets: its own when its elements fill their span (any dimension
    order), else dense ones in the same dimension order. Kernels may depend on them: cuDNN's attention backward,
    handed its forward's output in another layout than that forward returned (the query's), returns wrong gradients
    (docs/offload.md)."""
    return torch.empty_like(tensor, device="meta").stride()


def _is_parameter_cast(tensor: torch.Tensor) -> bool:
    """An autocast copy of a weight (cached and shared by autocast): weights are not activations."""
    fn = tensor.grad_fn
    return type(fn).__name__ == "ToCopyBackward0" and any(
        type(next_fn).__name__ == "AccumulateGrad" for next_fn, _ in fn.next_functions if next_fn is not None
    )


def _identity(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The tensor's base and a key for its values: ops that read one input save views of it (each linear layer
    folds it to 2D), which match while the base lives and is unmodified (the version counter)."""
    base = tensor._base if tensor._base is not None else tensor
    key = (id(base), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype,
           tensor.is_conj(), tensor.is_neg(), tensor._version)
    return base, key


@dataclass(eq=False)
class Parked:
    """A tensor kept in a host buffer and copied to its device each time it is read (`PrefixOffload.park`)."""

    buffer: torch.Tensor  # the pool's uint8 buffer
    host: torch.Tensor  # its first bytes, viewed as the tensor, in its layout
    device: torch.device
    device_copy: torch.Tensor | None = None  # the copy on its way back, if `prefetch` started one
    ready: object = None  # event that marks that copy done


@dataclass(eq=False)
class Stayed:
    """A saved tensor left where it is, with its version when saved (autograd's own check, which the hooks skip)."""

    tensor: torch.Tensor
    version: int


def _check_version(saved_version: int, tensor: torch.Tensor | None) -> None:
    if tensor is not None and tensor._version != saved_version:
        raise PrefixFlowError(
            "a tensor the prefix forward saved for its backward was modified by an in-place operation before Phase C "
            f"(version {saved_version}, now {tensor._version}); autograd refuses this without offload too. Make the "
            "operation out of place.")


class PrefixOffload:
    """Saved-tensor hooks for one or more prefix forwards, released after their Phase C.

    Args:
        device: the device whose saved tensors move; tensors elsewhere stay.
        pool: the host pool to copy into (shared across groups); None: a pool of its own.
        min_bytes: tensors smaller than this stay; None: `MIN_BYTES_ON_ACCELERATOR` on CUDA, 0 elsewhere.

    Attributes:
        caches: the `TrainingKVCache`s of the forwards hooked: their live tensors stay on the device, and their
            layer count tags each saved tensor with its layer (for prefetching). The caller appends them.
        offloaded_bytes: bytes copied to the host so far.
    """

    def __init__(self, device: torch.device, pool: HostPool | None = None, min_bytes: int | None = None):
        self.device = torch.device(device)
        accelerator = self.device.type == "cuda"
        self.pool = pool or HostPool(pin=accelerator)
        self.min_bytes = (MIN_BYTES_ON_ACCELERATOR if accelerator else 0) if min_bytes is None else min_bytes
        self.stream = self.pool.stream(self.device) if accelerator else None
        self.entries: list[Offloaded] = []
        self.parked: list[Parked] = []
        self.caches: list = []  # training-time KV caches: their live tensors stay; their layer count marks layers
        self.offloaded_bytes = 0
        self._saved: dict[tuple, tuple[weakref.ref, Offloaded]] = {}  # see `_identity`

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager to run a prefix forward under: `with offload.hooks(): ...`."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _eligible(self, tensor: torch.Tensor) -> bool:
        base = tensor._base if tensor._base is not None else tensor
        return not (
            isinstance(base, torch.nn.Parameter)
            or (base.is_leaf and base.requires_grad)
            or _is_parameter_cast(base)
            or any(tensor is t.live or base is t.live for cache in self.caches for t in cache.tensors())
            or tensor.device != self.device
            or tensor.numel() * tensor.element_size() < self.min_bytes
        )

    @outside_dispatch_modes
    def pack(self, tensor: torch.Tensor):
        """The pack hook: start moving a saved tensor to the host.

        Args:
            tensor: a tensor autograd saves for the backward.

        Returns:
            What `unpack` takes back: an `Offloaded` entry (shared when the same values were saved before), or a
            `Stayed` holding the tensor detached (parameters and their autocast copies, leaves that require grad,
            the cached K/V, tensors on another device or below `min_bytes`).
        """
        if not self._eligible(tensor):
            # Detached: a node that saves its own output (rsqrt, softmax) would otherwise hold that output, whose
            # grad_fn is the node itself, a cycle through C++ that Python's collector never frees. Each group would
            # leak the prefix graph's unexecuted tail (the last layer's query path and MLP, recomputed in Phase C).
            return Stayed(tensor.detach(), tensor._version)
        base, key = _identity(tensor)
        seen = self._saved.get(key)
        if seen is not None and seen[0]() is base:  # the same values saved again: share their copy
            seen[1].saves += 1
            return seen[1]
        nbytes, stride = tensor.numel() * tensor.element_size(), _layout(tensor)
        layer = sum(len(cache.layers) for cache in self.caches)
        buffer = self.pool.take(nbytes)
        entry = Offloaded(len(self.entries), layer, buffer, buffer[:nbytes], tensor.shape, stride, tensor.dtype,
                          tensor.device, weakref.ref(base), tensor._version)
        self.entries.append(entry)  # from here on `release` returns its buffer, whatever happens next
        entry.copied = self._copy_out(entry.host_view(), tensor)
        self._saved[key] = (weakref.ref(base), entry)
        self.offloaded_bytes += nbytes
        return entry

    @outside_dispatch_modes
    def unpack(self, packed):
        """The unpack hook: the saved tensor back on its device, in its shape, strides and dtype; also starts
        prefetching the layers before it.

        Raises:
            PrefixFlowError: the tensor was modified in place since it was saved.
        """
        if isinstance(packed, Stayed):
            _check_version(packed.version, packed.tensor)
            return packed.tensor
        _check_version(packed.version, packed.source())
        self._prefetch_before(packed.index)  # autograd walks the prefix graph backwards
        if packed.device_copy is None:
            packed.loaded_on_demand = True
            self._prefetch(packed)
        restored = self._arrived(packed.device_copy, packed.ready)
        packed.unpacked += 1
        if packed.consumed:  # autograd holds it as long as it needs it; we no longer do
            packed.device_copy = None
        return restored

    def _prefetch_before(self, index: int) -> None:
        """Start bringing back the saves of the `PREFETCH_LAYERS` layers before entry `index`'s."""
        ahead, first_layer = 0, self.entries[index].layer - PREFETCH_LAYERS
        for i in range(index - 1, -1, -1):
            entry = self.entries[i]
            if entry.layer < first_layer or ahead >= PREFETCH_BYTES:
                break
            if not entry.consumed:
                self._prefetch(entry)
                ahead += entry.host.numel()

    def _prefetch(self, entry: Offloaded) -> None:
        if entry.device_copy is not None:
            return
        entry.device_copy, entry.ready = self._copy_in(entry.host_view(), entry.device, after=entry.copied)

    # -- parked tensors (`offload_kv`): the prefix K/V and their gradient sums, read many times ------------------

    @outside_dispatch_modes
    def park(self, tensor: torch.Tensor) -> Parked:
        """Start copying `tensor` to a host buffer of the pool; its device memory may be freed meanwhile.

        Args:
            tensor: any device tensor (a prefix K or V, a gradient sum).

        Returns:
            The parked copy, for `load`, `prefetch` and `repark`.
        """
        nbytes = tensor.numel() * tensor.element_size()
        buffer = self.pool.take(nbytes)
        # In the tensor's own layout: a kernel reading the copy takes the path it took for the original.
        host = buffer[:nbytes].view(tensor.dtype).as_strided(tensor.shape, _layout(tensor))
        parked = Parked(buffer, host, tensor.device)
        self.parked.append(parked)  # from here on `release` returns its buffer
        self.repark(parked, tensor)
        return parked

    @outside_dispatch_modes
    def repark(self, parked: Parked, tensor: torch.Tensor) -> None:
        """Overwrite a parked copy with `tensor` (same shape and dtype), after every copy already queued from it."""
        self._copy_out(parked.host, tensor)

    @outside_dispatch_modes
    def prefetch(self, parked: Parked) -> None:
        """Start copying a parked tensor back to the device, for the next `load`."""
        if parked.device_copy is not None:
            return
        parked.device_copy, parked.ready = self._copy_in(parked.host, parked.device)

    @outside_dispatch_modes
    def load(self, parked: Parked) -> torch.Tensor:
        """A parked tensor on its device (the prefetched copy if one was started, else copied now); the next `load`
        copies again."""
        self.prefetch(parked)
        restored = self._arrived(parked.device_copy, parked.ready)
        parked.device_copy = parked.ready = None
        return restored

    # -- copies on the side stream: every host buffer is written and read there, in queue order ----------------

    def _copy_out(self, host: torch.Tensor, tensor: torch.Tensor):
        """Queue `tensor` -> `host` after the work queued so far; returns the event marking it done (None on CPU)."""
        if self.stream is None:
            host.copy_(tensor)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)  # its memory is reused only after the copy
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def _copy_in(self, host: torch.Tensor, device: torch.device, after=None):
        """Queue a copy of `host` onto `device` in its layout (after event `after`, if given); returns the copy and
        the event marking it done (None on CPU)."""
        if self.stream is None:
            return host.to(device, copy=True), None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            copy = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
            copy.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return copy, ready

    def _arrived(self, copy: torch.Tensor, ready) -> torch.Tensor:
        """`copy` for use on the current stream, once its event says it has arrived."""
        if ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            copy.record_stream(current)
        return copy

    def release(self) -> None:
        """Return the host buffers to the pool (after Phase C, or when the group fails)."""
        if self.stream is not None:
            self.stream.synchronize()
        for parked in self.parked:
            self.pool.give(parked.buffer)
            parked.device_copy = None
        self.parked = []
        for entry in self.entries:
            self.pool.give(entry.buffer)
            entry.device_copy = None
        self.pool.trim()
        self.entries = []
        self.caches = []
        self._saved = {}

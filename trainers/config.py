"""`PrefixFlowArguments`: the prefixflow_* settings a group-sampling trainer's config adds to TRL's, checked once.

A trainer's config class is `@dataclass class C(PrefixFlowArguments, XConfig)` (`trainers/grpo.py`,
`trainers/rloo.py`); a plain TRL config gets the field defaults. The parsers below are the one reading of each
setting: `__post_init__` refuses a bad value when the config is built, and the trainer reads the value through the
same parser (a plain TRL config, or settings changed after construction).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_prefixflow.config import DTYPES, RECOMPUTE_SHARE
from hf_prefixflow.errors import PrefixFlowError
from hf_prefixflow.planning.flops import MIN_SPEEDUP

from . import sequence_parallel

LAYOUTS = ("padded", "packed")


@dataclass
class PrefixFlowArguments:
    r"""PrefixFlow's settings, the fields a trainer config adds to TRL's (`@dataclass class C(PrefixFlowArguments,
    GRPOConfig)`); a plain TRL config gets these defaults.

    Parameters:
        > Sharing: which rows run as prefix groups, and how

        prefixflow_layout (`str`, defaults to `"padded"`): suffix waves as padded rows or one `"packed"` row per group.
        prefixflow_min_speedup (`float`, defaults to `MIN_SPEEDUP`): groups whose FLOP bound is below it train plain.
        prefixflow_scoring (`bool`, defaults to `True`): the old-policy and reference scoring passes share too.
        prefixflow_routing_replay (`bool`, defaults to `True`): MoE models replay generation's recorded routes.

        > Memory: where the prompt's activations and K/V live between Phase A and Phase C (`None` settings: the
        > default memory rule of `hf_prefixflow/planning/defaults.py` picks per run)

        prefixflow_offload (`bool` or `None`, defaults to `None`): dormant prefix activations in a host pool.
        prefixflow_offload_kv (`bool` or `None`, defaults to `None`): the prompt's K/V and gK/gV on the host too.
        prefixflow_offload_auto (`bool`, defaults to `False`): pick the two above per run from free device memory.
        prefixflow_prefix_recompute (`float` or `None`, defaults to `None`): share of prefix layers Phase C recomputes.
        prefixflow_suffix_checkpointing (`str`, defaults to `"auto"`): suffix waves recompute, keep or keep if it fits.
        prefixflow_kv_grad_dtype (`str` or `None`, defaults to `None`): dtype gK/gV sum in, a name of `DTYPES`.

        > Waves: how rows are batched through the suffix

        prefixflow_wave_size (`str`, `int` or `None`, defaults to `None`): rows per suffix wave; `"auto"` sizes them.
        prefixflow_merge_microbatches (`str`, defaults to `"auto"`): microbatches sharing a prompt train as one run.

        > Parallelism

        prefixflow_sp_size (`int`, defaults to `1`): Ulysses sequence parallelism over this many processes.
    """

    prefixflow_layout: str = field(
        default="padded", metadata={"help": "suffix wave layout: 'padded' rows or one 'packed' row per group"})
    prefixflow_min_speedup: float = field(
        default=MIN_SPEEDUP, metadata={"help": "groups whose FLOP bound is below this train on the plain path "
                                               "(logged and counted); see hf_prefixflow.planning.flops.MIN_SPEEDUP"})
    prefixflow_scoring: bool = field(
        default=True, metadata={"help": "reuse the prefix in the old-policy and reference scoring passes"})
    prefixflow_routing_replay: bool = field(
        default=True, metadata={"help": "MoE models: record routes during generation and replay them in training"})
    prefixflow_offload: bool | None = field(
        default=None, metadata={"help": "keep dormant prefix activations in a host pool between Phase A and C; None "
                                        "(with prefixflow_offload_kv None): per run, the cheapest way to hold the "
                                        "prompt whose planned peak is at most the stock trainer's "
                                        "(hf_prefixflow/defaults.py), logged as prefixflow/offload_mode"})
    prefixflow_offload_kv: bool | None = field(
        default=None, metadata={"help": "also keep the prompt's K/V and their gradients on the host, each layer's "
                                        "streamed in for its turn (implies prefixflow_offload): the longest "
                                        "prompts, for host-device traffic; one process or DDP without split groups; "
                                        "None: as prefixflow_offload=None decides"})
    prefixflow_offload_auto: bool = field(
        default=False, metadata={"help": "pick prefixflow_offload and prefixflow_offload_kv per run: the cheapest "
                                         "whose estimated peak fits in the free CUDA memory and whose host pool in "
                                         "the available host memory (hf_prefixflow.planning.planner.offload_for); "
                                         "logged as prefixflow/offload (0 none, 1 activations, 2 K/V too); leave the "
                                         "two settings off"})
    prefixflow_prefix_recompute: float | None = field(
        default=None, metadata={"help": "the share of prefix layers Phase A checkpoints and Phase C recomputes "
                                        f"(default {RECOMPUTE_SHARE} with offload, where it replaces copying them "
                                        "back, else 0)"})
    prefixflow_suffix_checkpointing: str = field(
        default="auto", metadata={"help": "with gradient_checkpointing: False keeps suffix waves' activations instead "
                                          "of recomputing them (the prefix stays checkpointed); 'auto' keeps them "
                                          "where that fits in the memory one microbatch of full sequences needs "
                                          "under the same checkpointing; True always recomputes"})
    prefixflow_wave_size: str | None = field(
        default=None, metadata={"help": "rows per suffix wave: None keeps a group's rows of a microbatch in one wave; "
                                        "a number caps it; 'auto' sizes waves from free CUDA memory (AutoWaves)"})
    prefixflow_merge_microbatches: str = field(
        default="auto", metadata={"help": "consecutive microbatches of one accumulation window that share a prompt "
                                          "train as one run (one forward and backward of all their rows, each "
                                          "microbatch keeping its loss normaliser): 'auto' while the run's completion "
                                          "tokens fit in one microbatch's full sequences, a number caps the "
                                          "microbatches per run, 1 turns merging off"})
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
        self._check_prefixflow()
        super().__post_init__()

    def _check_prefixflow(self) -> None:
        """Refuse a bad setting or combination here, before any model is loaded; the values stay as given."""
        if self.prefixflow_layout not in LAYOUTS:
            raise PrefixFlowError(f"prefixflow_layout must be 'padded' or 'packed', got {self.prefixflow_layout!r}.")
        if self.prefixflow_offload_auto and (self.prefixflow_offload or self.prefixflow_offload_kv):
            raise PrefixFlowError("prefixflow_offload_auto picks prefixflow_offload and prefixflow_offload_kv per run; "
                                  "leave those two False, or turn prefixflow_offload_auto off to set them yourself.")
        suffix_policy(self.prefixflow_suffix_checkpointing)
        wave_size(self.prefixflow_wave_size)
        merge_limit(self.prefixflow_merge_microbatches)
        kv_grad_dtype(self.prefixflow_kv_grad_dtype)
        if self.prefixflow_sp_size > 1:
            if self.prefixflow_layout != "padded":
                raise PrefixFlowError("sequence parallelism runs padded waves; set prefixflow_layout='padded'.")
            if self.prefixflow_wave_size is not None:
                raise PrefixFlowError("under sequence parallelism a group's rows run as one sharded wave; leave "
                                      "prefixflow_wave_size=None.")


def wave_size(setting: str | int | None) -> int | str | None:
    """prefixflow_wave_size read: None, 'auto' or a positive number of rows."""
    if setting is None or setting == "auto":
        return setting
    if not str(setting).isdigit() or int(setting) < 1:
        raise PrefixFlowError(f"prefixflow_wave_size must be None, 'auto' or a positive integer, got {setting!r}.")
    return int(setting)


def merge_limit(setting: str | int) -> int | None:
    """prefixflow_merge_microbatches read: None for 'auto' (the trainer sizes runs per generation), else the cap."""
    if setting == "auto":
        return None
    if not str(setting).isdigit() or int(setting) < 1:
        raise PrefixFlowError(f"prefixflow_merge_microbatches must be 'auto' or a positive integer, got {setting!r}.")
    return int(setting)


def suffix_policy(setting: str | bool) -> bool | str:
    """prefixflow_suffix_checkpointing read: True, False or 'auto' (strings from a command line included)."""
    policy = {"true": True, "false": False, "auto": "auto"}.get(str(setting).lower())
    if policy is None:
        raise PrefixFlowError(f"prefixflow_suffix_checkpointing must be True, False or 'auto', got {setting!r}.")
    return policy


def kv_grad_dtype(name: str | None) -> torch.dtype | None:
    """prefixflow_kv_grad_dtype read: the torch dtype of a name in `DTYPES`, None unset."""
    if name is None:
        return None
    if name not in DTYPES:
        raise PrefixFlowError(f"prefixflow_kv_grad_dtype must name a floating-point torch dtype, one of "
                              f"{sorted(DTYPES)}, got {name!r}.")
    return DTYPES[name]

"""The trainer's default memory rule: a run of groups plans no more device memory than the stock trainer's microbatch.

With `prefixflow_offload` and `prefixflow_offload_kv` left unset (None), `PrefixFlowGRPOTrainer` decides per run from
the planner's byte model (`hf_prefixflow.planner`), which needs no device:

    budget = planner.baseline_peak(tokens, 0, prompt width, completion width, per_device_train_batch_size, policy)
    need   = planner.run_need(tokens, prompts, completion width, rows, policy, offload, offload_kv, prefix_recompute)

`budget` is what the stock trainer's microbatch of full sequences adds to the static state (weights, gradients,
optimizer state, which both trainers hold alike), `need` what the run's groups add: their prompts' state, their
waves' activations and one phase's transient. Settings, cheapest first (`SETTINGS`):

    device       the prompt's K/V, gK/gV and activations stay on the device (no extra work)
    recompute    no checkpointing only: Phase A checkpoints every prompt layer on the device, Phase C recomputes them
    offload      the prompt's dormant activations wait in host memory (`prefixflow_offload`)
    offload_kv   its K/V and gK/gV too, streamed in per layer (`prefixflow_offload_kv`)

`choose` takes the first setting whose need fits the budget less `MARGIN` of the stock's whole planned peak (the
planner's error on measured peaks; `static` the weights and gradients), the least needing one where none does. A
run merges consecutive microbatches that share a prompt, so its waves (and TRL's fused-head tile, 32,768 vocabulary
entries per scored position) can hold more than one stock microbatch; `merge_cap` caps the microbatches per run at
the longest run that fits with the cheapest setting any run length long enough to share its prompt fits with.
"""

from __future__ import annotations

import dataclasses

from .planner import TokenBytes, baseline_peak, run_host_need, run_need
from ..config import RECOMPUTE_SHARE

MARGIN = 0.01  # of the stock's planned peak: the planner's error against measured H200 peaks, about 1%


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way to hold a prompt between Phase A and Phase C.

    Args:
        name: one of `SETTING_NAMES`.
        offload, offload_kv: `PrefixFlowConfig`'s offload settings.
        prefix_recompute: the share of prompt layers Phase C recomputes; None: the library's default for `offload`.
    """

    name: str
    offload: bool
    offload_kv: bool
    prefix_recompute: float | None

    @property
    def code(self) -> float:
        """The setting's index in `SETTING_NAMES`: the metric `prefixflow/offload_mode`."""
        return float(SETTING_NAMES.index(self.name))


SETTINGS = (Setting("device", False, False, None), Setting("recompute", False, False, RECOMPUTE_SHARE),
            Setting("offload", True, False, None), Setting("offload_kv", True, True, None))
SETTING_NAMES = tuple(s.name for s in SETTINGS)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A run's setting and the bytes it was chosen on (both on top of the static state).

    Args:
        setting: the chosen `Setting`.
        need: the run's planned device bytes under it (`planner.run_need`).
        budget: the stock microbatch's planned device bytes (`stock_need`).
        margin: bytes the need keeps clear of the budget (`MARGIN` of the stock's planned peak).
    """

    setting: Setting
    need: float
    budget: float
    margin: float = 0.0

    @property
    def fits(self) -> bool:
        return self.need + self.margin <= self.budget


def stock_need(tokens: TokenBytes, prompt_width: int, completion_width: int, rows: int, checkpointing: str) -> float:
    """Device bytes the stock trainer's microbatch adds to the static state: `rows` full sequences of
    `prompt_width + completion_width` tokens (TRL pads a generation batch's prompts and completions to its widest)
    under `checkpointing` (`planner.baseline_peak`)."""
    return baseline_peak(tokens, 0.0, prompt_width, completion_width, rows, checkpointing)


def settings(checkpointing: str, prefix_recompute: float | None = None, allow_kv: bool = True) -> list[Setting]:
    """The settings to try, cheapest first. A user's `prefix_recompute` replaces each setting's share (and makes
    `recompute` the same as `device`); `recompute` differs from `device` only without checkpointing (checkpointed
    prompt layers are recomputed anyway); `offload_kv` only where `allow_kv`."""
    chosen = []
    for s in SETTINGS:
        if s.name == "recompute" and (prefix_recompute is not None or checkpointing != "none"):
            continue
        if s.offload_kv and not allow_kv:
            continue
        chosen.append(s if prefix_recompute is None else dataclasses.replace(s, prefix_recompute=prefix_recompute))
    return chosen


def setting_need(tokens: TokenBytes, setting: Setting, prompts: list[int], completion_tokens: int, rows: list[int],
                 checkpointing: str, suffix_checkpointing: bool = True) -> float:
    """`planner.run_need` of a run under `setting`."""
    return run_need(tokens, prompts, completion_tokens, rows, checkpointing, setting.offload, setting.offload_kv,
                    setting.prefix_recompute, suffix_checkpointing)


def _host_fits(tokens: TokenBytes, setting: Setting, prompts: list[int], checkpointing: str,
               host_budget: float | None) -> bool:
    return not setting.offload or host_budget is None or run_host_need(
        tokens, prompts, checkpointing, setting.offload_kv, setting.prefix_recompute) <= host_budget


def choose(tokens: TokenBytes, prompts: list[int], completion_tokens: int, rows: list[int], budget: float,
           checkpointing: str = "full", *, prefix_recompute: float | None = None, suffix_checkpointing: bool = True,
           allow_kv: bool = True, host_budget: float | None = None, static: float = 0.0) -> Choice:
    """The cheapest setting under which a run of groups plans at most `budget` device bytes.

    Args:
        tokens: the model's byte model (`planner.token_bytes`).
        prompts: each group's prompt tokens P.
        completion_tokens: the run's completion width S.
        rows: each group's completions in the run.
        budget: the stock microbatch's bytes (`stock_need`).
        checkpointing: the policy of both trainers ("none", "full", "selective").
        prefix_recompute: the user's `prefixflow_prefix_recompute`, kept in every setting (None: the settings').
        suffix_checkpointing: whether the waves recompute their activations (False: the user keeps them).
        allow_kv: whether `offload_kv` may be picked (not where a parallel rule moves K/V).
        host_budget: host bytes the offload pool may hold (None: unbounded); a setting past it is never picked.
        static: the static state's bytes (weights, gradients), for the margin: `MARGIN * (static + budget)`.

    Returns:
        `Choice`: the first setting of `settings(...)` that fits, else the one needing least (`fits` False).
    """
    candidates, margin = [], MARGIN * (static + budget)
    for setting in settings(checkpointing, prefix_recompute, allow_kv):
        if not _host_fits(tokens, setting, prompts, checkpointing, host_budget):
            continue
        choice = Choice(setting, setting_need(tokens, setting, prompts, completion_tokens, rows, checkpointing,
                                              suffix_checkpointing), budget, margin)
        if choice.fits:
            return choice
        candidates.append(choice)
    if not candidates:  # no host memory for any offload: the device setting whatever it needs
        device = settings(checkpointing, prefix_recompute, allow_kv)[0]
        return Choice(device, setting_need(tokens, device, prompts, completion_tokens, rows, checkpointing,
                                           suffix_checkpointing), budget, margin)
    return min(candidates, key=lambda c: c.need)


def run_groups(microbatches: int, batch: int, num_generations: int) -> list[int]:
    """Each group's rows in the longest run of at most `microbatches` microbatches of `batch` rows that starts at a
    group's first row, groups of `num_generations` completions: as the trainer's `_run_length`, a run grows only
    while its last microbatch ends inside a group."""
    length = 1
    while length < microbatches and length * batch % num_generations:
        length += 1
    whole, rest = divmod(length * batch, num_generations)
    return [num_generations] * whole + ([rest] if rest else [])


def merge_cap(tokens: TokenBytes, prompt_width: int, completion_width: int, batch: int, num_generations: int,
              cap: int, checkpointing: str = "full", min_microbatches: int = 1, **choose_kwargs) -> int:
    """The microbatches a run may merge: the longest run of `min_microbatches` to `cap` microbatches that fits the
    stock microbatch's bytes with the cheapest setting any such run length fits with; 1 where none does (a run too
    short to share its prompt trains on the plain path, as the stock trainer does).

    Args:
        tokens, checkpointing: as `choose` takes them.
        prompt_width, completion_width: the generation batch's padded widths (every prompt taken as the widest).
        batch: `per_device_train_batch_size`; num_generations: completions per prompt.
        cap: the trainer's merge cap without the memory rule.
        min_microbatches: the shortest run whose groups share their prompt (the trainer's FLOP model,
            `flops.ModelShape.pays`); shorter runs train on the plain path.
        choose_kwargs: `choose`'s keyword arguments (prefix_recompute, suffix_checkpointing, allow_kv, host_budget,
            static).
    """
    budget = stock_need(tokens, prompt_width, completion_width, batch, checkpointing)
    allowed = settings(checkpointing, choose_kwargs.get("prefix_recompute"), choose_kwargs.get("allow_kv", True))
    for setting in allowed:
        for microbatches in range(cap, max(min_microbatches, 1) - 1, -1):
            # A group's last run, its rows left over, must share too: the plain path runs a run's rows at once.
            tail = -(-num_generations // batch) % microbatches
            if 0 < tail < min_microbatches:
                continue
            rows = run_groups(microbatches, batch, num_generations)
            choice = choose(tokens, [prompt_width] * len(rows), completion_width, rows, budget, checkpointing,
                            **choose_kwargs)
            if choice.fits and choice.setting == setting:
                return microbatches
    return 1

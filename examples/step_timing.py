"""Whole-step timing of a TRL trainer, as the examples and benchmarks report it.

A step runs from the trainer's `on_step_begin` to its `on_step_end`, the device synchronised on both sides, so it
holds everything the step runs: generation, scoring, every microbatch, PrefixFlow's Phase C, the optimizer and TRL's
bookkeeping. (TRL's own `step_time` metric closes inside `training_step`, before Phase C.)
"""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer(TrainerCallback):
    """Whole optimizer steps in seconds (`times`), the device synchronised on both sides."""

    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        self.times.append(time.perf_counter() - self._start)


def timed_generation(trainer) -> list[float]:
    """Seconds spent generating (`_generate_single_turn`), one entry per call; the same TRL code in both trainers."""
    seconds, generate = [], trainer._generate_single_turn

    def timed(*args, **kwargs):
        sync()
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        sync()
        seconds.append(time.perf_counter() - start)
        return out

    trainer._generate_single_turn = timed
    return seconds


def train_timed(trainer) -> list[dict]:
    """Train; return TRL's logged steps, each with `step_s` (the whole step), `generation_s` and `update_s` (the step
    without generation: scoring, the actor update with Phase C, the optimizer)."""
    timer, generation = StepTimer(), timed_generation(trainer)
    trainer.add_callback(timer)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    for log, step, generated in zip(logs, timer.times, generation):
        log.update(step_s=step, generation_s=generated, update_s=step - generated)
    return logs

"""The trainer swap on hybrid models: PrefixFlowGRPOTrainer equals GRPOTrainer on a tiny Qwen3.5 (gated delta-net)
and a tiny Nemotron-H (Mamba2), frozen rollouts, each of TRL's loss types' families."""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
import transformers
from transformers import AutoConfig
from trl import GRPOTrainer

import grpo_setup as setup
from hf_prefixflow import PrefixFlowError, PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer
from hf_prefixflow.models.tiny import float64_throughout, tiny_config
from hf_prefixflow.trainers import mixin as pf_mixin
from test_trainer import assert_aligned, same_microbatches, train  # noqa: F401 - the fixture applies here too

HYBRIDS = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"), "nemotron_h": ("nemotron_h", "NemotronHForCausalLM")}


def make_hybrid(name: str, seed: int = 0):
    model_type, class_name = HYBRIDS[name]
    config = tiny_config(AutoConfig.for_model(model_type))
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 2
    config.tie_word_embeddings = False
    return setup._random_init(getattr(transformers, class_name), config, seed, dtype=torch.float64)


@pytest.fixture(autouse=True)
def float64_inside():
    """float64 throughout, the recurrent fallbacks' float32 casts included (`models.tiny.float64_throughout`)."""
    with float64_throughout():
        yield


@pytest.mark.parametrize("name, loss_type", [("qwen3_5", "dapo"), ("nemotron_h", "grpo")])
def test_hybrid_swap_equals_grpo_trainer(tmp_path, caplog, name, loss_type):
    base = make_hybrid(name)
    options = dict(loss_type=loss_type, steps=2, gradient_checkpointing=False)
    stock = train(GRPOTrainer, copy.deepcopy(base), tmp_path, **options)
    with caplog.at_level(logging.WARNING, logger=pf_mixin.logger.name):
        pf = train(PrefixFlowGRPOTrainer, copy.deepcopy(base), tmp_path, **options)
    assert_aligned(stock, pf, rtol=1e-5)
    # the default memory rule ran and said, once, that its byte model is not calibrated on recurrent layers
    assert [r.getMessage() for r in caplog.records].count(pf_mixin.UNCALIBRATED_STATES) == 1


def test_hybrid_swap_under_checkpointing(tmp_path):
    base = make_hybrid("qwen3_5")
    recompute = {"use_reentrant": False, "context_fn": lambda: (contextlib.nullcontext(), float64_throughout())}
    options = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs=recompute, steps=2)
    assert_aligned(train(GRPOTrainer, copy.deepcopy(base), tmp_path, **options),
                   train(PrefixFlowGRPOTrainer, copy.deepcopy(base), tmp_path, **options), rtol=1e-5)


def test_packed_layout_is_refused_on_a_hybrid_model(tmp_path):
    """At construction, naming the cause and the fix."""
    with pytest.raises(PrefixFlowError, match="recurrent layers would carry one completion's state into the next; "
                                              "use prefixflow_layout='padded'"):
        train(PrefixFlowGRPOTrainer, make_hybrid("nemotron_h"), tmp_path, prefixflow_layout="packed",
              config_cls=PrefixFlowGRPOConfig)

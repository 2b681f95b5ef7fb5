"""Pipeline parallelism on CPU (gloo processes, one per stage): every stage trains exactly like one process training
the whole model; what cannot be split is refused before any step."""

import re

import pytest
import torch

from hf_prefixflow import PrefixFlowError, apply_prefixflow
from hf_prefixflow.distributed import pipeline
from launcher import torchrun
from models import build


@pytest.mark.parametrize("modes, family, layers, bounds, stages", [
    ("plain,refusals,stage_local", "qwen3", "4", None, 2),
    ("checkpointing,refusals,stage_local", "mistral", "5", "0,1,4,5", 3),  # sliding windows, uneven stages
    ("lora,checkpointing,offload,dp2", "qwen3", "4", None, 4),  # two pipeline replicas of two stages
])
def test_pipeline_matches_one_process(modes, family, layers, bounds, stages, tmp_path, monkeypatch):
    """Loss, every gradient and the weights after 3-4 SGD steps on every stage; prompts and completions of random
    lengths, right-padded waves of 1-2 rows, and a prompt too short to cache anything. Before them, bad groups raise
    on every stage (and leave the pipeline in step); stages switch from Phase A to B without waiting for each other."""
    monkeypatch.setenv("PIPELINE_TMP", str(tmp_path))
    result = torchrun("pipeline_worker.py", modes, family, layers, *([bounds] if bounds else []), nproc=stages)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    worst = float(re.search(r"max_rel (\S+)", result.stdout).group(1))
    assert worst < 1e-5


def test_dropped_boundary_gradient_is_caught():
    """Phase C without the gradient of the prefix output that the next stage sends back must fail the check."""
    result = torchrun("pipeline_worker.py", "no_boundary", "qwen3", "4")
    assert result.returncode != 0
    assert re.search(r"AssertionError: step 0 grad model\.", result.stderr), result.stderr[-3000:]


def test_split_keeps_names_and_drops_the_rest():
    full = dict(build("qwen3", num_hidden_layers=3).named_parameters())
    stages = [dict(pipeline.split_model(build("qwen3", num_hidden_layers=3), s, 2).named_parameters())
              for s in range(2)]
    assert not stages[0].keys() & stages[1].keys()
    assert stages[0].keys() | stages[1].keys() == full.keys()
    assert any(n.startswith("model.embed_tokens") for n in stages[0])
    assert {n.split(".")[2] for n in stages[0] if ".layers." in n} == {"0"}
    assert any(n.startswith("lm_head") for n in stages[1])


@pytest.mark.parametrize("family, overrides, match", [
    ("gpt2", {}, "embed_tokens, layers, norm and lm_head"),
    ("llama", {"tie_word_embeddings": True}, "untie them"),
])
def test_unsplittable_models_are_refused(family, overrides, match):
    with pytest.raises(PrefixFlowError, match=match):
        pipeline.split_model(build(family, **overrides), 0, 2)


def test_a_decoder_that_transforms_its_input_embeddings_is_refused():
    """Later stages enter the decoder with hidden states as `inputs_embeds`: a model that scales them first (as
    Gemma's forward once did) would scale them again on every stage."""
    model = build("llama")

    def scale(module, args, kwargs):
        return args, {**kwargs, "inputs_embeds": kwargs["inputs_embeds"] * 2.0}

    model.model.register_forward_pre_hook(scale, with_kwargs=True)
    with pytest.raises(PrefixFlowError, match="transforms inputs_embeds"):
        pipeline.split_model(model, 0, 2)


@pytest.mark.parametrize("stages, bounds, match", [
    (5, None, "cannot split 2 decoder layers"),
    (2, [0, 2, 2], "rise strictly"),
    (2, [0, 1], "rise strictly"),
])
def test_bad_splits_are_refused(stages, bounds, match):
    with pytest.raises(PrefixFlowError, match=match):
        pipeline.split_model(build("qwen3"), 0, stages, bounds)


def test_groups_outside_a_pipeline_are_refused():
    whole = apply_prefixflow(build("qwen3"))
    ids, mask = torch.zeros(4, 3, dtype=torch.long), torch.ones(4, 3, dtype=torch.long)
    with pytest.raises(PrefixFlowError, match=r"call pipeline.split_model"):
        pipeline.train_group(whole, ids[0], ids, mask, lambda logits, rows: logits.sum(), 2)
    stage = apply_prefixflow(pipeline.split_model(build("qwen3"), 0, 2))
    with pytest.raises(PrefixFlowError, match="initialise torch.distributed"):
        pipeline.train_group(stage, ids[0], ids, mask, lambda logits, rows: logits.sum(), 2)
    with pytest.raises(PrefixFlowError, match="already one pipeline stage"):
        pipeline.split_model(stage, 0, 2)

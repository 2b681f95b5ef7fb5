"""Ulysses sequence parallelism on CPU (two gloo processes): SP=2 trains exactly like one process, low level and in
the trainer; what cannot be sharded is refused before any step."""

import re

import pytest
import torch
from accelerate import ParallelismConfig

import grpo_setup
from equivalence import assert_rel_close
from hf_prefixflow import PrefixFlowError, PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer
from hf_prefixflow.distributed import ulysses
from launcher import torchrun
from models import build


def test_sp2_matches_one_process():
    """Loss, every gradient and the weights after 3 SGD steps; prompts and completions of odd lengths, padded
    waves, and a prompt too short to cache anything."""
    result = torchrun("ulysses_worker.py", "exact")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    worst = float(re.search(r"max_rel (\S+)", result.stdout).group(1))
    assert worst < 1e-5


@pytest.mark.parametrize("mode", ["no_phase_c", "no_reduce"])
def test_broken_sp_is_caught(mode):
    result = torchrun("ulysses_worker.py", mode)
    assert result.returncode != 0
    assert re.search(r"AssertionError: step 0 grad", result.stderr), result.stderr[-3000:]


@pytest.mark.parametrize("heads, kv_heads", [(3, 3), (4, 1)])
def test_heads_not_divisible_by_sp_are_refused(heads, kv_heads):
    model = build("qwen3", num_attention_heads=heads, num_key_value_heads=kv_heads)
    with pytest.raises(PrefixFlowError, match="do not divide by the SP size 2. Use an SP size in"):
        ulysses.check_model(model, 2)


def test_moe_is_refused():
    with pytest.raises(PrefixFlowError, match="MoE"):
        ulysses.check_model(build("qwen3_moe"), 2)


def test_trainer_sp2_matches_one_process_grpo(tmp_path):
    """PrefixFlowGRPOTrainer on two processes with ParallelismConfig(sp_size=2) against GRPOTrainer on one process,
    same global batch and frozen rollouts: weights after 2 steps, and both SP ranks hold the same weights."""
    for name, nproc in (("stock", 1), ("prefixflow", 2)):
        result = torchrun("sp_worker.py", name, str(tmp_path), nproc=nproc)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    start = {n: p.detach() for n, p in grpo_setup.make_model(dtype=torch.float64).named_parameters()}
    stock = torch.load(tmp_path / "stock_rank0.pt")
    ranks = [torch.load(tmp_path / f"prefixflow_rank{rank}.pt") for rank in (0, 1)]
    assert stock.keys() == ranks[0].keys()
    for name in stock:
        assert_rel_close(ranks[0][name] - start[name], stock[name] - start[name], f"update {name}")
        assert torch.equal(ranks[0][name], ranks[1][name]), name


def test_trainer_refuses_sp_without_processes_to_shard_over(tmp_path):
    args = PrefixFlowGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                                max_completion_length=4, use_cpu=True, report_to="none", prefixflow_sp_size=2)
    with pytest.raises(PrefixFlowError, match="prefixflow_sp_size=2 needs a multi-process DDP launch"):
        PrefixFlowGRPOTrainer(model=grpo_setup.make_model(), reward_funcs=grpo_setup.length_reward, args=args,
                              train_dataset=grpo_setup.make_dataset(), processing_class=grpo_setup.make_tokenizer())


def test_parallelism_config_beyond_sp_is_refused(tmp_path):
    with pytest.raises(PrefixFlowError, match="set dp_replicate_size, dp_shard_size, tp_size, cp_size to 1"):
        PrefixFlowGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             parallelism_config=ParallelismConfig(sp_size=2, tp_size=2, sp_backend="deepspeed"))

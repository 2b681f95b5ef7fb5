"""One rank of a GRPO run for tests/test_ulysses.py: `PrefixFlowGRPOTrainer` under Ulysses SP, or the stock trainer.

    python -m torch.distributed.run --nproc_per_node 2 tests/sp_worker.py prefixflow OUT_DIR   # SP=2
    python -m torch.distributed.run --nproc_per_node 1 tests/sp_worker.py stock OUT_DIR        # one process

Both train on the same global batch (8 rows, two prompts, per optimizer step) with frozen rollouts.
"""

import os
import sys

import torch
from accelerate import ParallelismConfig

sys.path.insert(0, os.path.dirname(__file__))

import grpo_setup as setup  # noqa: E402
from launcher import finish_worker  # noqa: E402
import trl.trainer.grpo_trainer as trl_grpo  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hf_prefixflow import PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer  # noqa: E402
from hf_prefixflow.trainers import mixin as pf_mixin  # noqa: E402
from hf_prefixflow.trainers.grouping import check_group_prompts  # noqa: E402


def main(name: str, out: str) -> None:
    # Same rows in the same microbatches for both trainers (normalisers depend on composition).
    trl_grpo.shuffle_sequence_dict = lambda batch: batch
    pf_mixin.shuffle_groups = (
        lambda batch, size, generator=None, offset=0: (check_group_prompts(batch, size, offset), batch)[1])
    processes = int(os.environ.get("WORLD_SIZE", 1))
    common = dict(output_dir=os.path.join(out, name), per_device_train_batch_size=8 // (2 * processes),
                  num_generations=4, gradient_accumulation_steps=2, max_completion_length=7, max_steps=2,
                  report_to="none", logging_steps=1, use_cpu=True, save_strategy="no", learning_rate=1e-2,
                  optim="sgd", seed=3, bf16=False, ddp_backend="gloo", disable_tqdm=True)
    if name == "stock":
        trainer_cls, args = GRPOTrainer, GRPOConfig(**common)
    else:  # accelerate's form of the request; PrefixFlow reads it as its own Ulysses SP of that size
        trainer_cls = PrefixFlowGRPOTrainer
        args = PrefixFlowGRPOConfig(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"), **common)
    model = setup.make_model(dtype=torch.float64)
    trainer = trainer_cls(model=model, reward_funcs=setup.length_reward, args=args,
                          train_dataset=setup.make_dataset(prompts=8, lengths=(9, 22)),
                          processing_class=setup.make_tokenizer())
    setup.freeze_rollouts(trainer, 7, per_prompt=True)
    trainer.train()
    rank = int(os.environ.get("RANK", 0))
    weights = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
    torch.save(weights, os.path.join(out, f"{name}_rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    finish_worker()

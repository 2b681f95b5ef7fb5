"""One rank of a data-parallel GRPO run on CPU (gloo), for tests/test_data_parallel.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/ddp_worker.py {stock|prefixflow} OUT_DIR [ZERO_STAGE]

Without a ZeRO stage the trainer runs DDP; with one, DeepSpeed ZeRO at that stage.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import grpo_setup as setup  # noqa: E402
import trl.trainer.grpo_trainer as trl_grpo  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hf_prefixflow import PrefixFlowGRPOTrainer  # noqa: E402
from trainers import grpo as pf_grpo  # noqa: E402
from trainers.grouping import check_group_prompts  # noqa: E402


def deepspeed_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
            "zero_allow_untested_optimizer": True, "bf16": {"enabled": False}}


def main(name: str, out: str, stage: int | None = None) -> None:
    # Same rows in the same microbatches for both trainers (normalisers depend on composition).
    trl_grpo.shuffle_sequence_dict = lambda batch: batch
    pf_grpo.shuffle_groups = lambda batch, size, generator=None: (check_group_prompts(batch, size), batch)[1]
    trainer_cls = {"stock": GRPOTrainer, "prefixflow": PrefixFlowGRPOTrainer}[name]
    args = GRPOConfig(output_dir=os.path.join(out, name), per_device_train_batch_size=2, num_generations=4,
                      gradient_accumulation_steps=2, max_completion_length=6, max_steps=2, report_to="none",
                      logging_steps=1, use_cpu=True, save_strategy="no", learning_rate=1e-2, optim="sgd", seed=3,
                      bf16=False, ddp_backend="gloo", disable_tqdm=True,
                      deepspeed=None if stage is None else deepspeed_config(stage))
    trainer = trainer_cls(model=setup.make_model(), reward_funcs=setup.length_reward, args=args,
                          train_dataset=setup.make_dataset(prompts=8), processing_class=setup.make_tokenizer())
    setup.freeze_rollouts(trainer, 6)
    trainer.train()
    rank = int(os.environ.get("RANK", 0))
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # gathers ZeRO-3 partitions
    if rank == 0:
        torch.save({n: t.detach().clone() for n, t in state.items()}, os.path.join(out, f"{name}_rank{rank}.pt"))
    if stage is None:  # DDP: every rank holds full weights; keep them to compare ranks
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        torch.save(weights, os.path.join(out, f"{name}_rank{rank}_params.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)

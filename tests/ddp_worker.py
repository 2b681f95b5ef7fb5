"""One rank of a data-parallel GRPO run on CPU (gloo), for tests/test_data_parallel.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/ddp_worker.py {stock|prefixflow} OUT_DIR ENGINE

ENGINE: ddp, zero1, zero2, zero3 (DeepSpeed ZeRO at that stage), fsdp2 (FSDP2 through Accelerate) or ddp_split
(DDP with one microbatch per step and two rows per process, so every group of four straddles the two processes); or
the deliberately broken zero3_ddp_rule (ZeRO-3, PrefixFlow given the DDP rule instead of ZeRO's).
"""

import os
import sys

import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, os.path.dirname(__file__))

import grpo_setup as setup  # noqa: E402
from launcher import finish_worker  # noqa: E402
import trl.trainer.grpo_trainer as trl_grpo  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hf_prefixflow import PrefixFlowGRPOTrainer  # noqa: E402
from hf_prefixflow.trainers import engine_rule, mixin as pf_mixin  # noqa: E402
from hf_prefixflow.trainers.grouping import check_group_prompts  # noqa: E402


def deepspeed_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
            "zero_allow_untested_optimizer": True, "bf16": {"enabled": False}}


def fsdp_on_cpu() -> None:
    """Accelerate turns an FSDP plugin into FSDP only on accelerators (MULTI_GPU and kin); on gloo it would silently
    train plain DDP. `fully_shard` itself runs on a CPU mesh, so let Accelerate's FSDP path run here too."""
    init = AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = patched


def engine_args(engine: str) -> dict:
    """The GRPOConfig arguments that select `engine` (DDP needs none beyond gloo)."""
    if engine == "ddp_split":
        return {"gradient_accumulation_steps": 1}  # steps_per_generation follows: 2 rows of a group per process
    if engine.startswith("zero"):
        return {"deepspeed": deepspeed_config(int(engine[len("zero")]))}
    if engine.startswith("fsdp"):
        return {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]}}
    return {}


def main(name: str, out: str, engine: str) -> None:
    # Same rows in the same microbatches for both trainers (normalisers depend on composition).
    trl_grpo.shuffle_sequence_dict = lambda batch: batch
    pf_mixin.shuffle_groups = (
        lambda batch, size, generator=None, offset=0: (check_group_prompts(batch, size, offset), batch)[1])
    trainer_cls = {"stock": GRPOTrainer, "prefixflow": PrefixFlowGRPOTrainer}[name]
    if engine.startswith("fsdp"):
        fsdp_on_cpu()
    if engine.endswith("_ddp_rule"):
        engine_rule.select = lambda accelerator, model, trainer: engine_rule.DataParallel(accelerator)
    args = GRPOConfig(**{**dict(output_dir=os.path.join(out, name), per_device_train_batch_size=2, num_generations=4,
                               gradient_accumulation_steps=2, max_completion_length=6, max_steps=2, report_to="none",
                               logging_steps=1, use_cpu=True, save_strategy="no", learning_rate=1e-2, optim="sgd",
                               seed=3, bf16=False, ddp_backend="gloo", disable_tqdm=True), **engine_args(engine)})
    trainer = trainer_cls(model=setup.make_model(), reward_funcs=setup.length_reward, args=args,
                          train_dataset=setup.make_dataset(prompts=8), processing_class=setup.make_tokenizer())
    setup.freeze_rollouts(trainer, 6)
    trainer.train()
    if engine == "fsdp2":  # not DDP in disguise
        assert isinstance(trainer.model_wrapped, FSDPModule), type(trainer.model_wrapped)
    rank = int(os.environ.get("RANK", 0))
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # gathers ZeRO-3 / FSDP shards
    if rank == 0:
        torch.save({n: t.detach().clone() for n, t in state.items()}, os.path.join(out, f"{name}_rank{rank}.pt"))
    if engine == "ddp_split" and name == "prefixflow":  # the groups did straddle the processes
        logs = trainer.state.log_history
        splits = [log["prefixflow/split_groups"] for log in logs if "prefixflow/split_groups" in log]
        assert splits and min(splits) >= 1, trainer.state.log_history
    if engine.startswith("ddp"):  # every rank holds full weights; keep them to compare ranks
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        torch.save(weights, os.path.join(out, f"{name}_rank{rank}_params.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    finish_worker()

"""Data parallel on CPU (two gloo processes): DDP, DeepSpeed ZeRO-1/2/3 and FSDP2 give the stock trainer's weights,
and so does DDP with every group split across the two processes (`ddp_split`); ZeRO given the DDP rule is caught."""

import os
from types import SimpleNamespace

import pytest
import torch
from launcher import torchrun

from hf_prefixflow import PrefixFlowError
from hf_prefixflow.distributed import fsdp
from hf_prefixflow.trainers.grouping import check_geometry

ENGINES = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "ddp_split"]


@pytest.fixture(scope="module", params=ENGINES)
def run(request, tmp_path_factory):
    engine = request.param
    out = str(tmp_path_factory.mktemp(engine))
    for name in ("stock", "prefixflow"):
        result = torchrun("ddp_worker.py", name, out, engine)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return engine, out


def test_matches_the_stock_trainer(run):
    engine, out = run
    stock, pf = (torch.load(os.path.join(out, f"{name}_rank0.pt")) for name in ("stock", "prefixflow"))
    assert stock.keys() == pf.keys()
    for name in stock:
        torch.testing.assert_close(pf[name], stock[name], rtol=0, atol=1e-5, msg=name)
    if engine.startswith("ddp"):  # every rank holds full weights and they must agree (ZeRO's and FSDP's are gathered)
        ranks = [torch.load(os.path.join(out, f"prefixflow_rank{rank}_params.pt")) for rank in (0, 1)]
        for name, weight in ranks[0].items():
            assert torch.equal(weight, ranks[1][name]), name


def test_zero_given_the_ddp_rule_is_caught(tmp_path):
    """Broken variant: a ZeRO-3 launch given the DDP rule instead of ZeRO's (`engine_rule.select`). Its groups close
    after each microbatch, so Phase C's backward runs outside the engine's accumulation window: the engine either
    meets the prefix's gradients a second time and stops (DeepSpeed's reduce bucket asserts, with current
    transformers) or reduces and steps without them (transformers 5.17). Either way the stock trainer's weights are
    not reached."""
    out = str(tmp_path)
    assert torchrun("ddp_worker.py", "stock", out, "zero3").returncode == 0
    result = torchrun("ddp_worker.py", "prefixflow", out, "zero3_ddp_rule")
    if result.returncode != 0:
        assert "Traceback" in result.stderr, result.stderr[-3000:]
        return
    stock, broken = (torch.load(os.path.join(out, f"{name}_rank0.pt")) for name in ("stock", "prefixflow"))
    assert any(not torch.allclose(broken[n], stock[n], rtol=0, atol=1e-5) for n in stock), "the broken rule passed"


def test_fsdp1_is_refused():
    # Accelerate cannot build an FSDP1 plugin without an accelerator, so this checks the rule PrefixFlowGRPOTrainer
    # applies at construction (`_check_supported`) on a stand-in accelerator.
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=1)))
    with pytest.raises(PrefixFlowError, match="fsdp_version: 2"):
        fsdp.check_config(accelerator, torch.nn.Linear(2, 2))
    accelerator.state.fsdp_plugin.fsdp_version = 2
    fsdp.check_config(accelerator, torch.nn.Linear(2, 2))


def test_groups_straddling_processes_are_split_under_ddp_only():
    # Two processes, per_device_train_batch_size=2, num_generations=4: TRL accepts steps_per_generation=1 (4 rows per
    # generation), but each process holds half a group. PrefixFlowGRPOTrainer checks this at construction: plain DDP
    # splits the group (`can_split`), ZeRO, FSDP2 and SP refuse it, naming the fix.
    with pytest.raises(PrefixFlowError, match="only under plain DDP.*steps_per_generation to a multiple of 2"):
        check_geometry(2, 4, steps_per_generation=1)
    with pytest.raises(PrefixFlowError, match="steps_per_generation to a multiple of 4"):
        check_geometry(2, 8, steps_per_generation=2)
    assert check_geometry(2, 4, steps_per_generation=1, can_split=True)
    assert not check_geometry(2, 4, steps_per_generation=2)
    assert not check_geometry(8, 4, steps_per_generation=1)

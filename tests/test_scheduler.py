"""Phase A -> B -> C equals full-sequence training: loss, every gradient, weights after optimizer steps (fp64)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_prefixflow import _compat
import hf_prefixflow
from equivalence import (
    assert_rel_close,
    pad,
    token_loss,
    assert_same_gradients,
    full_sequence_backward,
    gradients,
    prefixflow_backward,
    random_group,
    random_plan,
    train_side_by_side,
)
from models import FAMILIES, ROPE_VARIANTS, build


def _setup(family, lora=False, checkpointing=False, **overrides):
    model = build(family, **overrides)
    model.train()
    if checkpointing:
        _compat.enable_checkpointing(model)
    if lora:
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config).double()
    return model


def _steps(model, seed, steps=3, **group_kwargs):
    gen = torch.Generator().manual_seed(seed)
    groups = [random_group(gen, **group_kwargs) for _ in range(steps)]
    plans = [random_plan(gen, len(g.suffixes)) for g in groups]
    train_side_by_side(model, groups, plans)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_families_match_full_sequence(family, checkpointing):
    seed = 2 * sorted(FAMILIES).index(family) + checkpointing
    _steps(_setup(family, checkpointing=checkpointing), seed=seed)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "mistral"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_lora_matches_full_sequence(family, checkpointing):
    model = _setup(family, lora=True, checkpointing=checkpointing)
    _steps(model, seed=7 + checkpointing)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)


@pytest.mark.parametrize("rope", ["linear", "llama3", "yarn"])
def test_static_rope_scalings(rope):
    _steps(_setup("llama", rope_parameters=ROPE_VARIANTS[rope]), seed=11, prefix=(20, 40))


@pytest.mark.parametrize("seed", range(4))
def test_any_wave_split_gives_the_same_gradients(seed):
    gen = torch.Generator().manual_seed(seed)
    model = hf_prefixflow.apply_prefixflow(_setup("qwen2"))
    group = random_group(gen, n=(3, 8))
    results = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        loss = prefixflow_backward(model, group, random_plan(gen, len(group.suffixes)))
        results.append((loss, gradients(model)))
    for loss, grads in results[1:]:
        assert_rel_close(loss, results[0][0], "loss")
        assert_same_gradients(grads, results[0][1])


def test_padded_batch_reference_agrees():
    """The batched, right-padded full-sequence path (what TRL runs) is the same reference."""
    gen = torch.Generator().manual_seed(3)
    model, group = _setup("llama"), random_group(gen, n=(3, 5))
    full_sequence_backward(model, group)
    one_by_one = gradients(model)
    model.zero_grad(set_to_none=True)
    hf_prefixflow.apply_prefixflow(model)
    full_sequence_backward(model, group, batched=True, gen=gen)
    assert_same_gradients(gradients(model), one_by_one)


def test_single_token_prefix():
    """P = 1 leaves nothing to cache: the waves alone carry the whole computation."""
    _steps(_setup("llama"), seed=5, prefix=(1, 1))


def test_scoring_under_no_grad_matches_full_sequence_logits():
    gen = torch.Generator().manual_seed(9)
    model = hf_prefixflow.apply_prefixflow(_setup("gemma3").eval())
    group = random_group(gen)
    p = len(group.prefix)
    with torch.no_grad(), hf_prefixflow.prefix_group(model, group.prefix) as g:
        out = g.packed(group.suffixes)
        for logits, suffix in zip(out.split(out.logits), group.suffixes):
            full = model(torch.cat([group.prefix, suffix])[None]).logits[0, p - 1 : p - 1 + len(suffix)]
            assert_rel_close(logits, full, "scoring logits")


def _left_padded_reference(model, groups, width, gen):
    """What TRL runs: prompts left-padded to a common width, completions right-padded, one batch."""
    rows, masks, spans = [], [], []
    for group in groups:
        left = width - len(group.prefix)
        for suffix, weights in zip(group.suffixes, group.weights):
            rows.append(torch.cat([torch.randint(0, 97, (left,), generator=gen), group.prefix, suffix]))
            real = len(group.prefix) + len(suffix)
            masks.append(torch.cat([torch.zeros(left, dtype=torch.long), torch.ones(real, dtype=torch.long)]))
            spans.append((width - 1, suffix, weights))
    ids, real = pad(rows, gen)
    mask = pad(masks, gen)[0] * real  # right padding is masked too
    logits = model(input_ids=ids, attention_mask=mask).logits
    loss = sum(token_loss(logits[r, start : start + len(s)], s, w) for r, (start, s, w) in enumerate(spans))
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("family,seed", [("qwen3", 0), ("qwen3", 1), ("gpt2", 2), ("gpt2", 3)])
def test_session_of_several_left_padded_groups(family, seed):
    """Several groups open at once (a trainer's microbatch), positions shifted by left padding, waves interleaved,
    one group closed early: the same gradients as TRL's left-padded full-sequence batch."""
    gen = torch.Generator().manual_seed(seed)
    model = _setup(family)  # gpt2's learned absolute positions make the left-padding offset observable
    groups = [random_group(gen, n=(1, 4)) for _ in range(3)]
    width = max(len(g.prefix) for g in groups) + 2
    ref_loss = _left_padded_reference(model, groups, width, gen)
    reference = gradients(model)
    model.zero_grad(set_to_none=True)
    hf_prefixflow.apply_prefixflow(model)
    waves = [(gi, layout, rows) for gi, g in enumerate(groups) for layout, rows in random_plan(gen, len(g.suffixes))]
    waves = [waves[i] for i in torch.randperm(len(waves), generator=gen).tolist()]
    pf_loss = 0.0
    with hf_prefixflow.GroupSession(model) as session:
        opened = [session.open(g.prefix, position_offset=width - len(g.prefix)) for g in groups]
        for step, (gi, layout, rows) in enumerate(waves):
            group = groups[gi]
            suffixes = [group.suffixes[i] for i in rows]
            if layout == "padded":
                ids, mask = pad(suffixes, gen)
                logits = opened[gi](ids, attention_mask=mask).logits
                per_row = [logits[r, : len(s)] for r, s in enumerate(suffixes)]
            else:
                out = opened[gi].packed(suffixes)
                per_row = out.split(out.logits)
            loss = sum(token_loss(lg, s, group.weights[i]) for lg, s, i in zip(per_row, suffixes, rows))
            loss.backward()
            pf_loss += loss.item()
            remaining = [w[0] for w in waves[step + 1 :]]
            if remaining and gi not in remaining:
                session.close([opened[gi]])  # a group whose waves are done closes early; the last one on exit
    assert_rel_close(pf_loss, ref_loss, "loss")
    assert_same_gradients(gradients(model), reference)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_suffix_waves_can_keep_their_activations_under_checkpointing(family):
    """suffix_checkpointing=False: waves save activations instead of recomputing them; training is unchanged."""
    model = hf_prefixflow.apply_prefixflow(_setup(family, checkpointing=True), suffix_checkpointing=False)
    _steps(model, seed=41)

    gen = torch.Generator().manual_seed(5)
    group = random_group(gen, n=(2, 3))
    ids, mask = pad(group.suffixes, gen)
    saved = {}
    # (the model's setting, the group's override): a group's own setting wins (the trainer's 'auto' sets it per run)
    for setting in ((True, None), (False, None), (True, False), (False, True)):
        hf_prefixflow.apply_prefixflow(model, suffix_checkpointing=setting[0])
        count = []
        with hf_prefixflow.prefix_group(model, group.prefix) as g:
            g.suffix_checkpointing = setting[1]
            with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(1) or t, lambda t: t):
                out = g(ids, attention_mask=mask)
            out.logits.sum().backward()
        saved[setting] = len(count)
    assert saved[False, None] > 2 * saved[True, None], saved
    assert saved[True, False] == saved[False, None] and saved[False, True] == saved[True, None], saved


def test_kv_grads_sum_in_the_precision_of_the_trainable_weights():
    """gK/gV sum across waves as the model's own gradients accumulate: bf16 for bf16 weights, fp32 for PEFT's fp32
    adapters on a bf16 base, fp64 here in fp64; `kv_grad_dtype` overrides."""
    from hf_prefixflow.core.access import kv_grad_dtype

    model = hf_prefixflow.apply_prefixflow(build("llama"))
    assert kv_grad_dtype(model) == torch.float64
    model = model.bfloat16()
    prompt = torch.randint(3, 90, (9,))
    with hf_prefixflow.prefix_group(model, prompt) as group:
        for _ in range(2):
            group(torch.randint(3, 90, (2, 4))).logits.float().sum().backward()
        assert {t.grad.dtype for t in group.cache.tensors()} == {torch.bfloat16}
    lora = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))  # adapters in fp32
    assert kv_grad_dtype(lora) == torch.float32
    hf_prefixflow.apply_prefixflow(model, kv_grad_dtype=torch.float64)
    with torch.no_grad(), hf_prefixflow.prefix_group(lora, prompt) as group:
        assert group.cache.grad_dtype == torch.float64
    with pytest.raises(hf_prefixflow.PrefixFlowError, match="floating-point"):
        hf_prefixflow.apply_prefixflow(model, kv_grad_dtype=torch.int32)

"""MoE routing replay never stops training: a recording that is missing or cannot stand for the rows degrades.

A tiny Qwen3-MoE (random init, float64) with a byte-level tokenizer that carries Qwen3's chat template, so TRL's own
tool-calling loop, environments and custom rollouts run as a user would run them. Generation is the model's own
(its routers run and are recorded), with each row's tokens scripted by a logits processor: both trainers see the
same rollouts. Every run trains as `GRPOTrainer` does (loss, every gradient, weights after the step, relative 1e-5),
and rows whose routes cannot be replayed are counted in `prefixflow/routing_fallbacks`.
"""

from __future__ import annotations

import copy
import importlib
import json

import pytest
import torch
import trl.trainer.grpo_trainer as trl_grpo
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM, set_seed)
from trl import GRPOTrainer
from trl.chat_template_utils import is_chat_template_prefix_preserving, qwen3_template

from grpo_setup import GradientRecorder
from hf_prefixflow import PrefixFlowError, PrefixFlowGRPOConfig, PrefixFlowGRPOTrainer
from hf_prefixflow.core.moe import RoutingRecorder, record_routing
from hf_prefixflow.trainers import routing
from hf_prefixflow.trainers.grouping import check_group_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
            "<tool_response>", "</tool_response>"]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call><|im_end|>'
MALFORMED = ['<tool_call>\n{"name": "lookup", "arguments": {"key": </tool_call><|im_end|>',  # not JSON
             '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call><|im_end|>',  # no such tool
             '<tool_call>\n{"name": "lookup", "arguments": {"k": 1}}\n</tool_call><|im_end|>',  # wrong argument
             CALL]
TOOL_TURN = "<|im_start|>tool"  # a tool result in the context: the model answers


# Qwen3's turn format without its tool-description system prompt (short prompts); prefix-preserving, as TRL's tool loop
# requires. Tool calls are parsed with TRL's Qwen3 response template.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, no merges (one token per byte), Qwen3's special tokens, turn format and tool-call parsing."""
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                  additional_special_tokens=SPECIALS[1:])
    out.chat_template = CHAT_TEMPLATE
    out.response_template = qwen3_template
    return out


TOKENIZER = make_tokenizer()


def make_model(seed: int = 0) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                            pad_token_id=TOKENIZER.pad_token_id, eos_token_id=TOKENIZER.eos_token_id,
                            tie_word_embeddings=False)
    config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float64)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    return model


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    return key * 2


class LookupEnv:
    """A TRL environment (`environment_factory`): its methods are the tools of its rollout."""

    def reset(self, **kwargs):
        self.calls = 0

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: the key
        """
        self.calls += 1
        return key * 3


def tools_script(row: int, context: str) -> str:
    """Even rows call the tool, odd rows answer; after a tool result, every row answers."""
    if TOOL_TURN in context:
        return "done<|im_end|>"
    return CALL if row % 2 == 0 else "ok<|im_end|>"


def malformed_script(row: int, context: str) -> str:
    return "done<|im_end|>" if TOOL_TURN in context else MALFORMED[row % len(MALFORMED)]


def answer_script(row: int, context: str) -> str:
    return f"w{row} w{len(context) % 7}<|im_end|>"


class Scripted(LogitsProcessor):
    """Forces row r of a `generate` call to emit `script(r, its prompt text)`, then EOS: the model still runs (and
    its routers route) every step; only the sampled tokens are fixed."""

    def __init__(self, prompt_width: int, script):
        self.prompt_width, self.script, self.tokens = prompt_width, script, {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_width
        forced = torch.full_like(scores, -float("inf"))
        for row in range(input_ids.shape[0]):
            if row not in self.tokens:
                context = TOKENIZER.decode(input_ids[row, : self.prompt_width])
                self.tokens[row] = TOKENIZER(self.script(row, context), add_special_tokens=False)["input_ids"]
            tokens = self.tokens[row]
            forced[row, tokens[step] if step < len(tokens) else TOKENIZER.eos_token_id] = 0.0
        return forced


def script_generation(model, script, engine=None) -> None:
    """`model.generate` (TRL's transformers generation) emits the scripted tokens; `engine`: another model runs it."""
    generate = (engine or model).generate

    def scripted(*args, **kwargs):
        width = kwargs["input_ids"].shape[1]
        return generate(*args, logits_processor=LogitsProcessorList([Scripted(width, script)]), **kwargs)

    model.generate = scripted


@pytest.fixture(autouse=True)
def same_microbatches(monkeypatch):
    """Both trainers keep rows in sampler order, so microbatches hold the same rows."""
    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    for name in ("grpo", "mixin"):
        try:
            module = importlib.import_module(f"hf_prefixflow.trainers.{name}")
        except ImportError:
            continue
        if hasattr(module, "shuffle_groups"):
            monkeypatch.setattr(module, "shuffle_groups", lambda batch, size, generator=None, offset=0:
                                (check_group_prompts(batch, size, offset), batch)[1])


def reward(completions, **kwargs) -> list[float]:
    return [float(sum(map(ord, json.dumps(c, default=str))) % 7) for c in completions]


def conversations(prompts: int = 2, tools: bool = True) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"find w{i}" if tools else f"say w{i}"}]
                                         for i in range(prompts)]})


def train(trainer_cls, tmp_path, script=answer_script, dataset=None, engine=False, prepare=None, trainer_kwargs=None,
          **overrides):
    """Optimizer steps of two microbatches of two rows (two prompts of two completions) in float64."""
    options = dict(output_dir=str(tmp_path / trainer_cls.__name__), per_device_train_batch_size=2, num_generations=2,
                   gradient_accumulation_steps=2, max_completion_length=112, max_steps=1, report_to="none",
                   logging_steps=1, use_cpu=True, save_strategy="no", learning_rate=1e-2, optim="sgd", seed=3,
                   bf16=False, max_grad_norm=0.0, router_aux_loss_coef=0.0)
    options.update(overrides)
    set_seed(options["seed"])
    model = make_model()
    inference_copy = copy.deepcopy(model) if engine else None  # made before PrefixFlow hooks the routers
    trainer = trainer_cls(model=model, reward_funcs=reward, args=PrefixFlowGRPOConfig(**options),
                          train_dataset=dataset if dataset is not None else conversations(),
                          processing_class=make_tokenizer(), **(trainer_kwargs or {}))
    script_generation(trainer.model, script, inference_copy)
    if prepare is not None:
        prepare(trainer)
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return recorder.steps, weights, [log for log in trainer.state.log_history if "loss" in log]


def assert_same_training(stock, prefixflow, rtol=1e-5):
    (stock_grads, stock_weights, stock_logs), (pf_grads, pf_weights, pf_logs) = stock, prefixflow
    assert len(stock_grads) == len(pf_grads) > 0
    assert any(g.abs().max() > 0 for g in stock_grads[0].values())  # the rollouts' advantages are not all zero
    for step, (expected, actual) in enumerate(zip(stock_grads, pf_grads)):
        assert expected.keys() == actual.keys()
        for name in expected:
            err = (actual[name] - expected[name]).abs().max().item()
            scale = expected[name].abs().max().item()
            assert err <= rtol * scale + 1e-12, f"step {step} grad {name}: {err:.2e} vs {scale:.2e}"
    for name in stock_weights:
        torch.testing.assert_close(pf_weights[name], stock_weights[name], rtol=rtol, atol=1e-12, msg=name)
    assert len(stock_logs) == len(pf_logs) > 0
    for expected, actual in zip(stock_logs, pf_logs):
        assert actual["loss"] == pytest.approx(expected["loss"], rel=rtol, abs=1e-12)
        assert actual["reward"] == expected["reward"]


def both(tmp_path, **kwargs):
    return train(GRPOTrainer, tmp_path, **kwargs), train(PrefixFlowGRPOTrainer, tmp_path, **kwargs)


def routed_afresh(logs) -> list[float]:
    return [log.get("prefixflow/routing_fallbacks", 0.0) for log in logs]


# -- TRL's tools, environments, malformed tool calls, custom rollouts ---------------------------------------------


def test_tool_calls(tmp_path):
    """TRL's tool loop: the tool rows' results and later turns route afresh (counted), the rest replays."""
    stock, pf = both(tmp_path, script=tools_script, trainer_kwargs={"tools": [lookup]})
    assert_same_training(stock, pf)
    assert pf[2][0]["tools/call_frequency"] == 0.5
    assert routed_afresh(pf[2]) == [2.0]  # the two rows that called the tool
    assert pf[2][0]["prefixflow/groups"] > 0


def test_an_environment(tmp_path):
    stock, pf = both(tmp_path, script=tools_script, trainer_kwargs={"environment_factory": LookupEnv})
    assert_same_training(stock, pf)
    assert pf[2][0]["tools/call_frequency"] == 0.5
    assert routed_afresh(pf[2]) == [2.0]


def test_malformed_tool_calls(tmp_path):
    """Unparsable JSON, an unknown tool, a wrong argument: TRL answers with errors and generates on."""
    stock, pf = both(tmp_path, script=malformed_script, trainer_kwargs={"tools": [lookup]})
    assert_same_training(stock, pf)
    assert pf[2][0]["tools/failure_frequency"] > 0
    assert routed_afresh(pf[2])[0] > 0


def scripted_rollout(prompts, trainer) -> dict:
    """A custom rollout that generates nothing through the trainer: no routes recorded."""
    prompt_ids = [TOKENIZER.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
                  ["input_ids"] for p in prompts]
    completion_ids = [TOKENIZER(answer_script(i, str(p)), add_special_tokens=False)["input_ids"]
                      for i, p in enumerate(prompt_ids)]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def two_turn_rollout(prompts, trainer) -> dict:
    """A custom rollout that generates through the trainer, then once more after an observation (`env_mask` 0)."""
    prompt_ids = [TOKENIZER.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
                  ["input_ids"] for p in prompts]
    first, _ = trainer._generate_single_turn(prompt_ids, None, {}, trainer.num_generations)
    observation = TOKENIZER("\nobserved\n", add_special_tokens=False)["input_ids"]
    later, _ = trainer._generate_single_turn([p + c + observation for p, c in zip(prompt_ids, first)], None, {}, 1)
    return {"prompt_ids": prompt_ids, "completion_ids": [c + observation + m for c, m in zip(first, later)],
            "env_mask": [[1] * len(c) + [0] * len(observation) + [1] * len(m) for c, m in zip(first, later)],
            "logprobs": None}


@pytest.mark.parametrize("rollout, afresh", [(scripted_rollout, 4.0), (two_turn_rollout, 4.0)],
                         ids=["no-generation", "two-turns-through-the-trainer"])
def test_custom_rollouts(tmp_path, monkeypatch, rollout, afresh):
    """`rollout_func`: without the trainer's generation every row routes afresh; through it, each row replays its
    first turn and its observation and second turn route afresh."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    stock, pf = both(tmp_path, dataset=conversations(tools=False), trainer_kwargs={"rollout_func": rollout})
    assert_same_training(stock, pf)
    assert routed_afresh(pf[2]) == [afresh]


# -- recordings that cannot stand for the rows ---------------------------------------------------------------------


def test_generation_whose_routers_were_not_recorded(tmp_path, caplog):
    """Generation served by another copy of the model (no PrefixFlow hooks): the recorder sees no router call. The
    batch routes afresh, like a custom rollout, instead of stopping (it raised StopIteration)."""
    stock, pf = both(tmp_path, script=tools_script, engine=True, trainer_kwargs={"tools": [lookup]})
    assert_same_training(stock, pf)
    assert routed_afresh(pf[2]) == [4.0]
    assert pf[2][0]["prefixflow/groups"] > 0  # the batch still shares its prompts
    assert "MoE routing replay: no router ran while recording; the batch routes afresh" in caplog.text


def unchecked_record_turn(recorder, prompt_ids, completion_ids, num_layers, routed_layers, group_size, top_k,
                          pad_to_multiple_of=None):
    """The broken variant: read any recording as prefill + one decode call per token, unchecked."""
    width = routing.padded_width([len(p) for p in prompt_ids], pad_to_multiple_of)
    routes = routing.assemble(recorder, len(prompt_ids), width, max(len(c) for c in completion_ids), num_layers,
                              group_size, top_k)
    return routing.Recording([list(p) for p in prompt_ids], [list(c) for c in completion_ids], routes, width)


def test_beam_search_is_not_replayed(tmp_path, monkeypatch, caplog):
    """Beam search routes every beam: the recording holds more tokens than the rows and cannot be aligned with them.
    It routes afresh; read unchecked, it replays other tokens' experts and leaves GRPOTrainer's gradients."""
    options = {"dataset": conversations(tools=False), "generation_kwargs": {"num_beams": 2}, "max_steps": 2}
    stock, pf = both(tmp_path, **options)
    assert_same_training(stock, pf)
    assert routed_afresh(pf[2]) == [4.0, 4.0]  # both generations, warned once
    assert caplog.text.count("(beam search, assisted decoding or no KV cache?); the batch routes afresh") == 1
    monkeypatch.setattr(routing, "record_turn", unchecked_record_turn)
    with pytest.raises(AssertionError, match="grad"):
        assert_same_training(stock, train(PrefixFlowGRPOTrainer, tmp_path, **options))


def test_padded_and_chunked_generation_replays(tmp_path):
    """Prompts and completions padded to a multiple of 8, the prompts prefilled in chunks of 5 tokens: the recording
    is aligned with TRL's padded batch and replayed (nothing routes afresh)."""
    options = {"dataset": conversations(tools=False), "pad_to_multiple_of": 8,
               "generation_kwargs": {"prefill_chunk_size": 5}}
    stock, pf = both(tmp_path, **options)
    assert_same_training(stock, pf)
    assert routed_afresh(pf[2]) == [0.0]


def test_routes_that_do_not_fit_the_batch_route_afresh(tmp_path, monkeypatch, caplog):
    """Routes one token short of the batch TRL builds (a broken alignment) are never replayed: the old-policy scoring
    pass and the actor update route afresh, as GRPOTrainer does (both were errors)."""
    for_rollouts = routing.for_rollouts

    def one_token_short(*args, **kwargs):
        routes, fallbacks = for_rollouts(*args, **kwargs)
        return routes[:, :, :-1], fallbacks

    monkeypatch.setattr(routing, "for_rollouts", one_token_short)
    stock, pf = both(tmp_path, dataset=conversations(tools=False), num_iterations=2)  # old log-probs: a scoring pass
    assert_same_training(stock, pf)
    assert "no recorded routes match this forward's rows; they route afresh" in caplog.text
    assert "the recorded routes do not match the generated batch; it routes afresh" in caplog.text
    assert routed_afresh(pf[2])[0] > 0


# -- the recording itself ------------------------------------------------------------------------------------------


def recorded(model, prompts: list[list[int]], new_tokens: int, **generate_kwargs) -> RoutingRecorder:
    ids = torch.tensor(prompts)
    with torch.no_grad(), record_routing() as recorder:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, **generate_kwargs)
    return recorder


@pytest.fixture(scope="module")
def moe_model():
    import hf_prefixflow

    return hf_prefixflow.apply_prefixflow(make_model().eval())


def turn(recorder, prompts, completions, layers=(0, 1), group_size=1, pad=None) -> routing.Recording:
    return routing.record_turn(recorder, prompts, completions, 2, list(layers), group_size, 2, pad)


def test_a_recording_with_no_router_call_degrades():
    recorder = RoutingRecorder()
    recording = turn(recorder, [[5, 6, 7]], [[8, 9]])
    assert recording.routes is None and recording.gap == "no router ran while recording"
    routes, fallbacks = routing.for_rollouts(recording, [[5, 6, 7]], [[8, 9]])
    assert routes is routing.UNRECORDED
    assert fallbacks == [(f"{routing.FALLBACK}: no router ran while recording; the batch routes afresh", 1)]
    assert routing.for_rollouts(None, [[5]], [[6], [7]]) == (routing.UNRECORDED, [(routing.NOT_RECORDED, 2)])
    with pytest.raises(PrefixFlowError, match="no router ran while recording"):  # the recorder's own API refuses
        recorder.routes(1, 2)


def test_partial_recordings_degrade(moe_model):
    prompts, completions = [[10, 11, 12, 13], [20, 21, 22, 23]], [[30, 31, 32], [40, 41, 42]]
    good = recorded(moe_model, prompts, 3)
    recording = turn(good, prompts, completions)
    assert recording.gap is None and recording.prompt_width == 4
    assert recording.routes.shape == (2, 2, 7, 2)
    assert (recording.routes[:, :, 6] == -1).all() and (recording.routes[:, :, :6] >= 0).all()

    one_layer = RoutingRecorder()
    one_layer.calls = {0: good.calls[0]}
    assert turn(one_layer, prompts, completions).gap == "the routers of layers [1] did not run while recording"

    interrupted = RoutingRecorder()
    interrupted.calls = {layer: calls[:-1] for layer, calls in good.calls.items()}
    assert turn(interrupted, prompts, completions).gap == (
        "generation routed other tokens than the prompts' prefill and one decode step per generated token (beam "
        "search, assisted decoding or no KV cache?)")

    assert turn(good, prompts + [[1, 2, 3, 4]], completions + [[5]]).gap == \
        "a router call routed a token count that is not a multiple of the rows"
    assert turn(good, prompts, completions[:1]).gap == "generation returned another number of completions than prompts"

    uneven = RoutingRecorder()
    uneven.calls = {0: good.calls[0], 1: good.calls[1][:1] + [torch.cat(good.calls[1][1:])]}
    assert turn(uneven, prompts, completions).gap == "the layers' routers ran different token counts while recording"

    no_cache = recorded(moe_model, prompts, 3, use_cache=False)  # every step reruns the whole sequence
    assert turn(no_cache, prompts, completions).gap.startswith("generation routed other tokens")
    for recording in (turn(r, prompts, completions) for r in (one_layer, interrupted, uneven, no_cache)):
        routes, fallbacks = routing.for_rollouts(recording, prompts, completions)
        assert routes is routing.UNRECORDED and fallbacks[0][0].startswith(routing.FALLBACK)
        assert fallbacks[0][1] == 2


def test_rollouts_are_aligned_with_the_recording(moe_model):
    prompts, completions = [[10, 11, 12], [10, 11, 12]], [[30, 31], [40, 41]]
    recording = turn(recorded(moe_model, prompts, 2), prompts, completions, group_size=2)
    assert torch.equal(recording.routes[1, :, :3], recording.routes[0, :, :3])  # the group's prompt routes
    routes, fallbacks = routing.for_rollouts(recording, prompts, completions)
    assert torch.equal(routes, recording.routes) and fallbacks == []

    # Row 0 went on after a tool result; row 1's completion is not the one generation recorded.
    routes, fallbacks = routing.for_rollouts(recording, prompts, [[30, 31, 7, 8, 9], [41, 40]], pad_to_multiple_of=4)
    assert routes.shape == (2, 2, 3 + 8, 2)
    assert torch.equal(routes[0, :, :5], recording.routes[0]) and (routes[0, :, 5:] == -1).all()
    assert torch.equal(routes[1, :, :3], recording.routes[1, :, :3]) and (routes[1, :, 3:] == -1).all()
    assert fallbacks == [(routing.LATER_TURNS, 1),
                         (f"{routing.FALLBACK}: completions that do not continue the recorded turn route afresh", 1)]

    routes, fallbacks = routing.for_rollouts(recording, [[10, 11, 13], [10, 11, 12]], completions)
    assert routes is routing.UNRECORDED
    assert fallbacks == [(f"{routing.FALLBACK}: the rollouts' prompts are not the prompts generation recorded; the "
                          "batch routes afresh", 2)]

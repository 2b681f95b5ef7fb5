"""The trainer's processor runs once per distinct row of a batch: its outputs equal processing every row, for the
three layouts of image tensors (per patch: Qwen2-VL; per image: LLaVA; per row: Idefics3), with tensors and lists;
rows whose images differ by a pixel stay apart; a repetition that reads a layout wrong is caught by the first call's
check and sharing turns off, the outputs still those of every row."""

from __future__ import annotations

import logging
import pickle
import random

import numpy as np
import PIL.Image
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (BatchFeature, CLIPImageProcessorPil, Idefics3ImageProcessorPil, Idefics3Processor,
                          LlavaProcessor, PreTrainedTokenizerFast)

import synthetic_vision
from hf_prefixflow.trainers import processing

SPECIAL = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(["<pad>", *SPECIAL, *synthetic_vision.WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    return tokenizer


def qwen2_vl():
    return synthetic_vision.make_processor(), "<|vision_start|><|image_pad|><|vision_end|>"


def llava():
    images = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(image_processor=images, tokenizer=_tokenizer(), patch_size=14,
                          vision_feature_select_strategy="default"), "<image>"


def idefics3():
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 28},
                                    max_image_size={"longest_edge": 28})
    return Idefics3Processor(image_processor=images, tokenizer=_tokenizer(), image_seq_len=2), "<image>"


PROCESSORS = {"qwen2_vl": qwen2_vl, "llava": llava, "idefics3": idefics3}


def batch(placeholder: str, repeats: int = 3, seed: int = 0):
    """A GRPO batch: two prompts (one image; two images) each repeated `repeats` times, rows of one prompt carrying
    distinct but equal image objects, as a dataset decodes them per row."""
    def shapes(seed):
        rng = random.Random(seed)
        return [synthetic_vision.draw(colour, shape, 56, rng) for colour, shape in (("red", "square"),
                                                                                    ("blue", "circle"))]
    text, images = [], []
    for prompt, count in (("what is the colour", 1), ("what is the shape", 2)):
        for _ in range(repeats):
            text.append(" ".join([placeholder] * count) + " " + prompt)
            images.append([image for image in shapes(seed)[:count]])
    return text, images


class Holder:
    """What `RowsOnce.applied` needs of a trainer."""

    def __init__(self, processor):
        self.processing_class = processor


def counting(processor) -> list[int]:
    """Images each call of the image processor receives."""
    seen, preprocess = [], processor.image_processor.preprocess

    def counted(images, *args, **kwargs):
        seen.append(sum(len(row) if isinstance(row, list) else 1 for row in images))
        return preprocess(images, *args, **kwargs)

    processor.image_processor.preprocess = counted
    return seen


@pytest.mark.parametrize("return_tensors", ["pt", None])
@pytest.mark.parametrize("family", sorted(PROCESSORS))
def test_outputs_equal_processing_every_row(family, return_tensors):
    processor, placeholder = PROCESSORS[family]()
    text, images = batch(placeholder)
    expected = processor(images=images, text=text, padding=True, return_tensors=return_tensors)
    seen, sharing, holder = counting(processor), processing.RowsOnce(), Holder(processor)
    for _ in range(2):  # the first call of a kind is checked against every row; later ones run once per row
        with sharing.applied(holder):
            out = holder.processing_class(images=images, text=text, padding=True, return_tensors=return_tensors)
        assert holder.processing_class is processor
        assert processing.same_outputs(out, expected)
    assert sharing.enabled and seen == [3, 9, 3]


def test_chat_template_tokenization_as_trl_runs_it():
    """TRL's `_tokenize_prompts`: `apply_chat_template(tokenize=True)` on conversations calls the processor inside."""
    processor, _ = qwen2_vl()
    _, images = batch("")
    conversations = [[{"role": "user", "content": [{"type": "image", "image": image} for image in row]
                       + [{"type": "text", "text": "what is the colour"}]}] for row in images]
    kwargs = dict(conversation=conversations, add_generation_prompt=True, tokenize=True, return_dict=True)
    expected = processor.apply_chat_template(**kwargs)
    seen, sharing, holder = counting(processor), processing.RowsOnce(), Holder(processor)
    for _ in range(2):
        with sharing.applied(holder):
            out = holder.processing_class.apply_chat_template(**kwargs)
        assert processing.same_outputs(out, expected)
    assert seen == [3, 9, 3]


def test_rows_differing_by_a_pixel_stay_apart():
    processor, placeholder = qwen2_vl()
    text, images = batch(placeholder)
    images[1] = [images[1][0].copy()]
    images[1][0].putpixel((0, 0), (0, 0, 0))
    firsts, index = processing.distinct_rows(text, images)
    assert firsts == [0, 1, 3] and index == [0, 1, 0, 2, 2, 2]
    sharing, holder = processing.RowsOnce(), Holder(processor)
    for _ in range(2):
        with sharing.applied(holder):
            out = holder.processing_class(images=images, text=text, padding=True, return_tensors="pt")
        assert processing.same_outputs(out, processor(images=images, text=text, padding=True, return_tensors="pt"))


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_a_wrong_repetition_is_caught_and_sharing_turns_off(family, monkeypatch, caplog):
    """Broken variant: images repeated by row instead of by their rows' spans. The first call's check sees it."""
    processor, placeholder = PROCESSORS[family]()
    text, images = batch(placeholder)
    monkeypatch.setattr(processing, "_spans", lambda sizes, index: list(index))
    expected = processor(images=images, text=text, padding=True, return_tensors="pt")
    once = processor(images=[images[0], images[3]], text=[text[0], text[3]], padding=True, return_tensors="pt")
    assert not processing.same_outputs(processing.repeat_rows(once, [0, 0, 0, 1, 1, 1], [1, 2]), expected)
    sharing, holder = processing.RowsOnce(), Holder(processor)
    with caplog.at_level(logging.WARNING), sharing.applied(holder):
        out = holder.processing_class(images=images, text=text, padding=True, return_tensors="pt")
    assert processing.same_outputs(out, expected)
    assert not sharing.enabled and "differ from processing every row" in caplog.text
    with sharing.applied(holder):
        assert holder.processing_class is processor  # off for the rest of the run


def test_layouts_it_cannot_read_process_every_row():
    """Several entries per image (tiles, pan-and-scan crops) whose count happens to equal the rows', an output of an
    unknown name, a 0-d output: nothing is repeated."""
    tiles = BatchFeature({"input_ids": [[1], [2], [3]], "pixel_values": np.zeros((3, 3, 2, 2))})
    assert processing.repeat_rows(tiles, [0, 0, 1, 2], [1, 0, 0]) is None
    unknown = BatchFeature({"input_ids": [[1], [2]], "num_crops": [0, 0]})
    assert processing.repeat_rows(unknown, [0, 1, 1], [1, 1]) is None
    assert processing.repeat_rows(BatchFeature({"input_ids": torch.tensor(1)}), [0, 0], [1]) is None
    one_each = BatchFeature({"input_ids": [[1], [2]], "image_sizes": [[28, 28], [28, 28]]})
    assert processing.repeat_rows(one_each, [0, 0, 1], [1, 1])["image_sizes"] == [[28, 28]] * 3


def test_rows_without_images_and_calls_with_videos():
    processor, placeholder = qwen2_vl()
    text, images = batch(placeholder)
    text += ["what is it"] * 2
    images += [[], []]
    sharing, holder, seen = processing.RowsOnce(), Holder(processor), counting(processor)
    expected = processor(images=images, text=text, padding=True, return_tensors="pt")
    for _ in range(2):
        with sharing.applied(holder):
            out = holder.processing_class(images=images, text=text, padding=True, return_tensors="pt")
        assert processing.same_outputs(out, expected)
    assert sharing.enabled and seen[-1] == 3
    calls = []
    sharing.call(lambda **kwargs: calls.append(kwargs), {"images": images, "text": text, "videos": [[1]] * len(text)})
    assert len(calls) == 1 and calls[0]["images"] is images  # with videos: every row, as given


def test_images_equal_only_with_their_metadata():
    """A palette image with a transparent index reads other pixels than the same bytes without it."""
    plain = PIL.Image.new("P", (4, 4))
    plain.putpalette([0, 0, 0, 255, 255, 255] * 128)
    transparent = plain.copy()
    transparent.info["transparency"] = 1
    content = processing.image_content
    assert content(plain) == content(plain.copy())
    assert content(plain) != content(transparent)
    assert content(np.zeros((4, 4), np.uint8)) != content(PIL.Image.new("L", (4, 4)))


def test_a_view_pickles_as_its_processor():
    processor, _ = qwen2_vl()
    holder = Holder(processor)
    with processing.RowsOnce().applied(holder):
        copy = pickle.loads(pickle.dumps(holder.processing_class))
    assert type(copy) is type(processor) and copy.image_processor.patch_size == processor.image_processor.patch_size

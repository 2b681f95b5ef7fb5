"""A synthetic image task, a Qwen2-VL processor built locally, and a tiny Qwen2-VL: runnable offline.

Each prompt shows one or more images of a coloured shape drawn with PIL and asks for the colour and shape of the
first; the reward checks both words appear in the completion. Images make the prompt long (each a few hundred
tokens at full size), completions are short.
"""

from __future__ import annotations

import random

import torch
from datasets import Dataset
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                          Qwen2VLImageProcessorPil, Qwen2VLProcessor)
from transformers.processing_utils import ProcessorMixin

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle", "triangle")
SPECIALS = ["<pad>", "<|im_end|>", "<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
WORDS = ["user", "assistant", "what", "is", "the", "colour", "and", "shape", "of", "first", "image", "?", "a", "it",
         *COLOURS, *SHAPES]
# Qwen2-VL's template, reduced to what the task uses: user turns of images and text, then the assistant header.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ImageProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor for images only: its video processor needs torchvision."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


def make_processor(patch: int = 14, image_size: int = 56) -> ImageProcessor:
    """A word-level tokenizer over the task's words and Qwen2-VL's image processor: an `image_size` square image
    becomes (image_size / patch)^2 patches, a quarter as many tokens."""
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                        padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[2:]})
    pixels = image_size * image_size
    images = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=pixels,
                                   max_pixels=pixels)
    return ImageProcessor(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def make_model(processor: ImageProcessor, hidden: int = 64, layers: int = 2, vision_layers: int = 2,
               seed: int = 0) -> Qwen2VLForConditionalGeneration:
    """A tiny random-init Qwen2-VL sized to the processor."""
    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    head_dim = hidden // 4
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=8192, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": _sections(head_dim // 2)}),
        vision_config=dict(depth=vision_layers, embed_dim=hidden, hidden_size=hidden, num_heads=4, mlp_ratio=2,
                           patch_size=processor.image_processor.patch_size, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3),
        tie_word_embeddings=True, **ids)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config)


def _sections(rotary: int) -> list[int]:
    """Qwen2-VL's split of the rotary frequencies over (time, height, width): 16/24/24 of 64, scaled."""
    time = rotary // 4
    height = (rotary - time) // 2
    return [time, height, rotary - time - height]


def draw(colour: str, shape: str, size: int, rng: random.Random) -> Image.Image:
    """A `size` square image of one filled shape on a light background, placed at random."""
    image = Image.new("RGB", (size, size), (245, 245, 245))
    pen = ImageDraw.Draw(image)
    extent = rng.randint(size // 3, size // 2)
    x, y = rng.randint(0, size - extent), rng.randint(0, size - extent)
    box = (x, y, x + extent, y + extent)
    if shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    else:
        pen.polygon([(x + extent // 2, y), (x, y + extent), (x + extent, y + extent)], fill=COLOURS[colour])
    return image


def make_dataset(rows: int, images: int = 1, image_size: int = 56, seed: int = 0) -> Dataset:
    """`rows` prompts of `images` shape images and the question; columns prompt (conversational), images, answer
    ("<colour> <shape>" of the first image)."""
    rng = random.Random(seed)
    prompts, pictures, answers = [], [], []
    for _ in range(rows):
        drawn = [(rng.choice(list(COLOURS)), rng.choice(SHAPES)) for _ in range(images)]
        pictures.append([draw(colour, shape, image_size, rng) for colour, shape in drawn])
        content = [{"type": "image"} for _ in drawn] + [
            {"type": "text", "text": " what is the colour and shape of the first image ? "}]
        prompts.append([{"role": "user", "content": content}])
        answers.append(" ".join(drawn[0]))
    return Dataset.from_dict({"prompt": prompts, "images": pictures, "answer": answers})


def shape_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """Half a point each for the colour and the shape of the first image among the completion's words."""
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        words = text.split()
        rewards.append(sum(0.5 for word in expected.split() if word in words))
    return rewards

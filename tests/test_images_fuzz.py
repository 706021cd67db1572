"""A seeded fuzz test of prompts with images on every image package form, against transformers on the same
weights and the same processor output: per case a package (mobius-onnx's Qwen2.5-VL, the builder's
decoder beside its vision model, Gemma 3 with its images marked for attention both ways or not, Pixtral,
Gemma 4), a batch of one to four rows each with no image, one or two of random sizes where the text puts
them, padded on the left or the right; the logits at every real position, then a cache's steps of one to
three tokens (each the last columns of transformers' forward over the whole sequence), a crop of the
cache and a step again; or `generate` (greedy, sampled under one seed, beams). `IMAGE_FORWARD_FUZZ_SEEDS=N`
runs N cases (the test files of each form hold the fixed cases: tests/test_images*.py)."""

import random

import numpy as np
import pytest
import torch
import transformers
from helpers import fuzz_seeds, load_pair, padded_rows
from PIL import Image

SEEDS = fuzz_seeds("IMAGE_FORWARD_FUZZ_SEEDS", 10)
TOL = dict(atol=1e-4, rtol=1e-4)


def pictures(rng: random.Random, sizes) -> list:
    state = np.random.RandomState(rng.randrange(2**31))
    return [Image.fromarray((state.rand(h, w, 3) * 255).astype("uint8")) for h, w in sizes]


class Form:
    """An image package form: its fixture, how its processor lays an image's tokens out and what it gives."""

    arch, image, sides = "", 0, (8, 64)

    def process(self, images: list) -> tuple[dict, list[list[int]]]:
        """The processor's image keywords for `images` (at least one), and each image's tokens."""
        raise NotImplementedError

    def marks(self, ids: torch.Tensor) -> dict:
        """The keywords the processor gives beside `input_ids`."""
        return {}


class QwenVL(Form):
    arch, image, sides = "qwen2_5_vl", 511, (8, 64)  # the fixture's image token; start 509, end 508

    def process(self, images):
        out = transformers.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                                    min_pixels=64, max_pixels=64 * 64)(images=images,
                                                                                         return_tensors="pt")
        tokens = [[509] + [self.image] * (t * h * w // 4) + [508] for t, h, w in out["image_grid_thw"].tolist()]
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}, tokens

    def marks(self, ids):
        return {"mm_token_type_ids": (ids == self.image).long()}


class QwenVLBuilder(QwenVL):
    arch = "qwen2_5_vl_builder"


class Gemma3(Form):
    arch, image, sides = "gemma3_vl", 511, (8, 60)  # begin 510, end 509; 4 tokens an image of 32 x 32

    def __init__(self, marked: bool):
        self.marked = marked

    def process(self, images):
        pixels = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})(
            images, return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixels}, [[510] + [self.image] * 4 + [509] for _ in images]

    def marks(self, ids):
        return {"token_type_ids": (ids == self.image).long()} if self.marked else {}


class Pixtral(Form):
    arch, image, sides = "mistral3", 511, (8, 64)  # a row break 510, the image's end 509; 8 pixels a token

    def process(self, images):
        out = transformers.PixtralImageProcessorPil(patch_size=8, size={"longest_edge": 64})(
            images, return_tensors="pt")
        tokens = []
        for height, width in out["image_sizes"].tolist():
            rows = [[self.image] * (width // 8) + [510] for _ in range(height // 8)]
            tokens.append(sum(rows, [])[:-1] + [509])
        return {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}, tokens


class Gemma4(Form):
    arch, image, sides = "gemma4_mobius", 509, (12, 60)  # begin 511, end 510

    def process(self, images):
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        out = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)(
            images, return_tensors="pt")
        tokens = [[511] + [self.image] * n + [510] for n in out["num_soft_tokens_per_image"].tolist()]
        return {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}, tokens

    def marks(self, ids):
        return {"mm_token_type_ids": (ids == self.image).long()}


FORMS = [QwenVL(), QwenVLBuilder(), Gemma3(marked=True), Gemma3(marked=False), Pixtral(), Gemma4()]


def drawn_batch(rng: random.Random, form: Form, left: bool) -> tuple[dict, str]:
    """Rows of text with images placed at random (at least one image in the batch), padded."""
    counts = [rng.choice([0, 1, 1, 2]) for _ in range(rng.randint(1, 4))]
    if not any(counts):
        counts[rng.randrange(len(counts))] = 1
    sizes = [(rng.randint(*form.sides), rng.randint(*form.sides)) for _ in range(sum(counts))]
    keywords, tokens = form.process(pictures(rng, sizes))
    rows, drawn = [], iter(tokens)
    for count in counts:
        pieces = [[rng.randrange(10, 500) for _ in range(rng.randint(0, 6))] for _ in range(count + 1)]
        pieces[0] = pieces[0] or [rng.randrange(10, 500)]  # a row begins with text
        pieces[-1] += [rng.randrange(10, 500) for _ in range(2)]  # and ends with two tokens a crop may take
        row = pieces[0]
        for piece in pieces[1:]:
            row += next(drawn) + piece
        rows.append(row)
    ids, mask = padded_rows(rows, left=left)
    return dict(input_ids=ids, attention_mask=mask, **keywords), f"images {counts} of sizes {sizes}"


def reference(hf, form: Form, given: dict):
    hf_model = getattr(hf, "model", None)
    if getattr(hf_model, "rope_deltas", None) is not None:  # the Qwen-VL models keep the last prompt's
        hf_model.rope_deltas = None
    with torch.no_grad():
        return hf(**given, **form.marks(given["input_ids"])).logits


def check_steps(model, hf, form: Form, given: dict, rng: random.Random, what: str) -> None:
    """Steps over the prompt's cache, a crop, a step: each the whole sequence's last columns in transformers."""
    out = model(**given, **form.marks(given["input_ids"]), use_cache=True, logits_to_keep=1)
    cache, ids, mask = out.past_key_values, given["input_ids"], given["attention_mask"]
    for step in range(rng.randint(1, 3)):
        if step and rng.random() < 0.5:
            drop = rng.randint(1, 2)
            cache.crop(-drop)
            ids, mask = ids[:, :-drop], mask[:, :-drop]
        new = rng.randint(1, 3)
        tokens = torch.tensor([[rng.randrange(10, 500) for _ in range(new)] for _ in range(len(ids))])
        ids, mask = torch.cat([ids, tokens], 1), torch.cat([mask, torch.ones_like(tokens)], 1)
        ours = model(tokens, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        theirs = reference(hf, form, dict(given, input_ids=ids, attention_mask=mask))[:, -tokens.shape[1]:]
        assert torch.allclose(ours, theirs, **TOL), f"{what}: step {step} of {tokens.shape[1]} tokens"


@pytest.mark.parametrize("seed", SEEDS)
def test_images_fuzz(build, seed):
    rng = random.Random(9000 + seed)
    form = rng.choice(FORMS)
    model, hf = load_pair(build(form.arch))
    left = rng.random() < 0.7
    given, drawn = drawn_batch(rng, form, left)
    what = f"seed {9000 + seed}: {form.arch}{' marked' if getattr(form, 'marked', False) else ''}, " \
           f"{'left' if left else 'right'}-padded rows of {given['attention_mask'].sum(1).tolist()} tokens, {drawn}"
    real = given["attention_mask"].bool()
    ours = model(**given, **form.marks(given["input_ids"])).logits
    assert torch.allclose(ours[real], reference(hf, form, given)[real], **TOL), what
    if not left:
        return
    if rng.random() < 0.5:
        check_steps(model, hf, form, given, rng, what)
        return
    # do_sample given each time: mobius-onnx's packages say `do_sample` true with `top_k` 1 (greedy tokens by
    # sampling from one) whatever the checkpoint says, and generate takes the package's defaults (docs/usage.md)
    mode = rng.choice([dict(do_sample=False), dict(do_sample=True, top_k=20), dict(do_sample=False, num_beams=2)])
    options = dict(max_new_tokens=rng.randint(1, 6), pad_token_id=2, suppress_tokens=list(range(500, 512)), **mode)
    inputs = dict(given, **form.marks(given["input_ids"]))
    torch.manual_seed(seed)
    expected = hf.generate(**inputs, **options)
    torch.manual_seed(seed)
    assert torch.equal(model.generate(**inputs, **options), expected), f"{what}, {options}"

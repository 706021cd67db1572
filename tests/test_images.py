"""Images in prompts (ortmodule/images.py): on the Qwen2.5-VL package (mobius-onnx: vision encoder,
embedding model, mRoPE decoder) forward, cached steps, hidden states, the loss and generate equal
transformers' Qwen2_5_VLForConditionalGeneration on the same weights and the same processor output;
what the images cannot be is refused by name."""

import base64
import io
import json
import os
import random
import re
import threading
import time

import numpy as np
import pytest
import torch
import transformers
from helpers import (
    check_generate_modes,
    check_half_precision_images,
    check_hidden_states_with_images,
    check_image_task,
    hf_multimodal,
    image_task_responses,
    load_pair,
    padded_rows,
    tokenizer_with,
)
from PIL import Image

from ortmodule import NotSupportedError, OrtModelForCausalLM

IMAGE, START, END = 511, 509, 508  # the fixture's reserved ids (ortmodule_dev/fixtures.py)
PROCESSOR = dict(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=64 * 64)


def processed(*sizes, seed=0):
    """What transformers' Qwen2-VL image processor makes of random RGB images of `sizes` (h, w)."""
    state = np.random.RandomState(seed)
    pictures = [Image.fromarray((state.rand(h, w, 3) * 255).astype("uint8")) for h, w in sizes]
    out = transformers.Qwen2VLImageProcessorPil(**PROCESSOR)(images=pictures, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def prompt(grids, text=5, seed=0):
    """Token ids: text, then for each grid a vision start, its image tokens, a vision end and text."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 500, (text,), generator=generator).tolist()
    for t, h, w in grids:
        ids += [START] + [IMAGE] * (t * h * w // 4) + [END] + torch.randint(10, 500, (3,), generator=generator).tolist()
    return ids


# mobius-onnx's Qwen2.5-VL package (its decoder concatenates its cache), and the builder's decoder of the
# same checkpoint (GroupQueryAttention: a batch's shared KV buffer) beside mobius-onnx's vision and embedding.
PACKAGES = ["qwen2_5_vl", "qwen2_5_vl_builder"]


@pytest.fixture(scope="module", params=PACKAGES)
def pair(build, request):
    return load_pair(build(request.param))


@pytest.fixture(scope="module")
def inputs():
    """Three rows: one image, two images, none; the images as the processor gives them."""
    pixels, grids = processed((28, 20), (16, 40), (24, 24))
    sizes = grids.tolist()
    ids, mask = padded_rows([prompt(sizes[:1], 7, 1), prompt(sizes[1:], 5, 2), prompt([], 12, 3)])
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids,
                mm_token_type_ids=(ids == IMAGE).long())


def reference(hf, **given):
    with torch.no_grad():
        return hf(**given)


@pytest.mark.parametrize("left", [True, False])
def test_logits_equal_transformers_with_images(pair, inputs, left):
    model, hf = pair
    given = dict(inputs)
    if not left:  # the same rows right-padded
        rows = [r[m.bool()].tolist() for r, m in zip(given["input_ids"], given["attention_mask"])]
        given["input_ids"], given["attention_mask"] = padded_rows(rows, left=False)
        given["mm_token_type_ids"] = (given["input_ids"] == IMAGE).long()
    real = given["attention_mask"].bool()
    full = reference(hf, **given).logits
    expected = full[real]
    assert torch.allclose(model(**given).logits[real], expected, atol=1e-4, rtol=1e-4)
    padded_with_images = given["input_ids"].masked_fill(given["attention_mask"] == 0, IMAGE)  # not counted
    assert torch.allclose(model(**dict(given, input_ids=padded_with_images)).logits[real], expected, atol=1e-4,
                          rtol=1e-4)
    if left:  # the last columns only, through the LM head at those positions
        assert torch.allclose(model(**given, logits_to_keep=3).logits, full[:, -3:], atol=1e-4, rtol=1e-4)
    # Without the processor's token types: found from the image token id.
    given.pop("mm_token_type_ids")
    assert torch.allclose(model(**given).logits[real], expected, atol=1e-4, rtol=1e-4)
    # The images change the numbers: the same ids without them give other logits.
    text = model(given["input_ids"], attention_mask=given["attention_mask"]).logits[real]
    assert (text - expected).abs().max() > 1e-2


def test_a_half_precision_package_answers_within_its_rounding(build, inputs):
    """mobius-onnx's Qwen2.5-VL package in fp16 (`mobius build --dtype f16`, what a GPU runs; bf16 has
    no CPU kernels in ONNX Runtime): the vision, embedding and decoder models take and give fp16, and
    with images the logits stay within fp16's rounding of transformers' fp32 on the same weights, and
    greedy generate makes the same tokens."""
    check_half_precision_images(*load_pair(build("qwen2_5_vl", precision="fp16")), inputs)  # transformers in fp32


def test_a_bf16_package_on_a_cpu_is_refused_naming_why(build):
    """mobius-onnx's bf16 export has operators ONNX Runtime runs in bf16 on CUDA only: loading it for
    the CPU names the precision and what to do, not the exporter."""
    from ortmodule import PackageError

    with pytest.raises(PackageError, match="It is a bf16 package.*load it with device='cuda'"):
        OrtModelForCausalLM.from_pretrained(build("qwen2_5_vl", precision="bf16").package_dir)


def test_hidden_states_with_images_equal_transformers(pair, inputs):
    """`output_hidden_states=True` with images (mobius-onnx's graph: its norms found by their weights'
    names): every layer's input and the final norm's output at every real position, then a step's,
    as transformers gives them."""
    model, hf = pair
    out = check_hidden_states_with_images(model, hf, inputs, layers=2)
    tokens = torch.tensor([[7], [8], [9]])
    mask = torch.cat([inputs["attention_mask"], torch.ones(3, 1, dtype=torch.int64)], 1)
    step = model(tokens, attention_mask=mask, past_key_values=out.past_key_values, output_hidden_states=True)
    ids = torch.cat([inputs["input_ids"], tokens], 1)
    whole = reference(hf, **dict(inputs, input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == IMAGE).long()),
                      output_hidden_states=True)
    for ours, theirs in zip(step.hidden_states, whole.hidden_states):
        assert torch.allclose(ours[:, -1], theirs[:, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", PACKAGES)
def test_attentions_with_images_equal_transformers(build, inputs, arch):
    """`output_attentions=True` with images, on mobius-onnx's decoder (ONNX's Attention) and the
    builder's (GroupQueryAttention): every layer's weights at the real queries as transformers' eager
    attention gives them, mRoPE positions and all."""
    fixture = build(arch)
    model = load_pair(fixture)[0]
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(fixture.hf_dir, dtype=torch.float32,
                                                                         attn_implementation="eager").eval()
    real = inputs["attention_mask"].bool()
    ours = model(**inputs, output_attentions=True).attentions
    theirs = reference(hf, **inputs, output_attentions=True).attentions
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        assert (a - b)[real[:, None, :, None].expand_as(a)].abs().max().item() < 1e-5


@pytest.mark.parametrize("left", [True, False])
def test_qwen2_vl_by_mobius_answers_as_transformers(build, inputs, left):
    """mobius-onnx 0.1 writes Qwen2-VL (its own vision tower) in Qwen2.5-VL's form too: logits equal
    transformers' Qwen2VLForConditionalGeneration on the same weights and processor output."""
    model, hf = load_pair(build("qwen2_vl"))
    rows = [r[m.bool()].tolist() for r, m in zip(inputs["input_ids"], inputs["attention_mask"])]
    ids, mask = padded_rows(rows, left)
    given = dict(inputs, input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == IMAGE).long())
    real = mask.bool()
    expected = reference(hf, **given).logits[real]
    assert torch.allclose(model(**given).logits[real], expected, atol=1e-4, rtol=1e-4)
    assert (model(ids, attention_mask=mask).logits[real] - expected).abs().max() > 1e-2  # the images count


def test_qwen3_vl_by_mobius_answers_as_transformers_without_deepstack(build, inputs):
    """mobius-onnx 0.1 writes Qwen3-VL in Qwen2.5-VL's form (interleaved mRoPE sections) and leaves
    DeepStack out (the vision tower's earlier blocks' features, which transformers adds to the first
    decoder layers at image positions). ortmodule's logits on its package equal transformers'
    Qwen3-VL with DeepStack switched off, images in every row or none, padding left or right; with
    DeepStack on, they equal transformers' before the first image only (docs/usage.md says so)."""
    fixture = build("qwen3_vl")
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    config = transformers.AutoConfig.from_pretrained(fixture.hf_dir)
    with_deepstack = transformers.Qwen3VLForConditionalGeneration.from_pretrained(fixture.hf_dir).eval()
    config.vision_config.deepstack_visual_indexes = []
    without = transformers.Qwen3VLForConditionalGeneration.from_pretrained(fixture.hf_dir, config=config).eval()
    rows = [r[m.bool()].tolist() for r, m in zip(inputs["input_ids"], inputs["attention_mask"])]
    for left in (True, False):
        ids, mask = padded_rows(rows, left)
        given = dict(inputs, input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == IMAGE).long())
        real = mask.bool()
        logits = model(**given).logits
        assert torch.allclose(logits[real], reference(without, **given).logits[real], atol=1e-4, rtol=1e-4)
        before = real & ((ids == START).long().cumsum(1) == 0)  # each row's text before its first image
        differ = (logits - reference(with_deepstack, **given).logits).abs().amax(-1)
        assert differ[before].max() < 1e-4 and differ[real & ~before].max() > 1e-2


def test_steps_over_an_image_prompt_continue_at_its_mrope_positions(pair, inputs):
    """A cached image prompt, then tokens one and two at a time: each step's logits equal the last
    columns of transformers' forward over the whole sequence (the image's rope deltas kept)."""
    model, hf = pair
    out = model(**inputs, use_cache=True, logits_to_keep=1)
    assert out.past_key_values.position_offset is not None
    ids, mask, cache = inputs["input_ids"], inputs["attention_mask"], out.past_key_values
    for new in ([[31], [32], [33]], [[41, 42], [43, 44], [45, 46]]):
        tokens = torch.tensor(new)
        ids, mask = torch.cat([ids, tokens], 1), torch.cat([mask, torch.ones_like(tokens)], 1)
        step = model(tokens, attention_mask=mask, past_key_values=cache, use_cache=True)
        cache = step.past_key_values
        whole = reference(hf, input_ids=ids, attention_mask=mask, pixel_values=inputs["pixel_values"],
                          image_grid_thw=inputs["image_grid_thw"], mm_token_type_ids=(ids == IMAGE).long())
        assert torch.allclose(step.logits, whole.logits[:, -tokens.shape[1]:], atol=1e-4, rtol=1e-4)


def test_loss_with_images(pair, inputs):
    model, hf = pair
    mask = inputs["attention_mask"]
    # Left out: padding, and a row's first token (predicted from padding, which ortmodule's loss drops).
    after_padding = torch.cat([torch.ones_like(mask[:, :1]), mask[:, :-1]], 1) == 0
    labels = inputs["input_ids"].masked_fill((mask == 0) | after_padding, -100)
    ours, theirs = model(**inputs, labels=labels), reference(hf, **inputs, labels=labels)
    assert torch.allclose(ours.loss, theirs.loss, atol=1e-5, rtol=1e-5)


def test_generate_with_images_equals_transformers(pair, inputs, monkeypatch):
    """Greedy and sampled generate run ortmodule's device loop from the image prompt (the same tokens
    as transformers' own loop, the same seed the same samples); beams run transformers' loop."""
    from ortmodule import images

    model, hf = pair
    prefills = []
    original = images.prefill
    monkeypatch.setattr(images, "prefill", lambda *a: prefills.append(1) or original(*a))
    options = dict(max_new_tokens=10, pad_token_id=2)
    check_generate_modes(model, hf, inputs, options)
    assert len(prefills) == 2  # the device loop took both
    # Beams repeat each row with its own images (the processor's tensors are not one row each).
    beams = dict(options, do_sample=False, num_beams=3, num_return_sequences=2)
    assert torch.equal(model.generate(**inputs, **beams), hf.generate(**inputs, **beams))
    # generator= (the device loop's own): the same seed, the same sample.
    drawn = [model.generate(**inputs, **options, do_sample=True, generator=torch.Generator().manual_seed(3))
             for _ in range(2)]
    assert torch.equal(drawn[0], drawn[1])


def test_images_are_opened_on_the_first_call_and_kept(build, inputs):
    model = OrtModelForCausalLM.from_pretrained(build("qwen2_5_vl").package_dir)
    from ortmodule import images

    assert model.decoder not in images._made
    model(**inputs)
    first = images.for_decoder(model.decoder)
    model(**inputs)
    assert images.for_decoder(model.decoder) is first


def test_what_images_cannot_be_is_refused(pair, inputs, build):
    model, _ = pair
    given = dict(inputs)
    one_short = given["input_ids"].clone()
    one_short[0, (one_short[0] == IMAGE).nonzero()[0]] = 20  # a run one token shorter than its image
    with pytest.raises(ValueError, match="image tokens and images do not match"):
        model(**dict(given, input_ids=one_short, mm_token_type_ids=None))
    with pytest.raises(ValueError, match=r"pixel_values has 104 patches, image_grid_thw .* makes 108"):
        model(**dict(given, pixel_values=given["pixel_values"][:-4]))
    with pytest.raises(ValueError, match="need image_grid_thw"):
        model(**dict(given, image_grid_thw=None))
    with pytest.raises(ValueError, match="rows hold 95 values; the vision model takes 96"):
        model(**dict(given, pixel_values=given["pixel_values"][:, :95]))
    with pytest.raises(ValueError, match="without pixel_values"):
        model(**dict(given, pixel_values=None))
    with pytest.raises(ValueError, match=r"pixel_values must be a float tensor .*, got torch.uint8 \(108, 96\)"):
        model(**dict(given, pixel_values=given["pixel_values"].to(torch.uint8)))  # the shape was named, not the dtype
    with pytest.raises(ValueError, match=r"image_grid_thw must be an integer tensor \[images, 3\], got torch.float32 "
                                         r"\(3, 3\)"):
        model(**dict(given, image_grid_thw=given["image_grid_thw"].float()))  # its right shape alone was named
    with pytest.raises(ValueError, match="mark other tokens than input_ids' media token ids"):
        model(**dict(given, mm_token_type_ids=torch.zeros_like(given["input_ids"])))
    # Videos need the checkpoint's config.json in the package (tests/test_videos.py).
    with pytest.raises(NotSupportedError, match="videos need the checkpoint's config.json in the package folder"):
        model(**dict(given, mm_token_type_ids=given["mm_token_type_ids"] * 2))
    with pytest.raises(ValueError, match="not inputs_embeds"):
        embeds = torch.zeros(*given["input_ids"].shape, 64)
        model(inputs_embeds=embeds, **{k: v for k, v in given.items() if k != "input_ids"})
    cache = model(**given, use_cache=True).past_key_values
    with pytest.raises(NotSupportedError, match="images or videos in a step over a cache"):
        model(torch.tensor([[5], [5], [5]]), past_key_values=cache, pixel_values=given["pixel_values"],
              image_grid_thw=given["image_grid_thw"])
    pixels, grids = processed((28, 20))
    text_model = OrtModelForCausalLM.from_pretrained(build("llama").package_dir)
    with pytest.raises(NotSupportedError, match="no vision model"):
        text_model(torch.tensor([prompt(grids.tolist())]), pixel_values=pixels, image_grid_thw=grids)
    with pytest.raises(ValueError, match="image_position_ids was given; this package's vision model \\(Qwen-VL's"):
        model(**dict(given, image_position_ids=torch.zeros(3, 4, 2, dtype=torch.int64)))


def test_pixels_that_require_grad_run_detached_under_no_grad_and_are_refused_with_gradients_on(pair, inputs):
    """Pixels made by a differentiable step (or an image being optimized): ONNX Runtime takes no tensor
    that requires grad (DLPack's BufferError inside the run). With gradients on that is a
    NotSupportedError naming why; under no_grad, and in generate, their values run."""
    model, _ = pair
    given = dict(inputs, pixel_values=inputs["pixel_values"].clone().requires_grad_())
    with pytest.raises(NotSupportedError, match="pixel_values require grad .* torch.no_grad"):
        model(**given)
    expected = model(**inputs).logits
    with torch.no_grad():
        assert torch.equal(model(**given).logits, expected)
    assert torch.equal(model.generate(**given, max_new_tokens=3, do_sample=False),
                       model.generate(**inputs, max_new_tokens=3, do_sample=False))


def test_image_placeholders_in_text_embed_as_the_graphs_zero_row(pair):
    """Text holding several image placeholder ids in a row (no images): each embeds as the zero row
    the embedding graph pads its features with (two used to index past the empty features inside
    ONNX Runtime). The same logits as embeddings with those rows zeroed."""
    model, _ = pair
    ids = torch.tensor([[12, IMAGE, IMAGE, IMAGE, 40, 41], [IMAGE, 7, 8, IMAGE, IMAGE, 9]])
    embeds = model.get_input_embeddings()(ids).masked_fill((ids == IMAGE)[..., None], 0.0)
    expected = model(inputs_embeds=embeds).logits
    assert torch.allclose(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert tokens.shape == (2, 10)


def test_threads_with_images_get_their_own_answers(build):
    """Four threads, each a prompt with its own image, on one model whose vision model none has
    opened yet: every answer equals the same prompt run alone."""
    from concurrent.futures import ThreadPoolExecutor

    model = OrtModelForCausalLM.from_pretrained(build("qwen2_5_vl").package_dir)
    sizes = [(28, 20), (16, 40), (24, 24), (20, 28)]
    calls = []
    for seed, size in enumerate(sizes):
        pixels, grids = processed(size, seed=seed)
        calls.append(dict(input_ids=torch.tensor([prompt(grids.tolist(), 4 + seed, seed)]), pixel_values=pixels,
                          image_grid_thw=grids))
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda call: model.generate(**call, max_new_tokens=6, do_sample=False), calls * 3))
    alone = [model.generate(**call, max_new_tokens=6, do_sample=False) for call in calls]
    for i, tokens in enumerate(together):
        assert torch.equal(tokens, alone[i % len(calls)])


class ImageTextProcessor:
    """transformers' Qwen2.5-VL processor for images (whose video half needs torchvision, which this
    environment lacks): the Qwen2-VL image processor's output, and each `<|image_pad|>` in the text
    expanded to its image's t x h x w / merge^2 image tokens, as Qwen2_5_VLProcessor expands them."""

    image_token = "<|image_pad|>"

    def __init__(self, hf_dir):
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
        fill = [f"<|media{i}|>" for i in range(len(self.tokenizer), IMAGE)]  # the image token gets id IMAGE
        self.tokenizer.add_special_tokens({"additional_special_tokens": [*fill, self.image_token]})
        assert self.tokenizer.convert_tokens_to_ids(self.image_token) == IMAGE
        self.image_processor = transformers.Qwen2VLImageProcessorPil(**PROCESSOR)

    def __call__(self, images=None, text=None, return_tensors=None, padding=False, truncation=False, **kwargs):
        texts = [text] if isinstance(text, str) else list(text)
        flat = [image for group in images or [] for image in (group if isinstance(group, list) else [group])]
        out = {}
        if flat:
            encoded = self.image_processor(images=flat, return_tensors="pt")
            sizes = iter(encoded["image_grid_thw"].prod(1).tolist())
            texts = [re.sub(re.escape(self.image_token), lambda _: self.image_token * (next(sizes) // 4), t)
                     for t in texts]
            out.update(pixel_values=encoded["pixel_values"], image_grid_thw=encoded["image_grid_thw"])
        tokens = self.tokenizer(texts, padding=padding, truncation=truncation, return_tensors=return_tensors)
        out.update(tokens)
        if return_tensors == "pt":
            out["mm_token_type_ids"] = (tokens["input_ids"] == IMAGE).long()
        return transformers.BatchFeature(out)


def test_lm_eval_multimodal_backend_answers_as_hf_multimodal(build, tmp_path):
    """`--model ortmodule-multimodal` on an image task (MMMU's form: doc_to_image, generate_until),
    batched and left-padded, against lm-eval's own `hf-multimodal` on the transformers model with
    the same processor: every response equal."""
    fixture = build("qwen2_5_vl")
    _, hf = load_pair(fixture)
    check_image_task(tmp_path, "ortmodule_images_test", (12, 20, 4, "abcdefg"),
                     ImageTextProcessor(fixture.hf_dir), hf, fixture.package_dir)


def test_lm_eval_multimodal_batches_image_prompts_by_their_work(build, tmp_path, monkeypatch):
    """ortmodule-multimodal's image generation runs as many prompts a batch as their tokens (each
    image's expanded) and new tokens fit, not `batch_size` rows: at lm-eval's default of 1 and under
    `auto` (which hf-multimodal refuses) several a batch, within `token_budget` and `max_batch_size`;
    every response that of hf-multimodal one request at a time."""
    from lm_eval.api.instance import Instance

    from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM

    fixture = build("qwen2_5_vl")
    _, hf = load_pair(fixture)
    processor = ImageTextProcessor(fixture.hf_dir)
    batches = []  # the rows of each of ortmodule's generations
    own = OrtModuleMultimodalLM._model_multimodal_generate

    def counted(self, inputs, *args, **kwargs):
        batches.append(len(inputs["input_ids"]))
        return own(self, inputs, *args, **kwargs)

    monkeypatch.setattr(OrtModuleMultimodalLM, "_model_multimodal_generate", counted)
    lm = OrtModuleMultimodalLM(fixture.package_dir, processor=processor, device="cpu")
    words = "abcdefghi"
    for seed, size in enumerate([(12, 20), (40, 8), (64, 64), (8, 8)]):  # the count is the encoding's width
        image = Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8"))
        for context in ("<image> Say a:", "<image> and <image> then more words"):
            assert lm._prompt_tokens(context, {"visual": [image, image]}) == \
                lm.tok_batch_multimodal_encode([context], [[image, image]])["input_ids"].shape[1]
    many = [Instance("generate_until", None, ("<image> " + " ".join(words[: 1 + i % 9]), {}, {"visual": [picture]}), i)
            for i, picture in enumerate(Image.new("RGB", (8 + 4 * (i % 7), 8 + 4 * (i % 5))) for i in range(40))]
    assert lm._prompt_widths(many) == [lm._prompt_tokens(req.args[0], req.args[2]) for req in many]  # on threads
    words, reference = "abcdefg", None  # hf-multimodal's responses, one request at a time: run once
    # the prompts' tokens, images' included (each image 4 to 12 tokens here), and 6 new tokens a row
    for batch_size, options, expected in ((1, {}, [7]), ("auto", {}, [7]), ("auto:2", {"max_batch_size": 3}, [3, 3, 1]),
                                          (1, {"token_budget": 50}, None), (4, {"token_budget": 50}, [4, 3])):
        batches.clear()
        responses = image_task_responses(tmp_path, "ortmodule_images_batches", (12, 20, 4, words),
                                         processor, hf, fixture.package_dir, hf_batch_size=1,
                                         batch_size=batch_size, hf_responses=reference, **options)
        reference = responses["hf"]
        assert responses["ortmodule"] == responses["hf"] and any(responses["hf"])
        assert sum(batches) == len(words)
        if expected is not None:
            assert batches == expected, (batch_size, options)
        else:  # rows of some 30 tokens: one or two a batch, never all
            assert 1 < len(batches) < len(words) and max(batches) >= 2, batches


def test_lm_eval_multimodal_encodes_image_batches_ahead(build, monkeypatch):
    """ortmodule-multimodal's image batches are encoded on a worker thread, each worker with its own
    copy of the processor, while the batch before them generates (the next batch's encoding has begun
    before the first batch's generation ends), without hf-multimodal's `gc.collect()` after each batch;
    every response that of hf-multimodal one request at a time; an encoding that fails raises from
    `generate_until`, and the workers end."""
    import gc

    from lm_eval.api.instance import Instance

    from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM

    fixture = build("qwen2_5_vl")
    _, hf = load_pair(fixture)

    class Recording(ImageTextProcessor):
        calls = []  # (thread, processor, prompts) of every call, the copies' included (a class attribute)

        def __call__(self, images=None, text=None, **kwargs):
            Recording.calls.append((threading.current_thread(), self, tuple(text)))
            if any("broken" in line for line in text) and self is not processor:  # a batch's encoding only
                raise ValueError("a broken prompt")
            return super().__call__(images=images, text=text, **kwargs)

    processor = Recording(fixture.hf_dir)
    pictures = [Image.fromarray((np.random.RandomState(i).rand(12 + 4 * i, 20, 3) * 255).astype("uint8"))
                for i in range(6)]
    requests = [Instance("generate_until", None, (f"<image> {'abcdef'[: i + 1]}", {"until": ["\n"], "max_gen_toks": 5},
                                                  {"visual": [picture]}), i) for i, picture in enumerate(pictures)]
    expected = hf_multimodal(hf, ImageTextProcessor(fixture.hf_dir), batch_size=1).generate_until(requests, True)
    lm = OrtModuleMultimodalLM(fixture.package_dir, processor=processor, device="cpu", batch_size=1, max_batch_size=2)
    ahead = lambda: [call for call in Recording.calls if call[1] is not processor]  # noqa: E731  the batches' encodings
    seen, own = [], OrtModuleMultimodalLM._model_multimodal_generate

    def generate(self, inputs, *args, **kwargs):
        if not seen:  # the first batch waits (at most 60 s) for the second's encoding to begin
            deadline = time.monotonic() + 60
            while len(ahead()) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        seen.append((len(inputs["input_ids"]), len(ahead())))
        return own(self, inputs, *args, **kwargs)

    collected = []
    monkeypatch.setattr(OrtModuleMultimodalLM, "_model_multimodal_generate", generate)
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(args) or 0)
    assert lm.generate_until(requests, disable_tqdm=True) == expected and any(expected)
    assert [rows for rows, _ in seen] == [2, 2, 2]
    assert [encoded for _, encoded in seen][0] >= 2, "the second batch was not encoded while the first generated"
    assert [len(prompts) for _, _, prompts in ahead()] == [2, 2, 2] and not collected
    assert all(thread is not threading.main_thread() and copy is not processor for thread, copy, _ in ahead())
    assert processor.tokenizer.padding_side == "right"  # the backend's own tokenizer, untouched
    Recording.calls.clear()
    broken = requests[:4] + [Instance("generate_until", None, ("<image> broken", *requests[0].args[1:]), 4)]
    with pytest.raises(ValueError, match="a broken prompt"):
        lm.generate_until(broken, disable_tqdm=True)
    assert any("broken" in line for _, _, prompts in ahead() for line in prompts)  # raised on a worker
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("ortmodule-images")]


def test_lm_eval_multimodal_encodes_image_batches_in_turn_with_a_processor_it_cannot_copy(build, caplog):
    """A processor object that cannot be copied for worker threads: a warning that says so, and each
    image batch encoded when it comes with the backend's processor, its tokenizer's padding side set
    for the call and restored; every response that of hf-multimodal one request at a time."""
    from lm_eval.api.instance import Instance

    from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM

    fixture = build("qwen2_5_vl")
    _, hf = load_pair(fixture)

    class Uncopyable(ImageTextProcessor):
        threads = []

        def __deepcopy__(self, memo):
            raise TypeError("cannot copy this processor")

        def __call__(self, *args, **kwargs):
            Uncopyable.threads.append(threading.current_thread())
            return super().__call__(*args, **kwargs)

    processor = Uncopyable(fixture.hf_dir)
    pictures = [Image.new("RGB", (12 + 4 * i, 20)) for i in range(4)]
    requests = [Instance("generate_until", None, (f"<image> {'abcd'[: i + 1]}", {"until": ["\n"], "max_gen_toks": 5},
                                                  {"visual": [picture]}), i) for i, picture in enumerate(pictures)]
    expected = hf_multimodal(hf, ImageTextProcessor(fixture.hf_dir), batch_size=1).generate_until(requests, True)
    lm = OrtModuleMultimodalLM(fixture.package_dir, processor=processor, device="cpu", max_batch_size=2)
    Uncopyable.threads.clear()
    with caplog.at_level("WARNING", logger="ortmodule"):
        assert lm.generate_until(requests, disable_tqdm=True) == expected and any(expected)
    assert "cannot be copied for worker threads (TypeError: cannot copy this processor)" in caplog.text
    assert Uncopyable.threads[-2:] == [threading.main_thread()] * 2  # the two batches, after the count pass
    assert processor.tokenizer.padding_side == "right"


def test_lm_eval_multimodal_stops_each_image_row_on_its_own(build, tmp_path, monkeypatch):
    """Image prompts of one batch whose answers end at different steps: ortmodule-multimodal stops
    each row at its own stop sequence (lm_eval.StopSequences, where lm-eval's criteria run the batch
    until every row has one), so on a CPU the decode steps run fewer rows once some have stopped;
    every response that of hf-multimodal one request at a time."""
    from ortmodule.decoder import Decoder
    from ortmodule.steps import FixedSteps

    fixture = build("qwen2_5_vl")
    _, hf = load_pair(fixture)
    processor, sizes = ImageTextProcessor(fixture.hf_dir), (12, 20, 4, "abcdefg")
    free = image_task_responses(tmp_path, "ortmodule_images_free", sizes, processor, hf, fixture.package_dir,
                                hf_batch_size=1, generation={"until": [], "max_gen_toks": 24})["hf"]
    # a character that some answers write early and others never: those rows stop well before the rest
    early = [c for c in sorted(set("".join(free)))
             if sum(0 <= text.find(c) < 8 for text in free) >= 2 and any(c not in text for text in free)]
    assert early, free
    rows = []
    step, fixed = Decoder.step, FixedSteps.step
    monkeypatch.setattr(Decoder, "step", lambda self, tokens, *args, **kwargs: (
        rows.append(tokens.shape[0]), step(self, tokens, *args, **kwargs))[1])
    monkeypatch.setattr(FixedSteps, "step", lambda self, tokens: (rows.append(tokens.shape[0]), fixed(self, tokens))[1])
    responses = image_task_responses(tmp_path, "ortmodule_images_stops", sizes, processor, hf, fixture.package_dir,
                                     hf_batch_size=1, batch_size=1,
                                     generation={"until": [early[0]], "max_gen_toks": 24})
    assert responses["ortmodule"] == responses["hf"]
    assert [text.split(early[0])[0] for text in free] == responses["hf"]
    assert max(rows) == len(sizes[3]) and min(rows) < max(rows), rows


def test_lm_eval_multimodal_runs_text_requests_as_the_text_backend(build, monkeypatch):
    """Requests without images (a text task beside the image tasks) go through `--model ortmodule`'s
    backend over the same model (its scoring of only the continuations' positions, its generation
    batches), with hf-multimodal's answers: loglikelihood within 1e-4 and the same greedy flags,
    rolling documents, generations the same text; `auto` included, which hf-multimodal refuses."""
    from lm_eval.api.instance import Instance

    from ortmodule.lm_eval import OrtModuleLM
    from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM

    fixture = build("qwen2_5_vl")
    _, hf = load_pair(fixture)
    processor = ImageTextProcessor(fixture.hf_dir)

    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "small", "birds",
             "sing"]
    contexts = [" ".join(words[i : i + 3 + i % 5]) for i in range(8)]
    pairs = [Instance("loglikelihood", None, (context, " " + words[-1 - i]), i) for i, context in enumerate(contexts)]
    documents = [Instance("loglikelihood_rolling", None, (" ".join(words * (2 + i)),), i) for i in range(2)]
    prompts = [Instance("generate_until", None, (context, {"until": ["\n"], "max_gen_toks": 5}), i)
               for i, context in enumerate(contexts)]
    reference = hf_multimodal(hf, processor, batch_size=1)
    expected = (reference.loglikelihood(pairs), reference.loglikelihood_rolling(documents),
                reference.generate_until(prompts))
    scored = []
    own = OrtModuleLM._totals_on_device
    monkeypatch.setattr(OrtModuleLM, "_totals_on_device", lambda self, requests, *args, **kwargs: (
        scored.append(len(requests)), own(self, requests, *args, **kwargs))[1])
    for batch_size in (1, "auto"):
        scored.clear()
        lm = OrtModuleMultimodalLM(fixture.package_dir, processor=processor, batch_size=batch_size, device="cpu")
        answers = lm.loglikelihood(pairs)
        assert [flag for _, flag in answers] == [flag for _, flag in expected[0]]
        assert max(abs(a - b) for (a, _), (b, _) in zip(answers, expected[0])) < 1e-4
        assert max(abs(a - b) for a, b in zip(lm.loglikelihood_rolling(documents), expected[1])) < 1e-3
        assert lm.generate_until(prompts) == expected[2] and any(expected[2])
        assert scored[0] == len(pairs), scored  # ortmodule's scoring of the tokenized requests ran them


def test_lm_eval_multimodal_refuses_what_hf_multimodal_cannot_score_by_name(build):
    """Scoring with images, which hf-multimodal does not do: a loglikelihood request gets lm-eval's refusal,
    a rolling document with an image (lm-eval appends the image as its second argument, where hf-multimodal
    looks for a third and its text path then failed on the image's dict) a NotImplementedError saying so;
    `tokenizer=` is refused for `processor=`. Built over a loaded model object, it generates as over the
    package's folder."""
    from lm_eval.api.instance import Instance
    from PIL import Image

    from ortmodule import OrtModelForCausalLM
    from ortmodule.lm_eval import ModelArgsError
    from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM

    fixture = build("qwen2_5_vl")
    processor = ImageTextProcessor(fixture.hf_dir)
    with pytest.raises(ModelArgsError, match="takes the checkpoint's processor as processor=, not tokenizer="):
        OrtModuleMultimodalLM(fixture.package_dir, processor=processor, tokenizer="x")
    lm = OrtModuleMultimodalLM(fixture.package_dir, processor=processor, device="cpu")
    image = {"visual": [Image.new("RGB", (32, 32), (200, 10, 10))]}
    with pytest.raises(NotImplementedError, match="'loglikelihood' requests for model type `hf-multimodal`"):
        lm.loglikelihood([Instance("loglikelihood", None, ("<image> a", " b", image), 0)])
    with pytest.raises(NotImplementedError, match="does not score rolling documents with images"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", None, ("a b c", image), 0)])
    prompts = [Instance("generate_until", None, ("hello there", {"until": ["\n"], "max_gen_toks": 4}), 0)]
    over_object = OrtModuleMultimodalLM(OrtModelForCausalLM.from_pretrained(fixture.package_dir),
                                        processor=processor, device="cpu")
    assert over_object.generate_until(prompts) == lm.generate_until(prompts)


_TEXT_TASK = """task: {name}
custom_dataset: !function {name}_utils.docs
test_split: test
output_type: generate_until
doc_to_text: "Say {{{{word}}}}:"
doc_to_target: "{{{{word}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
metadata:
  version: 0
"""


def test_lm_eval_multimodal_runs_an_image_task_and_a_text_task_in_one_run(build, tmp_path):
    """lm-eval hands the backend every task's generation requests in one call: an image task and a
    text task together (which hf-multimodal cannot run: it takes the first request's kind for all)
    give each task's responses as hf-multimodal gives them run alone."""
    import lm_eval

    from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM
    from ortmodule.tasks import task_manager

    fixture = build("qwen2_5_vl")
    _, hf = load_pair(fixture)
    processor = ImageTextProcessor(fixture.hf_dir)
    expected = image_task_responses(tmp_path, "ortmodule_images_mixed", (12, 20, 4, "abcde"), processor, hf,
                                    fixture.package_dir)["hf"]
    (tmp_path / "ortmodule_text_mixed.yaml").write_text(_TEXT_TASK.format(name="ortmodule_text_mixed"))
    (tmp_path / "ortmodule_text_mixed_utils.py").write_text(
        'import datasets\n\n\ndef docs(**kwargs):\n'
        '    return {"test": datasets.Dataset.from_list([dict(word=w) for w in "vwxyz"])}\n')

    def responses(lm, names):
        result = lm_eval.simple_evaluate(model=lm, tasks=names, log_samples=True,
                                         task_manager=task_manager(names, tmp_path))
        return {name: [sample["resps"][0][0] for sample in sorted(result["samples"][name],
                                                                   key=lambda sample: sample["doc_id"])]
                for name in names}

    expected_text = responses(hf_multimodal(hf, processor, batch_size=2), ["ortmodule_text_mixed"])
    given = responses(OrtModuleMultimodalLM(fixture.package_dir, processor=processor, batch_size=2, device="cpu"),
                      ["ortmodule_images_mixed", "ortmodule_text_mixed"])
    assert given == {"ortmodule_images_mixed": expected, **expected_text}
    assert any(expected) and any(expected_text["ortmodule_text_mixed"])


@pytest.mark.parametrize("seed", range(int(os.environ.get("IMAGE_FUZZ_SEEDS", 4))))
def test_lm_eval_multimodal_generation_fuzz(build, seed):
    """Random mixes of image prompts (one or two images of random sizes) and text prompts, random
    stop sequences and lengths in a few generation settings, random batch sizes, token budgets and
    `max_batch_size`, through ortmodule-multimodal's `generate_until` in one call: every answer
    hf-multimodal's one request at a time (each kind in a call of its own, as it needs).
    `IMAGE_FUZZ_SEEDS=200` runs 200 cases."""
    from lm_eval.api.instance import Instance

    from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM

    rng = random.Random(7000 + seed)
    fixture = build("qwen2_5_vl")
    _, hf = load_pair(fixture)
    processor = ImageTextProcessor(fixture.hf_dir)

    # The media placeholders are never generated here: fed back without media, ortmodule embeds them as the
    # graph's zero feature row where transformers takes the table's (docs/usage.md), which this does not test.
    settings = [{"until": rng.sample(["\n", "a", "e", " ", "s", "t"], rng.randint(1, 2)),
                 "max_gen_toks": rng.randint(1, 12), "do_sample": False, "suppress_tokens": [IMAGE, START, END, 510]}
                for _ in range(rng.randint(1, 3))]
    requests = []
    for i in range(rng.randint(2, 10)):
        words = " ".join(rng.choice(["red", "cat", "a", "sees", "the", "blue"]) for _ in range(rng.randint(1, 8)))
        setting = dict(rng.choice(settings))
        if rng.random() < 0.7:
            count = rng.randint(1, 2)
            images = [Image.fromarray((np.random.RandomState(rng.randint(0, 99)).rand(
                rng.randint(8, 64), rng.randint(8, 64), 3) * 255).astype("uint8")) for _ in range(count)]
            requests.append(Instance("generate_until", None, (("<image> " * count) + words, setting,
                                                              {"visual": images}), i))
        else:
            requests.append(Instance("generate_until", None, (words, setting), i))
    options = {"batch_size": rng.choice([1, 2, 5, "auto"])}
    options.update({name: value for name, value in (("token_budget", rng.choice([None, 30, 80, 400])),
                                                    ("max_batch_size", rng.choice([None, 2, 3]))) if value})
    given = OrtModuleMultimodalLM(fixture.package_dir, processor=processor, device="cpu", **options
                                  ).generate_until(requests)
    reference = hf_multimodal(hf, processor, batch_size=1)
    expected = {}
    for images in (False, True):
        part = [req for req in requests if (len(req.args) == 3) is images]
        expected.update(zip((req.idx for req in part), reference.generate_until(part) if part else []))
    assert given == [expected[req.idx] for req in requests], f"seed {7000 + seed}: {options}, settings {settings}"


def test_lm_eval_multimodal_backend_needs_a_processor_and_an_image_package(build):
    from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM

    with pytest.raises(ValueError, match="needs processor="):
        OrtModuleMultimodalLM(str(build("qwen2_5_vl").package_dir))
    with pytest.raises(ValueError, match="names no model.image_token_id"):
        OrtModuleMultimodalLM(str(build("llama").package_dir), processor=ImageTextProcessor(build("qwen2_5_vl").hf_dir))
    with pytest.raises(TypeError, match="model_args for the OrtModuleMultimodalLM backend: max_pixel .*processor"):
        OrtModuleMultimodalLM(str(build("qwen2_5_vl").package_dir),
                              processor=ImageTextProcessor(build("qwen2_5_vl").hf_dir), max_pixel=1000)
    context = build("qwen2_5_vl").spec.context_length
    with pytest.raises(ValueError, match=f"max_length={context + 1} is over the package's context length {context}"):
        OrtModuleMultimodalLM(str(build("qwen2_5_vl").package_dir),
                              processor=ImageTextProcessor(build("qwen2_5_vl").hf_dir), max_length=context + 1)
    from ortmodule.lm_eval import ModelArgsError

    with pytest.raises(ModelArgsError, match="provider_options must be a dict"):  # one line from ortmodule-eval
        OrtModuleMultimodalLM(str(build("qwen2_5_vl").package_dir),
                              processor=ImageTextProcessor(build("qwen2_5_vl").hf_dir), provider_options="xyz")


# A chat template of Qwen2.5-VL's form: an image part is a vision start, one image pad, a vision end.
VL_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def vl_tokenizer(package_dir):
    """The fixture's tokenizer with Qwen2.5-VL's vision tokens at the fixture's reserved ids."""
    return tokenizer_with(package_dir, {END: "<|vision_end|>", START: "<|vision_start|>", 510: "<|video_pad|>",
                                        IMAGE: "<|image_pad|>"}, VL_TEMPLATE)


@pytest.mark.parametrize("arch", PACKAGES)
def test_the_server_takes_images_in_chat_messages(build, arch, tmp_path):
    """`ortmodule serve --processor FOLDER` on the Qwen2.5-VL packages: chat messages with image_url
    parts (data: URLs) answer as transformers' greedy generate on what its processor makes of the
    same images and the template's ids (each image pad expanded), while a text completion runs
    beside them (the builder's decoder: in one shared decode batch, each row with its own mRoPE
    offset); what an image part cannot be is a 400 naming it."""

    from helpers import ImageChats, LiveServer, expected_text

    from ortmodule.serving import create_app

    fixture = build(arch)
    _, hf = load_pair(fixture)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    tokenizer = vl_tokenizer(fixture.package_dir)
    transformers.Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(tmp_path / "processor")
    server = LiveServer(create_app(model, tokenizer, name="vl", processor=str(tmp_path / "processor")))
    try:
        talk = ImageChats([(28, 20), (16, 40)])
        chats = talk.chats

        def chat(messages):
            return talk.chat(server, messages)

        answers = talk.send(server)
        for messages, images, answer in zip(chats, talk.pictures, answers):
            assert answer.status_code == 200, answer.text
            ids = talk.template_ids(tokenizer, messages)
            made = transformers.Qwen2VLImageProcessorPil(**PROCESSOR)(images=images, return_tensors="pt")
            counts = iter((made["image_grid_thw"].prod(1) // 4).tolist())
            ids = [t for token in ids for t in ([token] * next(counts) if token == IMAGE else [token])]
            ids = torch.tensor([ids])
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **made,
                                  mm_token_type_ids=(ids == IMAGE).long(), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
            expected = expected_text(tokenizer, out[0, ids.shape[1]:].tolist())
            choice = answer.json()["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == expected
            assert answer.json()["usage"]["prompt_tokens"] == ids.shape[1]
        assert answers[-1].status_code == 200
        assert answers[-1].json()["choices"][0]["text"] == talk.completion(server).json()["choices"][0]["text"]
        # Streamed: the deltas join to the same message.
        body = {"model": "vl", "messages": chats[1], "temperature": 0, "max_tokens": 8, "stream": True}
        text = ""
        with server.client.stream("POST", "/v1/chat/completions", json=body) as events:
            for line in events.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["delta"].get("content", "")
        assert text == answers[1].json()["choices"][0]["message"]["content"]
        # OpenAI's Responses API: the same chat as input items with input_image parts, the same answer.
        parts = [{"type": "input_image", "image_url": part["image_url"]["url"]} if part["type"] == "image_url"
                 else {"type": "input_text", "text": part["text"]} for part in chats[1][1]["content"]]
        answer = server.client.post("/v1/responses", json={
            "model": "vl", "instructions": chats[1][0]["content"], "input": [{"role": "user", "content": parts}],
            "temperature": 0, "max_output_tokens": 8})
        assert answer.status_code == 200, answer.text
        assert answer.json()["output"][0]["content"][0]["text"] == answers[1].json()["choices"][0]["message"]["content"]
        refusals = {
            "http://example.com/cat.png": "only data: URLs",
            "data:image/png,rawbytes": "must be base64",
            "data:image/png;base64,@@@": "not base64",
            "data:image/png;base64,aGVsbG8=": "not an image Pillow reads",
        }
        huge = io.BytesIO()
        Image.new("1", (7100, 7100)).save(huge, format="PNG")  # 50.4 million pixels in a few kB
        refusals["data:image/png;base64," + base64.b64encode(huge.getvalue()).decode()] = "at most 50,000,000"
        for url, reason in refusals.items():
            answer = chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
            assert answer.status_code == 400 and reason in answer.json()["error"]["message"], answer.text
        # vLLM's prompt_logprobs of a prompt with images: refused (they would be the text's alone)
        answer = server.client.post("/v1/chat/completions", json={"model": "vl", "messages": chats[0],
                                                                   "max_tokens": 2, "prompt_logprobs": 1})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt_logprobs", answer.text
        # A template that places no image: refused, not run as text.
        tokenizer.chat_template = VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
        answer = chat(chats[0])
        assert answer.status_code == 400 and "placed 0 image placeholders" in answer.json()["error"]["message"]
    finally:
        server.stop()
    with pytest.raises(ValueError, match="--processor: the package has no vision model"):
        create_app(OrtModelForCausalLM.from_pretrained(build("llama").package_dir), tokenizer,
                   processor=str(tmp_path / "processor"))
    with pytest.raises(ValueError, match="no image processor there"):
        create_app(model, tokenizer, processor=str(tmp_path))


def test_a_request_bounds_its_images_pixels_where_the_server_takes_its_options(build, tmp_path):
    """vLLM's `mm_processor_kwargs` on a server started with `--trust-request-mm-kwargs` (Qwen-VL's `min_pixels`
    and `max_pixels`, how large an image is resized and so how many tokens it becomes): the answers, tokens and
    log-probabilities, equal transformers' greedy generate on what the image processor makes with the same
    options, and their prompts are longer than without them; the server's processor settings hold for the
    next request. Its other options (`merge_size`, which the vision model is made for) and a text server are
    400s naming `mm_processor_kwargs`."""
    from helpers import ImageChats, LiveServer

    from ortmodule.serving import create_app

    fixture = build("qwen2_5_vl")
    model, hf = load_pair(fixture)
    tokenizer = vl_tokenizer(fixture.package_dir)
    transformers.Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(tmp_path / "processor")
    options = {"min_pixels": 40 * 40, "max_pixels": 48 * 48}

    def process(text, images, **given):
        made = transformers.Qwen2VLImageProcessorPil(**PROCESSOR)(images=images, return_tensors="pt", **given)
        counts = iter((made["image_grid_thw"].prod(1) // 4).tolist())
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([[t for token in ids for t in ([token] * next(counts) if token == IMAGE else [token])]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE).long(),
                **made}

    server = LiveServer(create_app(model, tokenizer, name="vl", processor=str(tmp_path / "processor"),
                                   trust_request_mm_kwargs=True))
    try:
        chats = ImageChats([(28, 20), (16, 40)])
        larger = chats.check(server, tokenizer, hf, lambda text, images: process(text, images, **options),
                             mm_processor_kwargs=options)
        plain = chats.check(server, tokenizer, hf, process)
        assert all(a["input_ids"].shape[1] > b["input_ids"].shape[1] for a, b in zip(larger, plain))
        for given, words in (({"merge_size": 1}, "mm_processor_kwargs.merge_size: this model's image processor"),
                             ({"max_pixels": "many"}, "max_pixels must be an integer from 1 to 50,000,000"),
                             ({"min_pixels": 2**63}, "min_pixels must be an integer"),  # an OverflowError in it
                             ({"max_pixels": 0}, "max_pixels must be an integer")):
            answer = chats.chat(server, chats.chats[0], mm_processor_kwargs=given)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "mm_processor_kwargs"
            assert words in answer.json()["error"]["message"], answer.text
    finally:
        server.stop()
    # vLLM's --mm-processor-kwargs: the server's own, for every request's images
    server = LiveServer(create_app(model, tokenizer, name="vl", processor=str(tmp_path / "processor"),
                                   mm_processor_kwargs=options))
    try:
        chats.check(server, tokenizer, hf, lambda text, images: process(text, images, **options))
    finally:
        server.stop()
    for given, words in (({"merge_size": 1}, "--mm-processor-kwargs: mm_processor_kwargs.merge_size"),
                         ({"max_pixels": "many"}, "--mm-processor-kwargs: mm_processor_kwargs.max_pixels must be")):
        with pytest.raises(ValueError, match=words):
            create_app(model, tokenizer, processor=str(tmp_path / "processor"), mm_processor_kwargs=given)
    with pytest.raises(ValueError, match="they need processor"):
        create_app(model, tokenizer, mm_processor_kwargs=options)
    text = LiveServer(create_app(OrtModelForCausalLM.from_pretrained(build("llama").package_dir), tokenizer,
                                 name="vl", trust_request_mm_kwargs=True))
    try:
        answer = ImageChats.chat(text, [{"role": "user", "content": "hi"}], mm_processor_kwargs=options)
        assert answer.status_code == 400 and "this server takes no images" in answer.json()["error"]["message"]
    finally:
        text.stop()

def test_a_server_on_a_package_whose_top_k_is_one_says_so(build, caplog):
    """mobius-onnx's packages say `top_k` 1 (greedy tokens by sampling from one) whatever the checkpoint
    says; `ortmodule serve` takes the package's defaults (`--generation-config auto`), so a sampled request
    that leaves `top_k` out gets the greedy text: the server warns as it starts, and `vllm` samples."""
    from helpers import LiveServer

    from ortmodule.serving import create_app

    fixture = build("qwen2_5_vl")
    model, tokenizer = OrtModelForCausalLM.from_pretrained(fixture.package_dir), vl_tokenizer(fixture.package_dir)
    body = {"model": "vl", "prompt": [31, 32, 33, 34], "max_tokens": 12}
    texts = {}
    for source in ("auto", "vllm"):
        with caplog.at_level("WARNING", logger="ortmodule.serving"):
            caplog.clear()
            live = LiveServer(create_app(model, tokenizer, name="vl", generation_config=source))
        try:
            warned = [r.getMessage() for r in caplog.records if "default top_k is 1" in r.getMessage()]
            assert bool(warned) == (source == "auto")
            greedy = live.client.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
            texts[source] = [live.client.post("/v1/completions", json={**body, "temperature": 1.5, "seed": seed}).json()
                             ["choices"][0]["text"] for seed in range(4)]
        finally:
            live.stop()
    assert texts["auto"] == [greedy] * 4  # the package's top_k 1
    assert any(text != greedy for text in texts["vllm"])


@pytest.mark.parametrize("package, processor, message", [
    ("llama", "saved", "error: --processor: the package has no vision model"),
    ("qwen2_5_vl", "empty", "error: --processor {folder}: no image processor there"),
])
def test_serve_with_a_bad_processor_stops_naming_why_before_the_model_loads(build, tmp_path, capsys, monkeypatch,
                                                                             package, processor, message):
    """`--processor` on a package without images, or naming a folder without an image processor, stops
    `ortmodule serve` before the package loads (and its runs are timed: minutes for a big model)."""
    from ortmodule import cli

    folder = tmp_path / processor
    folder.mkdir()
    if processor == "saved":
        transformers.Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(folder)

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before --processor was checked")

    monkeypatch.setattr(OrtModelForCausalLM, "from_pretrained", loaded)
    with pytest.raises(SystemExit) as stopped:
        cli.ortmodule(["serve", str(build(package).package_dir), "--processor", str(folder), "--port", "0"])
    assert stopped.value.code == 2
    assert message.format(folder=folder) in capsys.readouterr().err

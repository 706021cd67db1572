"""Prompts with images, ortmodule beside transformers on the same weights and the same processor
tensors: `score` (one forward over a batch of image prompts, the last `keep` positions' logits, as a
multiple-choice scorer asks: the vision model, the embedding model and the decoder) and `generate`
(greedy, `new_tokens` a row, no early end). CPU size: Qwen2-VL-2B's config (its 675 M-weight vision
tower, the one every Qwen2-VL size has, and its 1.5 B text model) with random weights and SmolLM2's
tokenizer, the fp32 package mobius-onnx exports (vision, embedding and decoder models); the images
are random pixels through transformers' Qwen2-VL image processor at its defaults. Smoke: the tiny
Qwen2-VL fixture."""

import numpy as np
import pytest
import torch
import transformers
from conftest import device_name, model_label, record_rate
from PIL import Image
from safetensors import safe_open

from ortmodule import OrtModelForCausalLM
from ortmodule_dev import fixtures


@pytest.fixture(scope="module")
def setup(size):
    options = size.get("images")
    if options is None:
        pytest.skip("no image workload at this size")
    fixture = fixtures.build(options["spec"])
    device = size["device"]
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=device)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(fixture.hf_dir, dtype=torch.float32).to(device).eval()
    return fixture, model, hf, prompts(fixture, hf.config, options, device), options


def prompts(fixture, config, options: dict, device: str) -> dict:
    """A batch of prompts, each some text, one image (random pixels, `image_side` square, through the
    Qwen2-VL image processor, its patch size from the model's config) and more text, as the
    processor's tensors and the chat template's ids make them."""
    vision = config.vision_config
    processor = transformers.Qwen2VLImageProcessorPil(patch_size=vision.patch_size,
                                                      merge_size=vision.spatial_merge_size,
                                                      temporal_patch_size=vision.temporal_patch_size)
    side, batch = options["image_side"], options["batch"]
    states = [np.random.RandomState(seed) for seed in range(batch)]
    images = [Image.fromarray((state.rand(side, side, 3) * 255).astype("uint8")) for state in states]
    made = processor(images=images, return_tensors="pt")
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(4, min(fixture.spec.vocab_size - 8, 32000), (batch, options["text_tokens"]),
                         generator=generator)
    media = made["image_grid_thw"].prod(1) // vision.spatial_merge_size**2
    rows = [[*t[:8].tolist(), config.vision_start_token_id, *[config.image_token_id] * int(n),
             config.vision_end_token_id, *t[8:].tolist()] for t, n in zip(text, media)]
    ids = torch.tensor(rows)
    return dict(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                mm_token_type_ids=(ids == config.image_token_id).long().to(device),
                pixel_values=made["pixel_values"].to(device), image_grid_thw=made["image_grid_thw"].to(device))


def weight_counts(fixture) -> tuple[int, int, int]:
    """(vision tower weights, text body weights, LM head weights) from the checkpoint."""
    vision = body = 0
    for shard in fixture.hf_dir.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for key in f.keys():  # noqa: SIM118  a safetensors file, not a dict
                count = int(np.prod(f.get_slice(key).get_shape()))
                if "visual" in key:
                    vision += count
                elif "embed_tokens" not in key and "lm_head" not in key:
                    body += count
    return vision, body, fixture.spec.hidden_size * fixture.spec.vocab_size


def describe(benchmark, setup, case: str, rows_through_head: int, steps: int = 0) -> None:
    fixture, _, _, given, options = setup
    batch, length = given["input_ids"].shape
    vision, body, head = weight_counts(fixture)
    patches = int(given["image_grid_thw"].prod(1).sum())
    info = benchmark.extra_info
    info["model"] = model_label(options["key"])
    info["case"] = case
    side = options["image_side"]
    info["shape"] = f"{batch} x ({side}x{side} image: {patches // batch} patches; {length} tokens)"
    info["device"] = device_name(given["input_ids"].device.type)
    # Matmul FLOPs: the vision tower over every patch, the text body over every token (and every
    # decode step's), the LM head at the rows computed; attention's own products left out.
    info["flops"] = 2 * (vision * patches + body * batch * (length + steps) + head * rows_through_head)
    if steps:
        info["weight_bytes"] = 4 * (body + head)  # fp32: what each decode step streams
        info["decode_steps"] = steps


def score(model, given, keep: int, ours: bool):
    if ours:
        return lambda: model(**given, cont_len=keep).logits
    return lambda: transformers_call(model, lambda: model(**given, logits_to_keep=keep).logits)


def transformers_call(hf, fn):
    hf.model.rope_deltas = None  # transformers keeps the last prompt's offsets for its cached steps
    with torch.no_grad():
        return fn()


@pytest.mark.benchmark(group="images")
@pytest.mark.parametrize("backend", ["ortmodule", "transformers"])
def test_images_score(benchmark, setup, backend):
    _, model, hf, given, options = setup
    keep = options["keep"]
    benchmark.extra_info["backend"] = backend
    describe(benchmark, setup, "score", given["input_ids"].shape[0] * keep)
    out = record_rate(benchmark, score(model if backend == "ortmodule" else hf, given, keep, backend == "ortmodule"),
                      given["input_ids"].shape[0], "prompts", given["input_ids"].device.type, options["rounds"])
    if backend == "ortmodule":
        expected = score(hf, given, keep, False)()
        benchmark.extra_info["max_diff_vs_transformers"] = float(f"{(out - expected).abs().max():.3g}")
        assert torch.allclose(out, expected, atol=1e-3, rtol=1e-3)  # fp32 on both sides


@pytest.mark.benchmark(group="images")
@pytest.mark.parametrize("backend", ["ortmodule", "transformers"])
def test_images_generate(benchmark, setup, backend):
    _, model, hf, given, options = setup
    new = options["new_tokens"]
    generation = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    benchmark.extra_info["backend"] = backend
    batch = given["input_ids"].shape[0]
    describe(benchmark, setup, "generate", batch * new, steps=new - 1)

    def ours():
        return model.generate(**given, **generation)

    def theirs():
        return transformers_call(hf, lambda: hf.generate(**given, **generation))

    out = record_rate(benchmark, ours if backend == "ortmodule" else theirs, batch * new, "tokens",
                      given["input_ids"].device.type, options["rounds"])
    if backend == "ortmodule":
        same = benchmark.extra_info["same_tokens_as_transformers"] = bool(torch.equal(out, theirs()))
        assert same

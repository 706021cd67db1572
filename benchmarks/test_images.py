"""Prompts with images, ortmodule beside transformers on the same weights and the same processor
tensors: `score` (one forward over a batch of image prompts, the last `keep` positions' logits, as a
multiple-choice scorer asks: the vision model, the embedding model and the decoder) and `generate`
(greedy, `new_tokens` a row, no early end). Two workloads at the CPU size, random weights and
SmolLM2's tokenizer: `images`, Qwen2-VL-2B's config (its 675 M-weight vision tower, the one every
Qwen2-VL size has, and its 1.5 B text model), the fp32 package mobius-onnx exports, the images through
transformers' Qwen2-VL image processor at its defaults; `images_gemma3`, Gemma-3-4B's vision tower
and projector (SigLIP so400m, 896 x 896 images, 256 tokens each, attended both ways within an image)
with Gemma-3-1B's text config, the fp32 package `ortmodule export --images` writes, the images through
transformers' Gemma 3 image processor; `images_pixtral`, Mistral Small 3.1's Pixtral vision tower and patch
merger (448 x 448 images at their own size, 1,024 patches, 256 image tokens in 16 rows) with a 0.6 B
Mistral text config, the fp32 package mobius-onnx exports, the images through transformers' Pixtral
image processor as Mistral 3's processor runs it; `images_gemma4`, transformers' default Gemma 4 vision
tower (768 x 768 images, 2,304 patches pooled to 256 tokens) with a 0.9 B Gemma 4 text config, the fp32
package mobius-onnx exports, the images through transformers' Gemma 4 image processor at its defaults.
The images are random pixels. Smoke: the tiny fixtures."""

import numpy as np
import pytest
import torch
import transformers
from conftest import device_name, model_label, record_rate
from PIL import Image
from safetensors import safe_open

from ortmodule import OrtModelForCausalLM
from ortmodule_dev import fixtures


@pytest.fixture(scope="module", params=["images", "images_gemma3", "images_pixtral", "images_gemma4"])
def setup(size, request):
    options = size.get(request.param)
    if options is None:
        pytest.skip(f"no {request.param} workload at this size")
    fixture = fixtures.build(options["spec"])
    device = size["device"]
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=device)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(fixture.hf_dir, dtype=torch.float32).to(device).eval()
    return fixture, model, hf, prompts(fixture, hf.config, options, device), options


def prompts(fixture, config, options: dict, device: str) -> tuple[dict, int]:
    """The workload's prompts, made as its family's processor makes them (the makers below)."""
    made = {fixtures.GEMMA3_VL: gemma3_prompts, "mistral3": pixtral_prompts,
            "gemma4_mobius": gemma4_prompts}.get(fixture.spec.arch, qwen_prompts)
    return made(fixture, config, options, device)


def random_images(options: dict) -> list:
    side = options["image_side"]
    states = [np.random.RandomState(seed) for seed in range(options["batch"])]
    return [Image.fromarray((state.rand(side, side, 3) * 255).astype("uint8")) for state in states]


def around(fixture, options: dict, image: list[int]) -> torch.Tensor:
    """Rows of 8 random text tokens, `image`'s ids, then the rest of `text_tokens`."""
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(4, min(fixture.spec.vocab_size - 8, 32000), (options["batch"], options["text_tokens"]),
                         generator=generator)
    return torch.tensor([[*t[:8].tolist(), *image, *t[8:].tolist()] for t in text])


def on(device: str, ids: torch.Tensor, **tensors: torch.Tensor) -> dict:
    """The model's keyword inputs on `device`: the ids, an all-ones attention mask, and `tensors`."""
    return {name: tensor.to(device) for name, tensor in
            dict(input_ids=ids, attention_mask=torch.ones_like(ids), **tensors).items()}


def qwen_prompts(fixture, config, options: dict, device: str) -> tuple[dict, int]:
    """A batch of prompts, each some text, one image (random pixels, `image_side` square, through the
    Qwen2-VL image processor, its patch size from the model's config) and more text, as the
    processor's tensors and the chat template's ids make them; and the images' patches."""
    vision = config.vision_config
    processor = transformers.Qwen2VLImageProcessorPil(patch_size=vision.patch_size,
                                                      merge_size=vision.spatial_merge_size,
                                                      temporal_patch_size=vision.temporal_patch_size)
    made = processor(images=random_images(options), return_tensors="pt")
    counts = (made["image_grid_thw"].prod(1) // vision.spatial_merge_size**2).unique()
    assert len(counts) == 1  # square images of one side
    ids = around(fixture, options, [config.vision_start_token_id, *[config.image_token_id] * int(counts[0]),
                                    config.vision_end_token_id])
    given = on(device, ids, mm_token_type_ids=(ids == config.image_token_id).long(),
               pixel_values=made["pixel_values"], image_grid_thw=made["image_grid_thw"])
    return given, int(made["image_grid_thw"].prod(1).sum())


def gemma3_prompts(fixture, config, options: dict, device: str) -> tuple[dict, int]:
    """The same through Gemma 3's image processor (every image resized to the tower's side), laid out
    as Gemma3Processor does (begin-of-image, the image's tokens, end-of-image; token_type_ids marking
    the image tokens); and the images' patches."""
    vision = config.vision_config
    processor = transformers.Gemma3ImageProcessorPil(size={"height": vision.image_size, "width": vision.image_size})
    pixels = processor(random_images(options), return_tensors="pt")["pixel_values"]
    ids = around(fixture, options, [config.boi_token_index, *[config.image_token_id] * config.mm_tokens_per_image,
                                    config.eoi_token_index])
    given = on(device, ids, token_type_ids=(ids == config.image_token_id).long(), pixel_values=pixels)
    return given, len(pixels) * (vision.image_size // vision.patch_size) ** 2


def pixtral_prompts(fixture, config, options: dict, device: str) -> tuple[dict, int]:
    """The same through Pixtral's image processor as Mistral 3's processor runs it (sides in multiples of
    the patch times the merger's 2), laid out as that processor does: a row of image tokens per row of
    the merged grid, each row ended by a row break, the last by an image end (the fixture's top ids
    but one and two); and the images' patches."""
    vision = config.vision_config
    stride = vision.patch_size * config.spatial_merge_size
    processor = transformers.PixtralImageProcessorPil(patch_size=stride, size={"longest_edge": options["image_side"]})
    made = processor(random_images(options), return_tensors="pt")
    height, width = (int(side) for side in made["image_sizes"][0])
    brk, end = fixture.spec.vocab_size - 2, fixture.spec.vocab_size - 3
    tokens = ([config.image_token_index] * (width // stride) + [brk]) * (height // stride)
    ids = around(fixture, options, tokens[:-1] + [end])
    given = on(device, ids, pixel_values=made["pixel_values"], image_sizes=made["image_sizes"])
    return given, len(made["image_sizes"]) * (height // vision.patch_size) * (width // vision.patch_size)


def gemma4_prompts(fixture, config, options: dict, device: str) -> tuple[dict, int]:
    """The same through Gemma 4's image processor (each image resized to at most `max_soft_tokens` of 3 x 3
    pooled patches; the tiny fixture's patch and budget where the tower is the fixture's), laid out as
    Gemma 4's processor does (begin-of-image, the image's tokens, end-of-image; mm_token_type_ids marking
    the image tokens); and the images' patches."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    patch = config.vision_config.patch_size
    budget = {} if patch == 16 else dict(patch_size=patch, max_soft_tokens=70)  # the tiny tower's (tests)
    made = Gemma4ImageProcessorPil(**budget)(random_images(options), return_tensors="pt")
    counts = made["num_soft_tokens_per_image"].unique()
    assert len(counts) == 1  # square images of one side
    ids = around(fixture, options, [config.boi_token_id, *[config.image_token_id] * int(counts[0]),
                                    config.eoi_token_id])
    given = on(device, ids, mm_token_type_ids=(ids == config.image_token_id).long(),
               pixel_values=made["pixel_values"], image_position_ids=made["image_position_ids"])
    return given, int((made["image_position_ids"][..., 0] >= 0).sum())


def weight_counts(fixture) -> tuple[int, int, int]:
    """(vision weights: the tower and its projector, text body weights, LM head weights) from the checkpoint."""
    vision = body = 0
    for shard in fixture.hf_dir.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for key in f.keys():  # noqa: SIM118  a safetensors file, not a dict
                count = int(np.prod(f.get_slice(key).get_shape()))
                if "position_embedding" in key:
                    continue  # a table looked up, not a matmul's weights (Gemma 4's: 15.7 M)
                if any(part in key for part in ("visual", "vision_tower", "multi_modal_projector", "embed_vision")):
                    vision += count
                elif "embed_tokens" not in key and "lm_head" not in key:
                    body += count
    return vision, body, fixture.spec.hidden_size * fixture.spec.vocab_size


def describe(benchmark, setup, case: str, rows_through_head: int, steps: int = 0) -> None:
    fixture, _, _, (given, patches), options = setup
    batch, length = given["input_ids"].shape
    vision, body, head = weight_counts(fixture)
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
    if hasattr(hf.model, "rope_deltas"):
        hf.model.rope_deltas = None  # transformers' Qwen-VL keeps the last prompt's offsets for its cached steps
    with torch.no_grad():
        return fn()


@pytest.mark.benchmark(group="images")
@pytest.mark.parametrize("backend", ["ortmodule", "transformers"])
def test_images_score(benchmark, setup, backend):
    _, model, hf, (given, _), options = setup
    keep = options["keep"]
    benchmark.extra_info["backend"] = backend
    describe(benchmark, setup, "score", given["input_ids"].shape[0] * keep)
    out = record_rate(benchmark, score(model if backend == "ortmodule" else hf, given, keep, backend == "ortmodule"),
                      given["input_ids"].shape[0], "prompts", given["input_ids"].device.type, options["rounds"])
    if backend == "ortmodule":
        expected = score(hf, given, keep, False)()
        benchmark.extra_info["max_diff_vs_transformers"] = float(f"{(out - expected).abs().max():.3g}")
        if not torch.allclose(out, expected, atol=1e-3, rtol=1e-3):  # fp32 on both sides
            check_against_float64(benchmark, setup, out, expected, keep)


def check_against_float64(benchmark, setup, out, expected, keep: int) -> None:
    """Where ortmodule's and transformers' float32 logits are further apart than 1e-3, whether that is
    float32's rounding: both against transformers in float64 on the same weights, ortmodule's mean
    distance from it no more than three times transformers' float32's (their largest is recorded too).
    Gemma 4's random-weight text model at this size moves by 1e-2 under float32's rounding in either
    backend, each position's differently: its attention is unscaled after the query and key norms, so
    with 256-wide heads and untrained norms its softmax is nearly an argmax, which amplifies rounding."""
    fixture, _, _, (given, _), _ = setup
    exact_model = type(setup[2]).from_pretrained(fixture.hf_dir, dtype=torch.float64).eval()
    floats = {k: v.double() if v.is_floating_point() else v for k, v in given.items()}
    exact = score(exact_model, floats, keep, False)()
    del exact_model
    ours, theirs = (out.double() - exact).abs(), (expected.double() - exact).abs()
    info = benchmark.extra_info
    info["max_diff_vs_float64"], info["transformers_max_diff_vs_float64"] = (
        float(f"{ours.max():.3g}"), float(f"{theirs.max():.3g}"))
    info["mean_diff_vs_float64"], info["transformers_mean_diff_vs_float64"] = (
        float(f"{ours.mean():.3g}"), float(f"{theirs.mean():.3g}"))
    assert ours.mean() <= 3 * theirs.mean(), \
        f"ortmodule {ours.mean():.3g} from transformers' float64 on average, transformers' float32 {theirs.mean():.3g}"


@pytest.mark.benchmark(group="images")
@pytest.mark.parametrize("backend", ["ortmodule", "transformers"])
def test_images_generate(benchmark, setup, backend):
    _, model, hf, (given, _), options = setup
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

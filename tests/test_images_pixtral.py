"""Images in prompts on a Pixtral-form package (ortmodule/images_plain.py): mobius-onnx's Mistral 3
export (a Pixtral vision encoder taking whole images of any size, an embedding model, a Mistral
decoder). forward, cached steps, the loss and generate equal transformers'
Mistral3ForConditionalGeneration on the same weights and the same image processor output; what the
images cannot be is refused by name."""

import numpy as np
import pytest
import torch
import transformers
from helpers import load_pair, padded_rows
from PIL import Image

from ortmodule import NotSupportedError

IMAGE, BREAK, END = 511, 510, 509  # the fixture's image token (ortmodule_dev/fixtures.py); a row break, an image end
STRIDE = 8  # pixels per image token along each side: patch 4 x merge 2


def processed(*sizes, seed=0):
    """What transformers' Pixtral image processor makes of random RGB images of `sizes` (h, w), as
    Mistral 3's processor runs it (patch x merge): pixel_values padded to the largest, image_sizes."""
    state = np.random.RandomState(seed)
    pictures = [Image.fromarray((state.rand(h, w, 3) * 255).astype("uint8")) for h, w in sizes]
    out = transformers.PixtralImageProcessorPil(patch_size=STRIDE, size={"longest_edge": 64})(
        pictures, return_tensors="pt")
    return out["pixel_values"], out["image_sizes"]


def image_ids(height, width):
    """Mistral 3's processor's tokens for an image: a row of image tokens per row of its merged grid,
    each row ended by a row break, the last by an image end."""
    ids = []
    for _ in range(height // STRIDE):
        ids += [IMAGE] * (width // STRIDE) + [BREAK]
    return ids[:-1] + [END]


def prompt(sizes, text=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 500, (text,), generator=generator).tolist()
    for height, width in sizes:
        ids += image_ids(height, width) + torch.randint(10, 500, (3,), generator=generator).tolist()
    return ids


@pytest.fixture(scope="module")
def pair(build):
    return load_pair(build("mistral3"))


@pytest.fixture(scope="module")
def inputs():
    """Three rows: two images, none, one; padded to the largest image as the processor gives them."""
    pixels, sizes = processed((40, 64), (24, 16), (32, 32))
    every = sizes.tolist()
    ids, mask = padded_rows([prompt(every[:2], 7, 1), prompt([], 12, 2), prompt(every[2:], 4, 3)])
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_sizes=sizes)


def reference(hf, **given):
    with torch.no_grad():
        return hf(**given)


@pytest.mark.parametrize("left", [True, False])
def test_logits_equal_transformers_with_images(pair, inputs, left):
    model, hf = pair
    given = dict(inputs)
    if not left:
        rows = [r[m.bool()].tolist() for r, m in zip(given["input_ids"], given["attention_mask"])]
        given["input_ids"], given["attention_mask"] = padded_rows(rows, left=False)
    real = given["attention_mask"].bool()
    expected = reference(hf, **given).logits[real]
    assert torch.allclose(model(**given).logits[real], expected, atol=1e-4, rtol=1e-4)
    text = model(given["input_ids"], attention_mask=given["attention_mask"]).logits[real]
    assert not torch.allclose(text, expected, atol=1e-2)  # the images matter


def test_steps_and_loss_with_images_equal_transformers(pair, inputs):
    model, hf = pair
    real = inputs["attention_mask"].bool()
    out = model(**inputs, use_cache=True)
    tokens = torch.tensor([[7], [8], [9]])
    mask = torch.cat([inputs["attention_mask"], torch.ones(3, 1, dtype=torch.int64)], 1)
    step = model(tokens, attention_mask=mask, past_key_values=out.past_key_values)
    whole = reference(hf, **dict(inputs, input_ids=torch.cat([inputs["input_ids"], tokens], 1), attention_mask=mask))
    assert torch.allclose(step.logits[:, -1], whole.logits[:, -1], atol=1e-4, rtol=1e-4)
    after_padding = torch.cat([torch.ones_like(real[:, :1]), real[:, :-1]], 1) == 0
    labels = inputs["input_ids"].masked_fill(~real | after_padding, -100)
    assert torch.allclose(model(**inputs, labels=labels).loss, reference(hf, **inputs, labels=labels).loss,
                          atol=1e-5, rtol=1e-5)


def test_generate_with_images_equals_transformers(pair, inputs):
    """Greedy and sampled generate as transformers' loop; copies for num_return_sequences each take
    their row's images (a row's images counted off by their tokens: row breaks split an image's)."""
    model, hf = pair
    options = dict(max_new_tokens=8, pad_token_id=2)
    for mode in (dict(do_sample=False), dict(do_sample=True, top_k=20)):
        torch.manual_seed(7)
        expected = hf.generate(**inputs, **options, **mode)
        torch.manual_seed(7)
        assert torch.equal(model.generate(**inputs, **options, **mode), expected)
    scored = dict(options, return_dict_in_generate=True, output_logits=True)
    greedy = model.generate(**inputs, **scored, do_sample=False)
    copies = model.generate(**inputs, **scored, do_sample=True, top_k=1, num_return_sequences=2)
    assert torch.equal(copies.sequences, greedy.sequences.repeat_interleave(2, 0))
    assert torch.allclose(copies.logits[0], greedy.logits[0].repeat_interleave(2, 0), atol=1e-5, rtol=1e-5)


def test_what_images_cannot_be_is_refused(pair, inputs):
    model, _ = pair
    given = dict(inputs)
    one_short = given["input_ids"].clone()
    one_short[0, (one_short[0] == IMAGE).nonzero()[0]] = 20
    with pytest.raises(ValueError, match="image tokens and images do not match"):
        model(**dict(given, input_ids=one_short))
    sizes = given["image_sizes"].clone()
    sizes[1] = torch.tensor([20, 16])
    with pytest.raises(ValueError, match="a positive multiple of 8"):
        model(**dict(given, image_sizes=sizes))
    wide = torch.zeros(3, 3, 40, 72)
    with pytest.raises(ValueError, match=r"at most 64 \(the vision model's largest side\)"):
        model(**dict(given, pixel_values=wide, image_sizes=torch.tensor([[40, 72], [24, 16], [32, 32]])))
    with pytest.raises(ValueError, match="have 4 channels; the vision model takes 3"):
        model(**dict(given, pixel_values=torch.zeros(3, 4, 40, 64)))
    with pytest.raises(ValueError, match=r"must be a float tensor \[images, channels, height, width\]"):
        model(**dict(given, pixel_values=given["pixel_values"][0]))
    with pytest.raises(ValueError, match="image_sizes must be an integer tensor"):
        model(**dict(given, image_sizes=given["image_sizes"].float()))
    with pytest.raises(ValueError, match=r"image_grid_thw was given; this package's vision model \(Pixtral's form\)"):
        model(**dict(given, image_grid_thw=torch.tensor([[1, 4, 4]] * 3)))
    with pytest.raises(NotSupportedError, match="videos of Pixtral-form packages are not run"):
        model(given["input_ids"], pixel_values_videos=torch.zeros(4, 12))


def test_the_server_refuses_pixtral_images_at_start_naming_why(build, tmp_path):
    from helpers import tokenizer_with

    from ortmodule import OrtModelForCausalLM
    from ortmodule.serving import create_app

    fixture = build("mistral3")
    transformers.PixtralImageProcessorPil(patch_size=STRIDE).save_pretrained(tmp_path)
    tokenizer = tokenizer_with(fixture.package_dir, {IMAGE: "[IMG]"}, "{{ messages[0]['content'] }}")
    with pytest.raises(ValueError, match="this one's vision model is Pixtral's"):
        create_app(OrtModelForCausalLM.from_pretrained(fixture.package_dir), tokenizer, processor=str(tmp_path))

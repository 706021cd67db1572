"""Images in prompts on a Pixtral-form package (ortmodule/images_plain.py): mobius-onnx's Mistral 3
export (a Pixtral vision encoder taking whole images of any size, an embedding model, a Mistral
decoder). forward, cached steps, the loss and generate equal transformers'
Mistral3ForConditionalGeneration on the same weights and the same image processor output; what the
images cannot be is refused by name."""

import json

import numpy as np
import pytest
import torch
import transformers
from helpers import (
    check_copies_take_their_images,
    check_generate_modes,
    check_hidden_states_with_images,
    check_image_step_and_loss,
    load_pair,
    padded_rows,
    tokenizer_with,
)
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


def test_steps_hidden_states_and_loss_with_images_equal_transformers(pair, inputs):
    """Hidden states, a step and the loss with images as transformers'; and a cache emptied by `reset()`
    takes the prompt with its images again (it was taken as a step, where images are refused)."""
    model, hf = pair
    out = check_hidden_states_with_images(model, hf, inputs, layers=2)
    check_image_step_and_loss(model, hf, inputs, out.past_key_values)
    cache = out.past_key_values
    cache.reset()  # emptied, it takes the prompt with its images again, filled in place
    model(**inputs, past_key_values=cache)
    check_image_step_and_loss(model, hf, inputs, cache)


def test_generate_with_images_equals_transformers(pair, inputs):
    """Greedy and sampled generate as transformers' loop; beams on rows of one image each; copies for
    num_return_sequences each take their row's images (a row's images counted off by their tokens:
    row breaks split an image's)."""
    model, hf = pair
    options = dict(max_new_tokens=8, pad_token_id=2)
    check_generate_modes(model, hf, inputs, options)
    pixels, sizes = processed((40, 64), (32, 32), seed=4)  # beams: rows of one image each
    ids, mask = padded_rows([prompt(sizes.tolist()[:1], 7, 1), prompt(sizes.tolist()[1:], 4, 3)])
    one_each = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_sizes=sizes)
    beams = dict(options, do_sample=False, num_beams=3, num_return_sequences=2)
    assert torch.equal(model.generate(**one_each, **beams), hf.generate(**one_each, **beams))
    check_copies_take_their_images(model, inputs, options)


def test_a_half_precision_package_answers_within_its_rounding(build, inputs):
    """mobius-onnx's Mistral 3 package in fp16 (`mobius build --dtype f16`): the vision, embedding and
    decoder models in fp16, logits within fp16's rounding of transformers' fp32 on the same weights,
    the same greedy tokens."""
    from helpers import check_half_precision_images

    check_half_precision_images(*load_pair(build("mistral3", precision="fp16")), inputs)


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


# A chat template of Mistral 3's form: an image part is one [IMG], which the processor (and the
# server) expands to rows of image tokens with row breaks and an image end.
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}[IMG]"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}[/{{ m['role'] }}]{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


class PixtralTextProcessor:
    """transformers' Mistral 3 processor (PixtralProcessor, which needs torchvision, absent here) as
    it runs: the Pixtral image processor's output at patch x merge, and each [IMG] in the text
    expanded to the image's rows of image tokens, row breaks and image end (`image_ids`)."""

    image_token = "[IMG]"

    def __init__(self, package_dir):
        self.tokenizer = tokenizer_with(package_dir, {IMAGE: "[IMG]", BREAK: "[IMG_BREAK]", END: "[IMG_END]"}, TEMPLATE)
        self.image_processor = transformers.PixtralImageProcessorPil(patch_size=4, size={"longest_edge": 64})

    def save_pretrained(self, folder):
        """What a Mistral 3 checkpoint's folder holds for its processor."""
        self.image_processor.save_pretrained(folder)
        settings = dict(processor_class="PixtralProcessor", patch_size=4, spatial_merge_size=2, image_token="[IMG]",
                        image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]")
        (folder / "processor_config.json").write_text(json.dumps(settings))

    def __call__(self, images=None, text=None, return_tensors=None, padding=False, truncation=False, **kwargs):
        texts = [text] if isinstance(text, str) else list(text)
        flat = [image for group in images or [] for image in (group if isinstance(group, list) else [group])]
        out = {}
        if flat:
            made = self.image_processor(flat, patch_size=STRIDE, return_tensors="pt")
            runs = iter(self.tokenizer.decode(image_ids(*size)) for size in made["image_sizes"].tolist())
            texts = ["".join(piece if i == 0 else next(runs) + piece for i, piece in enumerate(t.split("[IMG]")))
                     for t in texts]
            out.update(pixel_values=made["pixel_values"], image_sizes=made["image_sizes"])
        out.update(self.tokenizer(texts, padding=padding, truncation=truncation, return_tensors=return_tensors))
        return transformers.BatchFeature(out)


def test_the_server_takes_images_in_chat_messages(build, pair, tmp_path):
    """`ortmodule serve --processor FOLDER` on the Mistral 3 package: chat messages with image_url parts
    answer as transformers' greedy generate on what Mistral 3's processor makes of the template's text
    and the same images, beside a text completion; a tokenizer without the row-break token, and an
    image processor resizing past the vision model's largest side, are refused at start."""
    from helpers import ImageChats, LiveServer, png_url

    from ortmodule import OrtModelForCausalLM
    from ortmodule.serving import create_app

    fixture = build("mistral3")
    _, hf = pair
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    processor = PixtralTextProcessor(fixture.package_dir)
    (tmp_path / "processor").mkdir()
    processor.save_pretrained(tmp_path / "processor")  # its processor_config.json names the three tokens
    tokenizer = processor.tokenizer
    without_break = tokenizer_with(fixture.package_dir, {IMAGE: "[IMG]", END: "[IMG_END]"}, TEMPLATE)
    with pytest.raises(ValueError, match=r"the tokenizer; it has no \['\[IMG_BREAK\]'\]"):
        create_app(model, without_break, processor=str(tmp_path / "processor"))
    transformers.PixtralImageProcessorPil(patch_size=4, size={"longest_edge": 128}).save_pretrained(tmp_path / "large")
    with pytest.raises(ValueError, match="up to 128 pixels a side .* past the vision model's largest side, 64"):
        create_app(model, tokenizer, processor=str(tmp_path / "large"))
    server = LiveServer(create_app(model, tokenizer, name="vl", processor=str(tmp_path / "processor")))
    try:
        talk = ImageChats([(40, 60), (30, 30)])
        made = talk.check(server, tokenizer, hf,
                          lambda text, images: processor(text=[text], images=images, return_tensors="pt"))
        for one, images in zip(made, talk.pictures):
            assert (one["input_ids"] == BREAK).any() and (one["input_ids"] == END).sum() == len(images)
        thin = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url((1, 300), 3)[0]}}]}]
        refused = talk.chat(server, thin)  # the image processor resizes it to no rows at all
        assert refused.status_code == 400
        assert "the image processor could not take the images (300 x 1 pixels)" in refused.json()["error"]["message"]
    finally:
        server.stop()


def test_lm_eval_multimodal_backend_answers_as_hf_multimodal(build, pair, tmp_path):
    """`--model ortmodule-multimodal` on an image task (MMMU's form), batched and left-padded, against
    lm-eval's own `hf-multimodal` on the transformers model with the same processor: every response equal."""
    from helpers import check_image_task

    fixture = build("mistral3")
    check_image_task(tmp_path, "ortmodule_pixtral_images_test", (30, 40, 6, "abcde"),
                     PixtralTextProcessor(fixture.package_dir), pair[1], fixture.package_dir)

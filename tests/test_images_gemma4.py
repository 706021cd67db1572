"""Images in prompts on a Gemma 4-form package (ortmodule/images_plain.py): mobius-onnx's Gemma 4
export (vision encoder taking pixel_values and pixel_position_ids, an embedding model giving
inputs_embeds and per_layer_inputs, a causal decoder). forward, cached steps, hidden states, the loss
and generate equal transformers' Gemma4ForConditionalGeneration on the same weights and the same
image processor output; what the images cannot be is refused by name."""

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from helpers import (
    check_copies_take_their_images,
    check_generate_modes,
    check_hidden_states_with_images,
    check_image_step_and_loss,
    check_image_task,
    load_pair,
    padded_rows,
)
from PIL import Image

from ortmodule import NotSupportedError, OrtModelForCausalLM

IMAGE, BOI, EOI = 509, 511, 510  # the fixture's reserved ids (ortmodule_dev/fixtures.py, Gemma 4's config)
POOLING = 3


def processed(*sizes, seed=0):
    """What transformers' Gemma 4 image processor makes of random RGB images of `sizes` (h, w):
    pixel_values, image_position_ids (padded to the batch's patches with (-1, -1)) and each image's tokens."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    state = np.random.RandomState(seed)
    pictures = [Image.fromarray((state.rand(h, w, 3) * 255).astype("uint8")) for h, w in sizes]
    out = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=POOLING)(
        pictures, return_tensors="pt")
    return out["pixel_values"], out["image_position_ids"], out["num_soft_tokens_per_image"].tolist()


def prompt(tokens, text=5, seed=0):
    """Token ids: text, then for each image of `tokens` tokens a begin-of-image, its image tokens, an
    end-of-image and text (Gemma 4's processor's layout)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 500, (text,), generator=generator).tolist()
    for count in tokens:
        ids += [BOI] + [IMAGE] * count + [EOI] + torch.randint(10, 500, (3,), generator=generator).tolist()
    return ids


@pytest.fixture(scope="module")
def pair(build):
    return load_pair(build("gemma4_mobius"))


@pytest.fixture(scope="module")
def inputs():
    """Three rows: two images, none, one; the images as the processor gives them (padded to one size)."""
    pixels, positions, tokens = processed((40, 60), (30, 30), (50, 20))
    ids, mask = padded_rows([prompt(tokens[:2], 7, 1), prompt([], 12, 2), prompt(tokens[2:], 4, 3)])
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_position_ids=positions,
                mm_token_type_ids=(ids == IMAGE).long())


def reference(hf, **given):
    with torch.no_grad():
        return hf(**given)


def right_padded(given):
    rows = [r[m.bool()].tolist() for r, m in zip(given["input_ids"], given["attention_mask"])]
    ids, mask = padded_rows(rows, left=False)
    return dict(given, input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == IMAGE).long())


@pytest.mark.parametrize("left", [True, False])
def test_logits_equal_transformers_with_images(pair, inputs, left):
    model, hf = pair
    given = inputs if left else right_padded(inputs)
    real = given["attention_mask"].bool()
    expected = reference(hf, **given).logits[real]
    assert torch.allclose(model(**given).logits[real], expected, atol=1e-4, rtol=1e-4)
    padded_with_images = given["input_ids"].masked_fill(given["attention_mask"] == 0, IMAGE)  # not counted
    assert torch.allclose(model(**dict(given, input_ids=padded_with_images, mm_token_type_ids=None)).logits[real],
                          expected, atol=1e-4, rtol=1e-4)
    # The images matter: the same ids without them are other logits.
    text = model(given["input_ids"], attention_mask=given["attention_mask"]).logits[real]
    assert not torch.allclose(text, expected, atol=1e-2)


def test_steps_hidden_states_and_loss_with_images_equal_transformers(pair, inputs):
    """A prompt with images into a cache, then a step; hidden states (the graph's norms found by their
    weights' names) at every real position; the loss."""
    model, hf = pair
    out = check_hidden_states_with_images(model, hf, inputs, layers=2)
    check_image_step_and_loss(model, hf, inputs, out.past_key_values,
                              lambda ids: {"mm_token_type_ids": (ids == IMAGE).long()})


def test_generate_with_images_equals_transformers(pair, inputs):
    """Greedy and sampled generate from the image prompts: the same tokens as transformers' loop (the
    same seed, the same samples). Beams repeat each row with its own images: against transformers on
    rows of one image each (its own repetition copies pixel_values row by row, right only there), and
    a row of two images against the same row alone."""
    model, hf = pair
    options = dict(max_new_tokens=8, pad_token_id=2)
    check_generate_modes(model, hf, inputs, options)
    beams = dict(options, do_sample=False, num_beams=3, num_return_sequences=2)
    pixels, positions, tokens = processed((40, 60), (50, 20), seed=4)
    ids, mask = padded_rows([prompt(tokens[:1], 6, 5), prompt(tokens[1:], 3, 6)])
    single = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_position_ids=positions)
    assert torch.equal(model.generate(**single, **beams), hf.generate(**single, **beams))
    check_copies_take_their_images(model, inputs, options)
    together = model.generate(**inputs, **beams)
    first = {k: v[:1] for k, v in inputs.items() if k not in ("pixel_values", "image_position_ids")}
    alone = model.generate(**first, pixel_values=inputs["pixel_values"][:2],
                           image_position_ids=inputs["image_position_ids"][:2], **beams)
    assert torch.equal(together[:2, -alone.shape[1]:], alone)


def test_a_half_precision_package_answers_within_its_rounding(build, inputs):
    """mobius-onnx's Gemma 4 package in fp16 (`mobius build --dtype f16`): the vision, embedding and
    decoder models in fp16, logits within fp16's rounding of transformers' fp32 on the same weights,
    the same greedy tokens."""
    from helpers import check_half_precision_images

    check_half_precision_images(*load_pair(build("gemma4_mobius", precision="fp16")), inputs)


def test_what_images_cannot_be_is_refused(pair, inputs):
    model, _ = pair
    given = dict(inputs)
    one_short = given["input_ids"].clone()
    one_short[0, (one_short[0] == IMAGE).nonzero()[0]] = 20  # a run one token shorter than its image
    with pytest.raises(ValueError, match="image tokens and images do not match"):
        model(**dict(given, input_ids=one_short, mm_token_type_ids=None))
    swapped = dict(given, pixel_values=given["pixel_values"][[0, 2, 1]],
                   image_position_ids=given["image_position_ids"][[0, 2, 1]])  # an image's tokens across two rows
    with pytest.raises(ValueError, match="each row's tokens must be its images' in order"):
        model(**swapped)
    with pytest.raises(ValueError, match="need image_position_ids"):
        model(**dict(given, image_position_ids=None))
    with pytest.raises(ValueError, match="patches hold 47 values; the vision model takes 48"):
        model(**dict(given, pixel_values=given["pixel_values"][..., :47]))
    with pytest.raises(ValueError, match="image_position_ids must be an integer tensor"):
        model(**dict(given, image_position_ids=given["image_position_ids"].float()))
    cut = given["image_position_ids"].clone()
    cut[0, 0] = -1  # one real patch fewer: not a whole number of pooled tokens
    with pytest.raises(ValueError, match="a positive multiple of 9"):
        model(**dict(given, image_position_ids=cut))
    with pytest.raises(ValueError, match=r"image_grid_thw was given; this package's vision model \(Gemma 4's form\)"):
        model(**dict(given, image_grid_thw=torch.tensor([[1, 4, 4]] * 3)))
    with pytest.raises(ValueError, match="without pixel_values"):
        model(**dict(given, pixel_values=None))
    with pytest.raises(ValueError, match="mark other tokens than input_ids' image tokens"):
        model(**dict(given, mm_token_type_ids=torch.zeros_like(given["input_ids"])))
    with pytest.raises(NotSupportedError, match="videos of Gemma 4-form packages are not run"):
        model(given["input_ids"], pixel_values_videos=given["pixel_values"])
    with pytest.raises(NotSupportedError, match="inputs_embeds: the package's embedding model also gives"):
        model(inputs_embeds=torch.zeros(1, 3, model.package.hidden_size))  # still: ortmodule cannot make them


def test_a_model_attending_both_ways_within_an_image_is_refused(build, inputs, tmp_path):
    """transformers' Gemma 4 with use_bidirectional_attention='vision' (its 26B-A4B and 31B) attends both
    ways within an image on its sliding layers, the exported decoder causally: where the checkpoint's
    config.json in the package says so, images are refused; text still runs."""
    fixture = build("gemma4_mobius")
    package = tmp_path / "package"
    shutil.copytree(fixture.package_dir, package)
    config = json.loads((fixture.hf_dir / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (package / "config.json").write_text(json.dumps(config))
    model = OrtModelForCausalLM.from_pretrained(package)
    with pytest.raises(NotSupportedError, match="use_bidirectional_attention='vision'"):
        model(**inputs)
    assert model(inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits.shape[:2] == \
        inputs["input_ids"].shape


def test_the_pooling_comes_from_the_checkpoint_config_without_the_processor_settings(build, inputs, tmp_path):
    fixture = build("gemma4_mobius")
    package = tmp_path / "package"
    shutil.copytree(fixture.package_dir, package)
    (package / "image_processor.json").unlink()
    model = OrtModelForCausalLM.from_pretrained(package)
    with pytest.raises(Exception, match="pooling_kernel_size"):
        model(**inputs)
    shutil.copy(fixture.hf_dir / "config.json", package / "config.json")
    model = OrtModelForCausalLM.from_pretrained(package)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(fixture.hf_dir).eval()
    real = inputs["attention_mask"].bool()
    assert torch.allclose(model(**inputs).logits[real], reference(hf, **inputs).logits[real], atol=1e-4, rtol=1e-4)


# A chat template of Gemma 4's form: an image part is one image token, which the processor (and the
# server) expands to a begin-of-image, the image's soft tokens and an end-of-image.
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<|image|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def test_the_server_takes_images_in_chat_messages(build, pair, tmp_path):
    """`ortmodule serve --processor FOLDER` on the Gemma 4 package: chat messages with image_url parts
    answer as transformers' greedy generate on what its image processor makes of the same images and
    the template's ids (each image token expanded to its begin, soft tokens and end), beside a text
    completion; a processor folder without the checkpoint's config.json is refused naming it."""

    from helpers import ImageChats, LiveServer, expected_text, tokenizer_with
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from ortmodule.serving import create_app

    fixture = build("gemma4_mobius")
    _, hf = pair
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    tokenizer = tokenizer_with(fixture.package_dir, {IMAGE: "<|image|>"}, TEMPLATE)
    settings = dict(patch_size=4, max_soft_tokens=70, pooling_kernel_size=POOLING)
    Gemma4ImageProcessorPil(**settings).save_pretrained(tmp_path / "processor")
    with pytest.raises(ValueError, match="Gemma's images need the checkpoint's config.json there"):
        create_app(model, tokenizer, processor=str(tmp_path / "processor"))
    shutil.copy(fixture.hf_dir / "config.json", tmp_path / "processor" / "config.json")
    server = LiveServer(create_app(model, tokenizer, name="vl", processor=str(tmp_path / "processor")))
    try:
        talk = ImageChats([(40, 60), (30, 30)])
        answers = talk.send(server)
        for messages, images, answer in zip(talk.chats, talk.pictures, answers):
            assert answer.status_code == 200, answer.text
            ids = talk.template_ids(tokenizer, messages)
            made = Gemma4ImageProcessorPil(**settings)(images, return_tensors="pt")
            counts = iter(made["num_soft_tokens_per_image"].tolist())
            ids = [t for token in ids for t in ([BOI, *[IMAGE] * next(counts), EOI] if token == IMAGE else [token])]
            ids = torch.tensor([ids])
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  pixel_values=made["pixel_values"], image_position_ids=made["image_position_ids"],
                                  max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
            expected = expected_text(tokenizer, out[0, ids.shape[1]:].tolist())
            choice = answer.json()["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == expected
            assert answer.json()["usage"]["prompt_tokens"] == ids.shape[1]
        assert answers[-1].status_code == 200
        assert answers[-1].json()["choices"][0]["text"] == talk.completion(server).json()["choices"][0]["text"]
    finally:
        server.stop()


class GemmaImageTextProcessor:
    """transformers' Gemma 4 processor for images (whose video and audio halves need torchvision and
    librosa's kin, which this environment lacks): the Gemma 4 image processor's output, and each
    `<|image|>` in the text expanded to a begin-of-image, its soft tokens and an end-of-image, as
    Gemma4Processor expands it."""

    image_token = "<|image|>"

    def __init__(self, package_dir):
        from helpers import tokenizer_with
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        self.tokenizer = tokenizer_with(package_dir, {IMAGE: self.image_token, EOI: "<|eoi|>", BOI: "<|boi|>"}, "")
        self.image_processor = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=POOLING)

    def __call__(self, images=None, text=None, return_tensors=None, padding=False, truncation=False, **kwargs):
        texts = [text] if isinstance(text, str) else list(text)
        flat = [image for group in images or [] for image in (group if isinstance(group, list) else [group])]
        out = {}
        if flat:
            encoded = self.image_processor(flat, return_tensors="pt")
            counts = iter(encoded["num_soft_tokens_per_image"].tolist())
            texts = [t.replace(self.image_token, "\0") for t in texts]
            texts = ["".join(piece if i == 0 else f"<|boi|>{self.image_token * next(counts)}<|eoi|>{piece}"
                             for i, piece in enumerate(t.split("\0"))) for t in texts]
            out.update(pixel_values=encoded["pixel_values"], image_position_ids=encoded["image_position_ids"])
        tokens = self.tokenizer(texts, padding=padding, truncation=truncation, return_tensors=return_tensors)
        out.update(tokens)
        if return_tensors == "pt":
            out["mm_token_type_ids"] = (tokens["input_ids"] == IMAGE).long()
        return transformers.BatchFeature(out)


def test_lm_eval_multimodal_backend_answers_as_hf_multimodal(build, pair, tmp_path):
    """`--model ortmodule-multimodal` on an image task (MMMU's form), batched and left-padded, against
    lm-eval's own `hf-multimodal` on the transformers model with the same processor: every response equal."""
    fixture = build("gemma4_mobius")
    check_image_task(tmp_path, "ortmodule_gemma_images_test", (30, 40, 6, "abcde"),
                     GemmaImageTextProcessor(fixture.package_dir), pair[1], fixture.package_dir)


def test_layers_reusing_earlier_layers_keys_and_values(build, inputs):
    """Gemma 4 E2B's and E4B's form: the last layers reuse an earlier layer's keys and values
    (`num_kv_shared_layers`), and mobius-onnx's graph has KV inputs for the first layers only. Text
    and images, a cached step and greedy generate as transformers on the same weights."""
    fixture = build("gemma4_mobius", num_layers=4, kv_shared_layers=2)
    model, hf = load_pair(fixture)
    assert len(model.decoder.spec.layers) == 2 and model.package.num_hidden_layers == 4
    real = inputs["attention_mask"].bool()
    out = model(**inputs, use_cache=True)
    assert torch.allclose(out.logits[real], reference(hf, **inputs).logits[real], atol=1e-4, rtol=1e-4)
    text = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    assert torch.allclose(model(**text).logits[real], reference(hf, **text).logits[real], atol=1e-4, rtol=1e-4)
    check_image_step_and_loss(model, hf, inputs, out.past_key_values,
                              lambda ids: {"mm_token_type_ids": (ids == IMAGE).long()})
    options = dict(max_new_tokens=8, pad_token_id=2, do_sample=False)
    assert torch.equal(model.generate(**inputs, **options), hf.generate(**inputs, **options))

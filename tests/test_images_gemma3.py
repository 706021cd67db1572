"""Images in prompts on a Gemma 3 package in onnxruntime-genai's form (the builder's decoder taking
inputs_embeds, a vision model taking whole images at the tower's size, an embedding model): forward,
cached steps, the loss and generate equal transformers' Gemma3ForConditionalGeneration on the same
weights and the same image processor output. transformers attends both ways within each image where
the processor's token_type_ids mark them (ortmodule/blocks.py), causally without them; both are
checked. What the images cannot be is refused by name."""

import logging
import math
import shutil

import numpy as np
import onnx
import pytest
import torch
import transformers
from helpers import (
    GREEDY_AND_SAMPLED,
    check_copies_take_their_images,
    check_generate_modes,
    check_image_step_and_loss,
    load_pair,
    padded_rows,
)
from PIL import Image

from ortmodule import OrtModelForCausalLM

IMAGE, BOI, EOI = 511, 510, 509  # the fixture's image token, begin- and end-of-image (ortmodule_dev/fixtures.py)
TOKENS, SIDE = 4, 32  # the fixture's tokens an image and the tower's image side


def processed(count, seed=0):
    """What transformers' Gemma 3 image processor makes of `count` random RGB images of several sizes."""
    state = np.random.RandomState(seed)
    pictures = [Image.fromarray((state.rand(30 + 7 * i, 50 - 5 * i, 3) * 255).astype("uint8")) for i in range(count)]
    return transformers.Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE})(
        pictures, return_tensors="pt")["pixel_values"]


def prompt(images, text=5, seed=0):
    """Token ids as Gemma 3's processor lays them out: text, then each image's begin, its tokens, end."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 500, (text,), generator=generator).tolist()
    for _ in range(images):
        ids += [BOI] + [IMAGE] * TOKENS + [EOI] + torch.randint(10, 500, (3,), generator=generator).tolist()
    return ids


def marked(given):
    """`given` with the processor's token_type_ids (1 at image tokens) for its input_ids."""
    return dict(given, token_type_ids=(given["input_ids"] == IMAGE).long())


@pytest.fixture(scope="module")
def pair(build):
    return load_pair(build("gemma3_vl"))


@pytest.fixture(scope="module")
def deep(build):
    """Four layers, a full one after a full one: the blocks of the first reach the text after the images
    (with two, they change the image tokens' own outputs only)."""
    return load_pair(build("gemma3_vl", num_layers=4))


@pytest.fixture(scope="module")
def inputs():
    """Three rows: two images, none, one; left-padded; token_type_ids as the processor gives them."""
    ids, mask = padded_rows([prompt(2, 7, 1), prompt(0, 12, 2), prompt(1, 4, 3)])
    return marked(dict(input_ids=ids, attention_mask=mask, pixel_values=processed(3)))


def reference(hf, **given):
    with torch.no_grad():
        return hf(**given)


def test_num_parameters_count_the_vision_tower_and_a_tied_embedding_once(pair):
    """A multimodal package's `num_parameters()`: its three graphs' weights, the LM head (in the decoder)
    tied to the token embedding (in the embedding model) counted once, as transformers counts it. The
    vision graph is compared with its own initializers, not transformers' vision tower: torch's exporter
    folds the fixture's zero biases and merges its norm weights of ones, and leaves out SigLIP's pooling
    head, which Gemma 3 never runs. The embedding tables (the tokens', the patches' positions) are what
    `exclude_embeddings` leaves out, in both."""
    model, hf = pair
    text = sum(p.numel() for name, p in hf.named_parameters() if ".language_model." in f".{name}")
    vision = onnx.load(str(model.package.root / "vision.onnx"), load_external_data=False).graph
    assert model.num_parameters() == text + sum(math.prod(t.dims) for t in vision.initializer)
    tables = hf.num_parameters() - hf.num_parameters(exclude_embeddings=True)
    assert model.num_parameters() - model.num_parameters(exclude_embeddings=True) == tables


@pytest.mark.parametrize("left", [True, False])
def test_logits_equal_transformers_with_images(pair, inputs, left):
    """With token_type_ids, each image attended both ways (as transformers does, which differs from
    causal attention by far more than the tolerance); without them, causally, as transformers then does."""
    model, hf = pair
    given = dict(inputs)
    if not left:
        rows = [r[m.bool()].tolist() for r, m in zip(given["input_ids"], given["attention_mask"])]
        given["input_ids"], given["attention_mask"] = padded_rows(rows, left=False)
        given = marked(given)
    real = given["attention_mask"].bool()
    expected = reference(hf, **given).logits[real]
    assert torch.allclose(model(**given).logits[real], expected, atol=1e-4, rtol=1e-4)
    causal = {name: value for name, value in given.items() if name != "token_type_ids"}
    expected_causal = reference(hf, **causal).logits[real]
    assert not torch.allclose(expected_causal, expected, atol=1e-2)  # the blocks matter
    assert torch.allclose(model(**causal).logits[real], expected_causal, atol=1e-4, rtol=1e-4)


def test_steps_hidden_states_and_loss_with_images_equal_transformers(deep, inputs):
    """A prompt with images into a cache (its hidden states with each image attended both ways, from
    the blocks graph with hidden.py's outputs, and causally without the marks), then a step; the loss."""
    model, hf = deep
    real = inputs["attention_mask"].bool()
    causal = {name: value for name, value in inputs.items() if name != "token_type_ids"}
    for given in (inputs, causal):
        out = model(**given, use_cache=True, output_hidden_states=True)
        expected = reference(hf, **given, output_hidden_states=True)
        assert len(out.hidden_states) == len(expected.hidden_states) == 5
        for ours, theirs in zip(out.hidden_states, expected.hidden_states):
            assert torch.allclose(ours[real], theirs[real], atol=1e-4, rtol=1e-4)
        assert torch.allclose(out.logits[real], expected.logits[real], atol=1e-4, rtol=1e-4)
    blocked = reference(hf, **inputs, output_hidden_states=True).hidden_states[-1][real]
    assert not torch.allclose(expected.hidden_states[-1][real], blocked, atol=1e-2)  # the blocks matter
    out = model(**inputs, use_cache=True, output_hidden_states=True)
    check_image_step_and_loss(model, hf, inputs, out.past_key_values,
                              lambda ids: {"token_type_ids": (ids == IMAGE).long()})


def test_attentions_with_images_equal_transformers(build, inputs):
    """`output_attentions=True` with images: marked, each image attended both ways (the blocks graph's
    ONNX Attention with its mask), and causally without the marks (GroupQueryAttention), every layer's
    weights at the real queries as transformers' eager attention gives them, sliding layers included."""
    fixture = build("gemma3_vl", num_layers=4)
    model = load_pair(fixture)[0]
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(fixture.hf_dir, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()
    real = inputs["attention_mask"].bool()[:, None, :, None]
    causal = {name: value for name, value in inputs.items() if name != "token_type_ids"}
    found = []
    for given in (inputs, causal):
        ours = model(**given, output_attentions=True).attentions
        theirs = reference(hf, **given, output_attentions=True).attentions
        assert len(ours) == len(theirs) == 4
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape and (a - b).mul(real).abs().max().item() < 1e-5
            assert (a[~real.expand_as(a)] == 0).all()
        found.append(ours[0])
    assert (found[0] - found[1]).abs().max().item() > 1e-2  # the blocks matter


def test_hidden_states_with_marked_images_make_no_unused_session(build, inputs, caplog):
    """The blocks graph gives a marked prompt's hidden states: forward makes no session of the package
    graph with hidden-state outputs for it (on CUDA one would hold the weights once more, unused);
    a prompt without marks takes that session."""
    model = OrtModelForCausalLM.from_pretrained(build("gemma3_vl", num_layers=4).package_dir)
    causal = {name: value for name, value in inputs.items() if name != "token_type_ids"}
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        assert len(model(**inputs, output_hidden_states=True).hidden_states) == 5
        assert "for hidden states" not in caplog.text
        assert len(model(**causal, output_hidden_states=True).hidden_states) == 5
        assert "for hidden states" in caplog.text


def test_generate_with_images_equals_transformers(deep, inputs):
    """Greedy, sampled and beam generate as transformers' loops; copies for num_return_sequences each
    take their row's images (checked on the first step's logits)."""
    model, hf = deep
    options = dict(max_new_tokens=8, pad_token_id=2)
    check_generate_modes(model, hf, inputs, options,
                         (*GREEDY_AND_SAMPLED, dict(do_sample=False, num_beams=3, num_return_sequences=2)))
    check_copies_take_their_images(model, inputs, options)


def test_pan_and_scan_crops_are_images_of_their_own(build, deep, tmp_path):
    """Gemma3Processor with pan-and-scan (`do_pan_and_scan=True` in its call: a wide picture, then its
    crops, each an image of its own within the processor's sentence), two prompts padded together:
    the logits and greedy generate equal transformers' on the processor's output."""
    from helpers import png_url

    model, hf = deep
    processor = gemma3_processor(build("gemma3_vl", num_layers=4).package_dir, tmp_path / "tokenizer")
    processor.tokenizer.padding_side = "left"  # as for generate
    wide, square = png_url((30, 100), 1)[1], png_url((30, 30), 2)[1]
    given = processor(text=["a <start_of_image> b", "c <start_of_image> d <start_of_image>"],
                      images=[[wide], [square, wide]], padding=True, return_tensors="pt", do_pan_and_scan=True,
                      pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=3,
                      pan_and_scan_min_ratio_to_activate=1.2)
    assert given["pixel_values"].shape[0] > 3  # the wide picture's crops, once in each prompt
    real = given["attention_mask"].bool()
    assert torch.allclose(model(**given).logits[real], reference(hf, **given).logits[real], atol=1e-4, rtol=1e-4)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(**given, **options), hf.generate(**given, **options))


def test_what_images_cannot_be_is_refused(pair, inputs):
    model, _ = pair
    given = dict(inputs)
    types = given["token_type_ids"].clone()
    types[1, -1] = 1
    with pytest.raises(ValueError, match=r"token_type_ids mark other tokens than input_ids' image tokens \(511\)"):
        model(**dict(given, token_type_ids=types))
    one_short = given["input_ids"].clone()
    one_short[0, (one_short[0] == IMAGE).nonzero()[0]] = 20
    with pytest.raises(ValueError, match="image tokens and images do not match"):
        model(**marked(dict(given, input_ids=one_short)))
    with pytest.raises(ValueError, match=r"pixel_values are \(16, 16\) pixels; the vision model takes 32 x 32"):
        model(**dict(given, pixel_values=given["pixel_values"][:, :, :16, :16]))
    with pytest.raises(ValueError, match="have 4 channels; the vision model takes 3"):
        model(**dict(given, pixel_values=torch.zeros(3, 4, SIDE, SIDE)))
    with pytest.raises(ValueError, match=r"image_sizes was given; this package's vision model \(Gemma 3's form\)"):
        model(**dict(given, image_sizes=torch.tensor([[SIDE, SIDE]] * 3)))
    with pytest.raises(ValueError, match="token_type_ids marking media, were given without pixel_values"):
        model(given["input_ids"], attention_mask=given["attention_mask"], token_type_ids=given["token_type_ids"])
    text = model(given["input_ids"], attention_mask=given["attention_mask"],
                 token_type_ids=torch.zeros_like(given["input_ids"]))  # a text tokenizer's zeros: text
    assert text.logits.shape[:2] == given["input_ids"].shape


def test_an_image_takes_256_tokens_without_the_checkpoint_config(build, inputs, tmp_path):
    """Without the checkpoint's config.json in the package, an image takes 256 tokens, as in every
    Gemma 3 checkpoint and in onnxruntime-genai's Gemma 3 processor: the fixture's 4 are then refused."""
    package = tmp_path / "package"
    shutil.copytree(build("gemma3_vl").package_dir, package)
    (package / "config.json").unlink()
    model = OrtModelForCausalLM.from_pretrained(package)
    with pytest.raises(ValueError, match=r"the rows hold \[8, 0, 4\] image tokens .* images make \[256, 256, 256\]"):
        model(**inputs)


def test_token_type_ids_marking_images_elsewhere_are_refused(build):
    """token_type_ids marking images on a package of another form (which attends within images as its
    decoder does) are refused by name; zeros (a text tokenizer's) are taken and change nothing."""
    model = OrtModelForCausalLM.from_pretrained(build("mistral3").package_dir)
    ids = torch.tensor([[5, 6] + [511] * 4 + [7]])
    given = dict(pixel_values=torch.zeros(1, 3, 16, 16), image_sizes=torch.tensor([[16, 16]]))
    with pytest.raises(ValueError, match=r"token_type_ids was given; this package's vision model \(Pixtral's form\)"):
        model(ids, **given, token_type_ids=(ids == 511).long())
    assert torch.equal(model(ids, **given, token_type_ids=torch.zeros_like(ids)).logits, model(ids, **given).logits)


# A chat template of Gemma 3's form: an image part is one begin-of-image, which the processor (and the
# server) expands to the image between newlines: begin, its tokens, end.
TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma3_processor(package_dir, folder, **image_options):
    """transformers' own Gemma3Processor over the fixture's tokenizer (Gemma 3's three image tokens at
    the fixture's ids, the template above) and its image processor at the tower's size (with
    `image_options`), 4 tokens an image."""
    from helpers import tokenizer_with

    names = {IMAGE: "<image_soft_token>", BOI: "<start_of_image>", EOI: "<end_of_image>"}
    tokenizer_with(package_dir, names, TEMPLATE).save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens={
        "boi_token": names[BOI], "eoi_token": names[EOI], "image_token": names[IMAGE]})
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}, **image_options)
    return transformers.Gemma3Processor(image_processor, tokenizer, image_seq_length=TOKENS)


def test_image_text_to_text_pipeline_answers_as_transformers(build, tmp_path, caplog):
    """transformers' `pipeline("image-text-to-text")` on the Gemma 3 package with transformers' own
    Gemma3Processor: chat messages with images and a batch of them answer as the pipeline over the
    transformers model, greedy, and the pipeline logs no error for the model's class."""
    fixture = build("gemma3_vl", num_layers=4)
    model, hf = load_pair(fixture)
    processor = gemma3_processor(fixture.package_dir, tmp_path / "tokenizer")
    processor.chat_template = TEMPLATE
    pictures = [Image.fromarray((np.random.RandomState(i).rand(30 + 10 * i, 60 - 10 * i, 3) * 255).astype("uint8"))
                for i in range(3)]
    chats = [[{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": question}]}]
             for picture, question in zip(pictures, ["What is it?", "Say the color.", "Describe it"])]
    with caplog.at_level(logging.WARNING, logger="transformers"):
        ours = transformers.pipeline("image-text-to-text", model=model, processor=processor)
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
    theirs = transformers.pipeline("image-text-to-text", model=hf, processor=processor)
    for asked in (chats[0], chats):
        answers = [ours(text=asked, max_new_tokens=8, do_sample=False),
                   theirs(text=asked, max_new_tokens=8, do_sample=False)]
        assert answers[0] == answers[1] and answers[0]

def test_the_server_takes_images_in_chat_messages(build, tmp_path):
    """`ortmodule serve --processor FOLDER` on the Gemma 3 package: chat messages with image_url parts
    answer as transformers' greedy generate on what Gemma3Processor makes of the template's text and
    the same images (each image attended both ways: its token_type_ids; causally, the answers' log-
    probabilities differ by ~0.1 here), tokens and log-probabilities, beside a text completion; a
    processor giving another number of tokens an image is refused at start."""
    import json

    from helpers import ImageChats, LiveServer

    from ortmodule.serving import create_app

    fixture = build("gemma3_vl", num_layers=4)  # a full layer after a full layer: the blocks reach the answer
    model, hf = load_pair(fixture)
    folder = tmp_path / "processor"
    processor = gemma3_processor(fixture.package_dir, tmp_path / "tokenizer")
    processor.save_pretrained(folder)  # its processor_config.json says image_seq_length 4
    shutil.copy(fixture.hf_dir / "config.json", folder / "config.json")  # the begin- and end-of-image ids
    tokenizer = processor.tokenizer
    settings = json.loads((folder / "processor_config.json").read_text())
    shutil.copytree(folder, tmp_path / "other")
    (tmp_path / "other" / "processor_config.json").write_text(json.dumps(dict(settings, image_seq_length=256)))
    with pytest.raises(ValueError, match="gives an image 256 tokens .* the package's model takes 4"):
        create_app(model, tokenizer, processor=str(tmp_path / "other"))
    server = LiveServer(create_app(model, tokenizer, name="vl", processor=str(folder)))
    try:
        made = ImageChats([(40, 60), (30, 30)]).check(
            server, tokenizer, hf, lambda text, images: processor(text=[text], images=[images], return_tensors="pt"))
        assert [int(one["token_type_ids"].sum()) for one in made] == [TOKENS, 2 * TOKENS]
    finally:
        server.stop()


def test_the_server_lays_out_pan_and_scan_crops_as_the_processor(build, tmp_path):
    """With an image processor that crops with pan-and-scan (`do_pan_and_scan`), each image becomes
    Gemma3Processor's sentence around the image and its crops, each crop an image of its own: the
    answers (tokens, log-probabilities, prompt lengths) equal transformers' greedy generate on what
    Gemma3Processor makes of the same template text and images, the wide picture cropped, the square
    one not."""
    from helpers import ImageChats, LiveServer

    from ortmodule.serving import create_app

    fixture = build("gemma3_vl", num_layers=4)
    model, hf = load_pair(fixture)
    folder = tmp_path / "processor"
    crops = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=3,
                 pan_and_scan_min_ratio_to_activate=1.2)  # the fixture's images are 32 pixels a side
    processor = gemma3_processor(fixture.package_dir, tmp_path / "tokenizer", **crops)
    processor.save_pretrained(folder)  # the server's image processor crops by its own settings
    shutil.copy(fixture.hf_dir / "config.json", folder / "config.json")
    server = LiveServer(create_app(model, processor.tokenizer, name="vl", processor=str(folder)))
    try:  # Gemma3Processor's own defaults turn pan-and-scan off unless its call asks for it
        made = ImageChats([(100, 30), (30, 30)]).check(
            server, processor.tokenizer, hf, lambda text, images: processor(text=[text], images=[images],
                                                                            return_tensors="pt", **crops))
    finally:
        server.stop()
    images_each = [int(one["token_type_ids"].sum()) // TOKENS for one in made]
    assert images_each[0] > 1 and images_each[1] == images_each[0] + 1  # the wide picture with its crops; the square


def test_a_request_asks_for_pan_and_scan_crops_where_the_server_takes_its_options(build, tmp_path):
    """vLLM's `mm_processor_kwargs` on a server started with `--trust-request-mm-kwargs`: the folder's image
    processor does not crop, a request asks it to (`do_pan_and_scan` and its settings), and the answers equal
    transformers' greedy generate on what Gemma3Processor makes with those options; the next request without
    them is not cropped. A server that does not take them, an option of the vision model's own (`patch_size`...
    here `size`), and a value of the wrong type are 400s naming `mm_processor_kwargs`."""
    from helpers import ImageChats, LiveServer

    from ortmodule.serving import create_app

    fixture = build("gemma3_vl", num_layers=4)
    model, hf = load_pair(fixture)
    folder = tmp_path / "processor"
    processor = gemma3_processor(fixture.package_dir, tmp_path / "tokenizer")
    processor.save_pretrained(folder)
    shutil.copy(fixture.hf_dir / "config.json", folder / "config.json")
    crops = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=3,
                 pan_and_scan_min_ratio_to_activate=1.2)
    chats = ImageChats([(100, 30), (30, 30)])
    refusing = LiveServer(create_app(model, processor.tokenizer, name="vl", processor=str(folder)))
    try:
        answer = chats.chat(refusing, chats.chats[0], mm_processor_kwargs=crops)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "mm_processor_kwargs"
        assert "--trust-request-mm-kwargs" in answer.json()["error"]["message"]
        assert chats.chat(refusing, chats.chats[0], mm_processor_kwargs={}).status_code == 200  # none
    finally:
        refusing.stop()
    server = LiveServer(create_app(model, processor.tokenizer, name="vl", processor=str(folder),
                                   trust_request_mm_kwargs=True))
    try:
        made = chats.check(server, processor.tokenizer, hf, lambda text, images: processor(
            text=[text], images=[images], return_tensors="pt", **crops), mm_processor_kwargs=crops)
        plain = chats.check(server, processor.tokenizer, hf, lambda text, images: processor(
            text=[text], images=[images], return_tensors="pt"))
        for options, words in (({"size": {"height": 8, "width": 8}},
                                "mm_processor_kwargs.size: this model's image processor"),
                               ({"pan_and_scan_max_num_crops": "3"}, "pan_and_scan_max_num_crops must be"),
                               ({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 0},
                                "pan_and_scan_min_crop_size must be an integer from 1")):
            answer = chats.chat(server, chats.chats[0], mm_processor_kwargs=options)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "mm_processor_kwargs"
            assert words in answer.json()["error"]["message"], answer.text
    finally:
        server.stop()
    images_each = [int(one["token_type_ids"].sum()) // TOKENS for one in made]
    assert images_each[0] > 1 and images_each[1] == images_each[0] + 1  # the wide picture with its crops; the square
    assert [int(one["token_type_ids"].sum()) // TOKENS for one in plain] == [1, 2]


def test_lm_eval_multimodal_backend_answers_as_hf_multimodal(build, deep, tmp_path):
    """`--model ortmodule-multimodal` on an image task (MMMU's form), batched and left-padded, against
    lm-eval's own `hf-multimodal` on the transformers model with transformers' Gemma3Processor: every
    response equal. hf-multimodal takes `image_string=<start_of_image>` (it writes the config's image
    token, Gemma 3's soft token, for `<image>` otherwise, which Gemma3Processor does not expand);
    ortmodule-multimodal writes the begin-of-image on a Gemma 3 package by itself, and with the
    argument too."""
    from helpers import image_task_responses

    fixture = build("gemma3_vl", num_layers=4)
    processor = gemma3_processor(fixture.package_dir, tmp_path / "tokenizer")
    given = image_task_responses(tmp_path, "ortmodule_gemma3_images_test", (30, 40, 6, "abcde"), processor, deep[1],
                                 fixture.package_dir, image_string="<start_of_image>")
    assert len(given["hf"]) == 5 and any(given["hf"]) and given["ortmodule"] == given["hf"]
    from ortmodule.lm_eval_multimodal import OrtModuleMultimodalLM

    lm = OrtModuleMultimodalLM(fixture.package_dir, processor=processor, batch_size=3, device="cpu")
    assert lm.image_token == "<start_of_image>"


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_the_blocks_graph_is_the_package_graph_where_nothing_is_a_block(build, inputs, monkeypatch, precision):
    """The blocks graph (ONNX's Attention with a given mask, the keys and values kept) against the
    package's own graph (GroupQueryAttention) on the same weights, fp32 and int4 (MatMulNBits, as
    onnxruntime-genai's Gemma 3 packages ship): with every token outside the blocks, its logits, its
    cache and a step after it equal the package graph's on the prompt without token_type_ids."""
    from ortmodule import blocks

    fixture = build("gemma3_vl", precision=precision, num_layers=4, hidden_size=128, intermediate_size=256)
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    causal = {name: value for name, value in inputs.items() if name != "token_type_ids"}
    mask = torch.cat([inputs["attention_mask"], torch.ones(3, 1, dtype=torch.int64)], 1)
    outputs = []
    for given in (causal, inputs):
        out = model(**given, use_cache=True)
        step = model(torch.tensor([[7], [8], [9]]), attention_mask=mask, past_key_values=out.past_key_values)
        outputs.append((out.logits, step.logits))
        monkeypatch.setattr(blocks, "block_ids", lambda marks: torch.full_like(marks, blocks.TEXT))
    real = inputs["attention_mask"].bool()
    (package, package_step), (rewritten, rewritten_step) = outputs
    assert torch.allclose(rewritten[real], package[real], atol=1e-4, rtol=1e-4)
    assert torch.allclose(rewritten_step, package_step, atol=1e-4, rtol=1e-4)


def test_threads_with_images_get_their_own_answers(build):
    """Four threads, each a prompt with its own images, on one model whose blocks graph none has made
    yet: every row of logits equals the same prompt run alone (compared on logits, where the images show)."""
    from concurrent.futures import ThreadPoolExecutor

    model = OrtModelForCausalLM.from_pretrained(build("gemma3_vl", num_layers=4).package_dir)
    calls = []
    for seed in range(4):
        ids = torch.tensor([prompt(1 + seed % 2, 3 + seed, seed)])
        calls.append(marked(dict(input_ids=ids, pixel_values=processed(1 + seed % 2, seed=seed))))
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda call: model(**call).logits, calls * 3))
    alone = [model(**call).logits for call in calls]
    for i, logits in enumerate(together):
        assert torch.allclose(logits, alone[i % len(calls)], atol=1e-5, rtol=1e-5)

"""Videos in prompts (ortmodule/images.py): on the Qwen2.5-VL and Qwen2-VL packages with the
checkpoint's config.json beside genai_config.json, forward, cached steps and generate with videos (and
images beside them) equal transformers' Qwen2.5-VL / Qwen2-VL on the same weights and the same
tensors; what a video cannot be is refused by name."""

import json
import shutil

import pytest
import torch
import transformers
from helpers import load_pair, padded_rows

from ortmodule import NotSupportedError, OrtModelForCausalLM, images

VIDEO, IMAGE, START, END = 510, 511, 509, 508  # the fixture's reserved ids (ortmodule_dev/fixtures.py)
PATCH_VALUES = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch


def with_config(fixture, folder):
    """A copy of the fixture's package with the checkpoint's config.json beside its files."""
    shutil.copytree(fixture.package_dir, folder)
    shutil.copy(fixture.hf_dir / "config.json", folder / "config.json")
    return folder


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_5_vl_builder", "qwen2_vl"])
def pair(build, request, tmp_path_factory):
    fixture = build(request.param)
    _, hf = load_pair(fixture)
    model = OrtModelForCausalLM.from_pretrained(with_config(fixture, tmp_path_factory.mktemp("pkg") / "package"))
    return model, hf


def pixels(grids, seed):
    """Patches as the processor lays them out (random values: the two models take the same tensors)."""
    count = sum(t * h * w for t, h, w in grids)
    return torch.randn(count, PATCH_VALUES, generator=torch.Generator().manual_seed(seed))


def row(parts, seed):
    """Token ids: text, and for each (token, grid) a vision start, its placeholder tokens, a vision end, text."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 500, (4,), generator=generator).tolist()
    for token, (t, h, w) in parts:
        ids += [START] + [token] * (t * h * w // 4) + [END] + torch.randint(10, 500, (3,), generator=generator).tolist()
    return ids


def inputs(left=True):
    """Three rows: a video; an image then two videos; text only. Seconds per temporal patch that
    Qwen2.5-VL's scale (the fixture's tokens_per_second is 4) turns into fractions, which it truncates."""
    videos, image = [(3, 4, 8), (2, 8, 8), (4, 4, 4)], [(1, 8, 4)]
    ids, mask = padded_rows([row([(VIDEO, videos[0])], 1), row([(IMAGE, image[0]), (VIDEO, videos[1]),
                                                          (VIDEO, videos[2])], 2), row([], 3)], left)
    types = torch.where(ids == VIDEO, 2, torch.where(ids == IMAGE, 1, 0))
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels(image, 4), image_grid_thw=torch.tensor(image),
                pixel_values_videos=pixels(videos, 5), video_grid_thw=torch.tensor(videos),
                second_per_grid_ts=torch.tensor([0.3, 1.3, 0.55]), mm_token_type_ids=types)


def reference(hf, **given):
    hf.model.rope_deltas = None  # transformers keeps the last prompt's for its cached steps
    with torch.no_grad():
        return hf(**given)


def assert_greedy_equal(model, hf, given, new):
    """Greedy generate in ortmodule's device loop equals transformers': the tokens, and every step's logits."""
    options = dict(max_new_tokens=new, pad_token_id=2, do_sample=False, return_dict_in_generate=True,
                   output_logits=True)
    hf.model.rope_deltas = None  # transformers keeps the last prompt's for its cached steps
    ours, theirs = model.generate(**given, **options), hf.generate(**given, **options)
    assert torch.equal(ours.sequences, theirs.sequences)
    for mine, expected in zip(ours.logits, theirs.logits, strict=True):
        assert torch.allclose(mine, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("left", [True, False])
def test_logits_with_videos_equal_transformers(pair, left):
    model, hf = pair
    given = inputs(left)
    expected = reference(hf, **given).logits
    real = given["attention_mask"].bool()
    assert torch.allclose(model(**given).logits[real], expected[real], atol=1e-4, rtol=1e-4)
    # Without the processor's token types: found from config.json's video token id.
    found = model(**{k: v for k, v in given.items() if k != "mm_token_type_ids"}).logits
    assert torch.allclose(found[real], expected[real], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("budget", [1, 40])
def test_the_vision_model_runs_frame_by_frame_as_one_run_does(pair, monkeypatch, budget):
    """The vision model attends within each frame, so it runs frames one by one (`budget` 1), or packs
    consecutive small ones up to a patch budget (40: frames of 16 and 32 patches together, the
    64-patch frames alone): the same logits as transformers', whose vision model runs every frame in
    one call with attention split by frame."""
    model, hf = pair
    monkeypatch.setitem(images.PATCHES_PER_RUN, "cpu", budget)
    given = inputs()
    real = given["attention_mask"].bool()
    expected = reference(hf, **given).logits[real]
    assert torch.allclose(model(**given).logits[real], expected, atol=1e-4, rtol=1e-4)


def test_time_is_placed_as_the_model_family_places_it(pair):
    """Qwen2.5-VL's temporal positions follow the seconds given (another second_per_grid_ts, other
    logits, each equal to transformers'); Qwen2-VL's count frames, whatever the seconds."""
    model, hf = pair
    given = inputs()
    slower = dict(given, second_per_grid_ts=torch.tensor([2.0, 0.25, 1.0]))
    real = given["attention_mask"].bool()
    ours, theirs = model(**slower).logits[real], reference(hf, **slower).logits[real]
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    moved = not torch.allclose(ours, model(**given).logits[real], atol=1e-3)
    assert moved == (hf.config.model_type == "qwen2_5_vl")
    listed = dict(slower, second_per_grid_ts=[2.0, 0.25, 1.0])  # a list, as a processor without tensors gives
    assert torch.allclose(model(**listed).logits[real], reference(hf, **listed).logits[real], atol=1e-4, rtol=1e-4)


def test_hidden_states_with_videos_equal_transformers(pair):
    """`output_hidden_states=True` on a prompt with videos (the embeddings path's second session): every
    layer's states at the real positions equal transformers'."""
    model, hf = pair
    given = inputs()
    real = given["attention_mask"].bool()
    ours = model(**given, output_hidden_states=True).hidden_states
    theirs = reference(hf, **given, output_hidden_states=True).hidden_states
    assert len(ours) == len(theirs)
    for mine, expected in zip(ours, theirs):
        assert torch.allclose(mine[real], expected[real], atol=1e-4, rtol=1e-4)


def test_steps_over_a_video_prompt_continue_where_its_text_goes_on(pair):
    """A cached video prompt, then tokens one and two at a time: each step's logits equal the last
    columns of transformers' forward over the whole sequence. After the second row's last video, whose
    time runs past its height and width, the text goes on below the video's last time: the cache keeps
    that offset, not the largest position's (transformers' rope_deltas, which its own cached forward
    would take)."""
    model, hf = pair
    given = inputs()
    cache = model(**given, use_cache=True, logits_to_keep=1).past_key_values
    ids, mask = given["input_ids"], given["attention_mask"]
    for new in ([[31], [32], [33]], [[41, 42], [43, 44], [45, 46]]):
        tokens = torch.tensor(new)
        ids, mask = torch.cat([ids, tokens], 1), torch.cat([mask, torch.ones_like(tokens)], 1)
        step = model(tokens, attention_mask=mask, past_key_values=cache, use_cache=True)
        cache = step.past_key_values
        types = torch.cat([given["mm_token_type_ids"], torch.zeros_like(tokens)], 1)
        given = dict(given, input_ids=ids, attention_mask=mask, mm_token_type_ids=types)
        whole = reference(hf, **given)
        assert torch.allclose(step.logits, whole.logits[:, -tokens.shape[1]:], atol=1e-4, rtol=1e-4)


def test_generate_with_videos_equals_transformers(pair):
    """Greedy decoding in ortmodule's device loop (every step's logits equal transformers' own), and
    beams (each row's videos repeated with its copies, as transformers' Qwen-VL models repeat them)."""
    model, hf = pair
    given = inputs()
    if hf.config.model_type == "qwen2_vl":  # its generate refuses the seconds, which it does not use
        given.pop("second_per_grid_ts")
    assert_greedy_equal(model, hf, given, 8)
    beams = dict(max_new_tokens=8, pad_token_id=2, do_sample=False, num_beams=2, num_return_sequences=2)
    hf.model.rope_deltas = None
    assert torch.equal(model.generate(**given, **beams), hf.generate(**given, **beams))


def test_what_videos_cannot_be_is_refused(pair, build):
    model, _ = pair
    given = inputs()
    with pytest.raises(ValueError, match="video tokens and videos do not match"):
        model(**dict(given, video_grid_thw=torch.tensor([[3, 4, 8], [2, 8, 8], [2, 4, 4]]),
                     pixel_values_videos=given["pixel_values_videos"][:-32]))
    with pytest.raises(ValueError, match="need video_grid_thw"):
        model(**dict(given, video_grid_thw=None))
    with pytest.raises(ValueError, match=r"pixel_values_videos has 287 patches, video_grid_thw .* makes 288"):
        model(**dict(given, pixel_values_videos=given["pixel_values_videos"][:-1]))
    with pytest.raises(ValueError, match=r"second_per_grid_ts must be a tensor \[videos\]"):
        model(**dict(given, second_per_grid_ts=torch.tensor([1.0, 2.0])))
    with pytest.raises(ValueError, match="second_per_grid_ts must be finite and >= 0"):
        model(**dict(given, second_per_grid_ts=torch.tensor([1.0, float("nan"), 1.0])))
    with pytest.raises(ValueError, match="mm_token_type_ids mark other tokens"):
        model(**dict(given, mm_token_type_ids=(given["input_ids"] == IMAGE).long()))
    with pytest.raises(ValueError, match="without pixel_values or pixel_values_videos"):
        model(**dict(given, pixel_values=None, pixel_values_videos=None, image_grid_thw=None))
    cache = model(**given, use_cache=True).past_key_values
    with pytest.raises(NotSupportedError, match="videos in a step over a cache"):
        model(torch.tensor([[5], [5], [5]]), past_key_values=cache, pixel_values_videos=given["pixel_values_videos"],
              video_grid_thw=given["video_grid_thw"])


def test_a_videos_time_past_the_context_is_refused_by_name(pair):
    """Qwen2.5-VL's temporal positions grow with the seconds: a video whose last temporal patch lands on
    the model's last position answers as transformers; a quarter of a second more (one position past
    the rotary table) is a ValueError, not an index error inside ONNX Runtime."""
    model, hf = pair
    if hf.config.model_type != "qwen2_5_vl":
        pytest.skip("Qwen2-VL counts frames: its positions never run ahead of the tokens")
    grid = (2, 4, 4)
    ids = torch.tensor([row([(VIDEO, grid)], 7)])
    start = ids[0].tolist().index(VIDEO)  # the video's first position: the columns before it are text
    scale = hf.config.vision_config.tokens_per_second
    last = model.package.context_length - 1
    seconds = (last - start) / scale  # the second temporal patch at position `last`
    given = dict(input_ids=ids, pixel_values_videos=pixels([grid], 8), video_grid_thw=torch.tensor([grid]),
                 second_per_grid_ts=torch.tensor([seconds]), mm_token_type_ids=torch.where(ids == VIDEO, 2, 0))
    assert torch.allclose(model(**given).logits, reference(hf, **given).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=f"temporal positions reach {last + 2}, past the model's context length"):
        model(**dict(given, second_per_grid_ts=torch.tensor([seconds + 1 / scale])))
    with pytest.raises(ValueError, match="temporal positions reach"):
        model.generate(**dict(given, second_per_grid_ts=torch.tensor([seconds + 1 / scale])), max_new_tokens=2)


def test_videos_need_the_checkpoints_config(build, tmp_path):
    """genai_config.json records no video token and no time scale: without config.json, or with one of a
    family whose videos ortmodule does not place, videos are refused by name; images still run."""
    fixture = build("qwen2_5_vl")
    given = inputs()
    bare = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    with pytest.raises(NotSupportedError, match="videos need the checkpoint's config.json in the package folder"):
        bare(**given)
    images_only = {k: given[k] for k in ("pixel_values", "image_grid_thw")}
    bare(torch.tensor([row([(IMAGE, (1, 8, 4))], 2)]), **images_only)
    other = with_config(fixture, tmp_path / "glm4v")  # a family of timestamped videos ortmodule does not place
    (other / "config.json").write_text(json.dumps(dict(json.loads((other / "config.json").read_text()),
                                                       model_type="glm4v")))
    with pytest.raises(NotSupportedError, match="videos of 'glm4v'"):
        OrtModelForCausalLM.from_pretrained(other)(**given)
    text = OrtModelForCausalLM.from_pretrained(build("llama").package_dir)
    with pytest.raises(NotSupportedError, match="pixel_values: the package has no vision model"):
        text.generate(**given, max_new_tokens=2, num_beams=2)
    wrong = with_config(fixture, tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps(dict(config, image_token_id=IMAGE - 5)))
    with pytest.raises(Exception, match="image_token_id is 506, genai_config.json's model.image_token_id 511"):
        OrtModelForCausalLM.from_pretrained(wrong)(**given)


def frames_row(parts, seed):
    """Qwen3-VL's layout: text, and for each (token, grid) a vision start, the placeholder tokens and a
    vision end per temporal patch of a video (each after a timestamp: two text tokens here), text."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 500, (4,), generator=generator).tolist()
    for token, (t, h, w) in parts:
        for _ in range(t if token == VIDEO else 1):
            stamp = torch.randint(10, 500, (2,), generator=generator).tolist() if token == VIDEO else []
            ids += stamp + [START] + [token] * (h * w // 4 * (1 if token == VIDEO else t)) + [END]
        ids += torch.randint(10, 500, (3,), generator=generator).tolist()
    return ids


def test_qwen3_vl_videos_frame_by_frame_answer_as_transformers_without_deepstack(build, tmp_path):
    """Qwen3-VL places each temporal patch of a video as a one-frame image after a timestamp in the text.
    mobius-onnx's package (no DeepStack: tests/test_images.py) with the checkpoint's config.json equals
    transformers' Qwen3-VL with DeepStack off: logits left and right padded, greedy generate step for
    step, and beams (each row's videos repeated with its copies, counted by their frames)."""
    fixture = build("qwen3_vl")
    model = OrtModelForCausalLM.from_pretrained(with_config(fixture, tmp_path / "package"))
    config = transformers.AutoConfig.from_pretrained(fixture.hf_dir)
    config.vision_config.deepstack_visual_indexes = []
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(fixture.hf_dir, config=config).eval()
    videos, image = [(3, 4, 8), (2, 8, 8)], [(1, 8, 4)]
    rows = [frames_row([(VIDEO, videos[0])], 1), frames_row([(IMAGE, image[0]), (VIDEO, videos[1])], 2),
            frames_row([], 3)]

    def batch(left):
        ids, mask = padded_rows(rows, left)
        return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels(image, 4),
                    image_grid_thw=torch.tensor(image), pixel_values_videos=pixels(videos, 5),
                    video_grid_thw=torch.tensor(videos),
                    mm_token_type_ids=torch.where(ids == VIDEO, 2, torch.where(ids == IMAGE, 1, 0)))

    for left in (True, False):
        given = batch(left)
        real = given["attention_mask"].bool()
        assert torch.allclose(model(**given).logits[real], reference(hf, **given).logits[real], atol=1e-4, rtol=1e-4)
    given = batch(True)
    assert_greedy_equal(model, hf, given, 6)
    # Beams: transformers' own expansion fails with DeepStack off (an IndexError in its repetition of the
    # empty DeepStack features), so each row's beams are checked against the row generated alone.
    beams = dict(max_new_tokens=6, pad_token_id=2, do_sample=False, num_beams=2, num_return_sequences=2)
    together = model.generate(**given, **beams)
    first = 3 * 4 * 8  # the first video's patches
    alone = [dict(pixel_values_videos=given["pixel_values_videos"][:first], video_grid_thw=torch.tensor(videos[:1])),
             dict(pixel_values=given["pixel_values"], image_grid_thw=given["image_grid_thw"],
                  pixel_values_videos=given["pixel_values_videos"][first:], video_grid_thw=torch.tensor(videos[1:])),
             {}]
    for i, media in enumerate(alone):
        tokens = model.generate(torch.tensor([rows[i]]), **media, **beams)
        assert torch.equal(together[2 * i : 2 * i + 2, -6:], tokens[:, -6:])

"""Images and videos for multimodal packages whose vision model takes what transformers' processor
makes for Qwen2.5-VL (and Qwen2-VL): `pixel_values` `[patches, channels x temporal x patch x patch]`
and `image_grid_thw` `[images, 3]` (each image's temporal, height and width patches), giving
`image_features` `[image tokens, hidden]`, one row per merged patch (`spatial_merge_size`^2 patches).
A video is the same vision model's input with more than one temporal patch (`pixel_values_videos`,
`video_grid_thw`).

A prompt with images or videos runs, in `forward(input_ids, attention_mask, pixel_values=..., image_grid_thw=...,
pixel_values_videos=..., video_grid_thw=..., second_per_grid_ts=...)`:
1. the vision model (`model.vision` in genai_config.json), opened at the first call with media, once
   per decoder session (text never opens it), once on the images and once on the videos;
2. the embedding model on the ids and those features: each image or video token takes the next feature
   row of its kind, in row-major order, as transformers' `masked_scatter` does (the embedding graph
   places features at image tokens, so a video's tokens are given to it as image tokens);
3. the decoder from those embeddings (variants.py) at the mRoPE positions transformers'
   `get_rope_index` gives: text tokens count on in all three sections; an image's or video's tokens
   take (t, h, w) on its merged grid, each offset by the position where it starts (a video's t scaled
   by Qwen2.5-VL's `tokens_per_second` x `second_per_grid_ts`; each of Qwen3-VL's frames a run of its
   own, placed as a one-frame image), and the text after it goes on from
   that start plus the larger of the grid's height and width.

Vision models of Gemma 4's and Pixtral's forms (beside a decoder at plain positions) are opened here
too and their prompts run by images_plain.py.

genai_config.json names the image token only: videos need the checkpoint's config.json beside it in
the package (its `video_token_id`, `model_type` and Qwen2.5-VL's `vision_config.tokens_per_second`).

The cache keeps each row's offset between its next mRoPE position and its token count
(`KVCache.position_offset`, transformers' `rope_deltas`: see `rope_positions`), so that later steps, given token ids,
continue at the right positions. Each run of image (video) tokens in the ids is one image (video): its
length must be its grid's tokens (t x h x w / merge^2), else a ValueError, never features taken from
another image.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref

import torch

from . import images_plain, runtime, variants
from .decoder import Decoder, embed_rows
from .package import NotSupportedError, PackageError

TEXT, IMAGE, VIDEO = 0, 1, 2  # transformers' mm_token_type_ids
KIND_NAMES = {IMAGE: "image", VIDEO: "video"}
# Model families whose videos ortmodule places (transformers' get_rope_index of each): Qwen2-VL's
# temporal positions count frames, Qwen2.5-VL's seconds (tokens_per_second x second_per_grid_ts);
# Qwen3-VL's frames stand apart (each temporal patch its own run of tokens after a timestamp in the
# text, placed as a one-frame image).
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


class ImagesUnsupported(Exception):
    """The package cannot take images in the form ortmodule runs (the reason is the message)."""


@dataclasses.dataclass(frozen=True)
class Media:
    """A prompt batch's images and videos, as transformers' processor gives them (forward's keywords)."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    mm_token_type_ids: torch.Tensor | None = None
    image_position_ids: torch.Tensor | None = None  # Gemma 4's form (images_plain.py)
    image_sizes: torch.Tensor | None = None  # Pixtral's form (images_plain.py)
    token_type_ids: torch.Tensor | None = None  # Gemma 3's form: its images attended both ways (images_plain.py)

    @property
    def pixels(self) -> bool:
        """Whether images or videos are given."""
        return self.pixel_values is not None or self.pixel_values_videos is not None


NAMES = tuple(field.name for field in dataclasses.fields(Media))  # forward's and generate's keywords


@dataclasses.dataclass(frozen=True)
class Vision:
    """A package's vision model on the decoder's device, and the names around it."""

    session: runtime.Session
    pixel_values: str
    grid: str
    features: str  # the vision model's output, and the embedding model's input of the same role
    row_width: int | None  # the values in a row of pixel_values (one patch), where the graph fixes it
    pixel_dtype: torch.dtype
    merge: int  # spatial_merge_size: patches per image token along height and along width
    image_token: int
    video_token: int | None  # None: the package cannot take videos (`no_videos` says why)
    tokens_per_second: float | None  # Qwen2.5-VL's temporal scale of a video; None: none (Qwen2-VL's, Qwen3-VL's)
    no_videos: str = ""
    frames_apart: bool = False  # Qwen3-VL's: each temporal patch of a video is a run of its own

    def tokens(self) -> dict[int, int]:
        """The placeholder token of each kind of media: {token id: IMAGE or VIDEO}."""
        found = {self.image_token: IMAGE}
        if self.video_token is not None:
            found[self.video_token] = VIDEO
        return found


_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> (its session, Vision)
_lock = threading.Lock()


def for_decoder(decoder: Decoder) -> Vision | images_plain.PlainVision:
    """The decoder's vision model, opened at the first call with images (again after `to(device)`);
    `ImagesUnsupported` naming why where the package has none or one of another form."""
    with _lock:
        made = _made.get(decoder)
        if made is None or made[0] is not decoder.session:
            made = _made[decoder] = (decoder.session, _open(decoder))
        return made[1]


TEXT_ONLY = "the package has no vision model (genai_config.json's model.vision) and embedding model: it takes text only"


def takes_images(package) -> bool:
    """Whether the package names a vision model and an embedding model (what a prompt's images need)."""
    return isinstance(package.genai_config["model"].get("vision"), dict) and package.embedding is not None


def _open(decoder: Decoder) -> Vision:
    package = decoder.package
    model = package.genai_config["model"]
    config = package.root / "genai_config.json"
    section, embedding = model.get("vision"), package.embedding
    if not takes_images(package):
        raise ImagesUnsupported(TEXT_ONLY)
    names_in, names_out = section.get("inputs", {}), section.get("outputs", {})
    pixels, grid = names_in.get("pixel_values", "pixel_values"), names_in.get("image_grid_thw", "image_grid_thw")
    features = names_out.get("image_features", "image_features")
    token, merge = model.get("image_token_id"), section.get("spatial_merge_size")
    if not isinstance(token, int) or isinstance(token, bool):
        raise PackageError(f"{config}: images need model.image_token_id (an integer)")
    path = package.root / str(section.get("filename", ""))
    if not path.is_file():
        raise PackageError(f"{config}: model.vision.filename is '{section.get('filename')}' but {path} does not exist")
    session = runtime.make_session(path, decoder.device, None, decoder.session_options, decoder.provider_options)
    taken = {value.name: value for value in session.ort_session.get_inputs()}
    made = {value.name for value in session.ort_session.get_outputs()}
    embedding_inputs = {name for name, _, _ in embedding.empty_inputs}
    rank = decoder.spec.position_rank
    form = images_plain.form_of({name: value.shape for name, value in taken.items()}, names_in, rank,
                                str(model.get("type", "")))
    if features in made and features in embedding_inputs and form is not None:
        reason = images_plain.refusal(package, form)
        if reason:
            raise ImagesUnsupported(reason)
        return images_plain.open_vision(package, section, session, form, token, features)
    if set(taken) != {pixels, grid} or features not in made or features not in embedding_inputs or rank != 3:
        raise ImagesUnsupported(f"the package's vision model takes {sorted(taken)} and gives {sorted(made)}, where "
                                f"ortmodule runs Qwen2.5-VL's form ('{pixels}', '{grid}' -> '{features}', an input of "
                                "the embedding model, beside a decoder taking mRoPE positions [3, batch, sequence]), "
                                "Gemma 4's ('pixel_values', 'pixel_position_ids' -> 'image_features') and Pixtral's "
                                "('pixel_values' [images, 3, height, width] -> 'image_features')")
    if not isinstance(merge, int) or merge < 1:
        raise PackageError(f"{config}: Qwen-VL's images need model.vision.spatial_merge_size (a positive integer)")
    width = taken[pixels].shape[-1]
    return Vision(session, pixels, grid, features, width if isinstance(width, int) else None,
                  runtime.input_dtype(session, pixels), merge, token, *_video_form(package, token))


def _video_form(package, image_token: int) -> tuple[int | None, float | None, str, bool]:
    """(video token id, tokens_per_second, why not, frames apart) from the checkpoint's config.json in
    the package: genai_config.json records neither the video token nor how a video's frames are placed."""
    path = package.root / "config.json"
    if not path.is_file():
        return None, None, (f"videos need the checkpoint's config.json in the package folder ({package.root}): its "
                            "video_token_id and vision_config.tokens_per_second, which genai_config.json does not "
                            "record"), False
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PackageError(f"{path}: cannot read it ({e})") from None
    family = config.get("model_type")
    if family not in VIDEO_FAMILIES:
        return None, None, (f"videos of '{family}' ({path}'s model_type) are not placed by ortmodule: it places "
                            f"those of {', '.join(VIDEO_FAMILIES)}"), False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    video, image = (config.get(name, text.get(name)) for name in ("video_token_id", "image_token_id"))
    if image is not None and image != image_token:
        raise PackageError(f"{path}: image_token_id is {image}, genai_config.json's model.image_token_id "
                           f"{image_token}: the two files are of different models")
    if not isinstance(video, int) or video == image_token:
        raise PackageError(f"{path}: videos need video_token_id (an integer other than the image token), got {video!r}")
    if family != "qwen2_5_vl":
        return video, None, "", family == "qwen3_vl"
    scale = (config.get("vision_config") or {}).get("tokens_per_second")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise PackageError(f"{path}: Qwen2.5-VL's videos need vision_config.tokens_per_second (a positive number), "
                           f"got {scale!r}")
    return video, scale, "", False


@dataclasses.dataclass(frozen=True)
class Placed:
    """One image or video in a row: its columns, kind, grid (t, h, w) and temporal scale."""

    start: int
    stop: int
    kind: int
    grid: tuple[int, int, int]
    interval: object = 1  # what a temporal patch's index is multiplied by (transformers' time_interval)


def prompt(decoder: Decoder, ids: torch.Tensor, mask: torch.Tensor | None,
           media: Media) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt batch with images or videos, in the caller's layout (`ids` already checked): its
    embeddings `[B, T, hidden]`, mRoPE positions `[3, B, T]` and each row's position offset `[B]`, on the device."""
    vision = for_decoder(decoder)
    host_ids = ids.to("cpu", torch.int64)
    real = torch.ones_like(host_ids, dtype=torch.bool) if mask is None else mask.to("cpu") != 0
    image_grids = _checked_grids(media.pixel_values, media.image_grid_thw, vision, "pixel_values", "image_grid_thw")
    video_grids = _checked_grids(media.pixel_values_videos, media.video_grid_thw, vision, "pixel_values_videos",
                                 "video_grid_thw")
    runs = _runs(host_ids, real, vision.tokens())
    _check_types(media.mm_token_type_ids, host_ids, real, vision)
    intervals = _intervals(media.second_per_grid_ts, len(video_grids), vision)
    placing = video_grids
    if vision.frames_apart:  # Qwen3-VL: each temporal patch a one-frame grid of its own run
        placing = _frames(video_grids)
        intervals = [1] * len(placing)
    placed = _placed(runs, {IMAGE: image_grids, VIDEO: placing}, vision, intervals)
    positions, offsets = rope_positions(host_ids.shape, real, placed, vision.merge)
    _check_reach(positions, decoder.package.context_length)  # before the vision model runs
    features = {IMAGE: _features(decoder, vision, media.pixel_values, image_grids),
                VIDEO: _features(decoder, vision, media.pixel_values_videos, video_grids)}
    # Padding holding the image token would take a feature row in the embedding graph's count; a
    # video's tokens are the embedding graph's image tokens.
    text = ids.masked_fill(~real.to(ids.device), 0 if vision.image_token else 1)
    if vision.video_token is not None:
        text = text.masked_fill(text == vision.video_token, vision.image_token)
    made = embed_rows(decoder, vision.features, text, _row_features(features, placed, vision.merge))
    embeds = made[variants.embeds_feed(decoder)]  # Qwen-VL's embedding model makes inputs_embeds alone
    device = decoder.device
    return embeds, positions.to(device), offsets.to(device)


def in_blocks(decoder: Decoder, media: Media) -> bool:
    """Whether a prompt's `media` run in blocks.py's graph (Gemma 3's marked images), which takes no
    `variants.Variant`: forward makes none for them."""
    vision = for_decoder(decoder)
    return isinstance(vision, images_plain.PlainVision) and images_plain.in_blocks(vision, media)


def prefill(decoder: Decoder, ids: torch.Tensor, mask: torch.Tensor | None, rows, logit_index: torch.Tensor | None,
            cache, media: Media, runs: variants.Variant | None = None, asked: tuple[bool, bool] = (False, False)):
    """Run a prompt batch with images or videos (`ids` in the caller's layout, `rows` as
    inputs.check_batch made them) through `runs` (a `variants.Variant` taking embeddings; None: the
    plain one), into `cache` where given, which then keeps the rows' position offsets:
    `Variant.prefill`'s logits at `logit_index`, hidden states and attention weights (`asked`, which of
    them, of a prompt `in_blocks`, which takes no `runs`)."""
    vision = for_decoder(decoder)
    if isinstance(vision, images_plain.PlainVision):
        return images_plain.prefill(decoder, vision, ids, mask, rows, logit_index, cache, media, runs, asked)
    for name in ("image_position_ids", "image_sizes", "token_type_ids"):
        if getattr(media, name) is not None:
            raise ValueError(f"{name} was given; this package's vision model (Qwen-VL's form) takes pixel_values with "
                             "image_grid_thw, as transformers' Qwen-VL image processor gives them")
    embeds, positions, offsets = prompt(decoder, ids, mask, media)
    runs = runs if runs is not None else variants.for_decoder(decoder, False, True)
    positions = variants.rolled(rows, positions.permute(1, 2, 0)).permute(2, 0, 1)  # [3, B, T], rolled by row
    out = runs.prefill(rows, logit_index, cache, variants.rolled(rows, embeds), positions, caller_mask=mask)
    if cache is not None:
        cache.position_offset = offsets
    return out


def _check_reach(positions: torch.Tensor, context: int) -> None:
    """Refuse positions past the model's rotary table (`context` rows). Only a video's temporal
    positions (its time scaled by `second_per_grid_ts`) can run ahead of the tokens: the text after any
    image or video goes on at most at its own column (a medium's t x h x w / merge^2 tokens take
    max(h, w) / merge positions), so the length checks cover everything else."""
    reach = int(positions.max()) + 1
    if reach > context:
        raise ValueError(
            f"a video's temporal positions reach {reach}, past the model's context length {context} "
            "(transformers' get_rope_index scales a video's time by second_per_grid_ts and the model's "
            "tokens_per_second): give shorter videos or a smaller second_per_grid_ts")


def _checked_grids(pixel_values, grid_thw, vision: Vision, pixels_name: str, grid_name: str) -> torch.Tensor:
    """The grids `[n, 3]` of the images (videos) given, on the host; `[0, 3]` where none are."""
    if pixel_values is None:
        if grid_thw is not None:
            raise ValueError(f"{grid_name} was given without {pixels_name}")
        return torch.zeros(0, 3, dtype=torch.int64)
    if grid_thw is None:
        raise ValueError(f"{pixels_name} need {grid_name} (each one's temporal, height and width patches, as the "
                         "processor gives them)")
    images_plain.check_pixels(pixel_values, pixels_name, "patches, patch values")
    if vision.row_width is not None and pixel_values.shape[1] != vision.row_width:
        raise ValueError(f"{pixels_name} rows hold {pixel_values.shape[1]} values; the vision model takes "
                         f"{vision.row_width} a patch (channels x temporal x patch x patch)")
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.is_floating_point() or \
            grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
        raise ValueError(f"{grid_name} must be an integer tensor [{'videos' if 'video' in grid_name else 'images'}, "
                         f"3], got {images_plain.given(grid_thw)}")
    grids = grid_thw.to("cpu", torch.int64)
    if bool((grids < 1).any()) or bool((grids[:, 1:] % vision.merge).any()):
        raise ValueError(f"{grid_name} {grids.tolist()}: every entry must be positive, and heights and widths "
                         f"multiples of the spatial merge size {vision.merge}")
    if int(grids.prod(1).sum()) != pixel_values.shape[0]:
        raise ValueError(f"{pixels_name} has {pixel_values.shape[0]} patches, {grid_name} "
                         f"{grids.tolist()} makes {int(grids.prod(1).sum())}")
    return grids


def _intervals(seconds, videos: int, vision: Vision) -> list:
    """Each video's temporal scale, as transformers' get_rope_index takes it: Qwen2.5-VL's
    tokens_per_second x second_per_grid_ts (1 where not given; a tensor's elements or a list's
    numbers, as transformers iterates them), Qwen2-VL's 1."""
    if seconds is not None:
        values = seconds.cpu() if isinstance(seconds, torch.Tensor) else seconds
        if isinstance(values, torch.Tensor) and values.dim() == 1 or isinstance(values, (list, tuple)):
            checked = torch.as_tensor([float(v) for v in values], dtype=torch.float64)
        else:
            checked = None
        if checked is None or len(checked) != videos:
            raise ValueError(f"second_per_grid_ts must be a tensor [videos] (one value per video: {videos}), got "
                             f"{getattr(seconds, 'shape', seconds)}")
        if bool((checked < 0).any()) or not bool(torch.isfinite(checked).all()):
            raise ValueError(f"second_per_grid_ts must be finite and >= 0, got {checked.tolist()}")
    if vision.tokens_per_second is None:
        return [1] * videos
    given = iter(values) if seconds is not None else iter([1] * videos)
    return [vision.tokens_per_second * next(given) for _ in range(videos)]


def _runs(ids: torch.Tensor, real: torch.Tensor, tokens: dict[int, int]) -> list[list[tuple[int, int, int]]]:
    """Per row, the (start, stop, kind) of each run of one media token among its real tokens."""
    runs = []
    for row, keep in zip(ids.tolist(), real.tolist()):
        found, start, current = [], None, None
        for column, (value, kept) in enumerate(zip([*row, -1], [*keep, False])):
            inside = value if kept and value in tokens else None
            if start is not None and inside != current:
                found.append((start, column, tokens[current]))
                start = None
            if inside is not None and start is None:
                start, current = column, inside
        runs.append(found)
    return runs


def _placed(runs: list, grids: dict[int, torch.Tensor], vision: Vision, intervals: list) -> list[list[Placed]]:
    """Each row's images and videos with their grids, in order; a ValueError where the runs of
    placeholder tokens are not exactly the media given."""
    sizes = {kind: grids[kind].tolist() for kind in grids}
    scales = {IMAGE: [1] * len(sizes[IMAGE]), VIDEO: intervals}
    for kind, name in KIND_NAMES.items():
        lengths = [stop - start for row in runs for start, stop, found in row if found == kind]
        tokens = [t * h * w // vision.merge**2 for t, h, w in sizes[kind]]
        if lengths != tokens:
            token = vision.image_token if kind == IMAGE else vision.video_token
            raise ValueError(f"{name} tokens and {name}s do not match: the ids hold runs of {lengths} {name} tokens "
                             f"(id {token}), {name}_grid_thw gives {name}s of {tokens} (t x h x w / "
                             f"{vision.merge}^2); each {name}'s placeholder tokens must be one run of exactly its "
                             "tokens")
    taken = {IMAGE: 0, VIDEO: 0}
    placed = []
    for row in runs:
        mine = []
        for start, stop, kind in row:
            index = taken[kind]
            taken[kind] += 1
            mine.append(Placed(start, stop, kind, tuple(sizes[kind][index]), scales[kind][index]))
        placed.append(mine)
    return placed


def _check_types(types, ids: torch.Tensor, real: torch.Tensor, vision: Vision) -> None:
    """`mm_token_type_ids` (the processor's), where given, must mark the image and video tokens and nothing else."""
    if types is None:
        return
    if not isinstance(types, torch.Tensor) or tuple(types.shape) != tuple(ids.shape):
        raise ValueError(f"mm_token_type_ids must be a tensor of input_ids' shape {tuple(ids.shape)}")
    types = types.to("cpu", torch.int64)
    expected = torch.zeros_like(ids)
    for token, kind in vision.tokens().items():
        expected[ids == token] = kind
    if bool(((types != expected) & real).any()):
        tokens = ", ".join(f"{KIND_NAMES[kind]}s {token}" for token, kind in vision.tokens().items())
        raise ValueError(f"mm_token_type_ids mark other tokens than input_ids' media token ids ({tokens})")


# The most patches one run of the vision model takes, where several frames go together (a frame larger
# than this runs alone). The vision models attend within each frame, but one run over several frames
# computes attention over all their patches and masks it: work that grows with the square of the run's
# patches. So frames run one by one, except that small ones are packed to spare the per-run cost: on a
# 2-vCPU AMD EPYC, the vision stage of four 224 x 224 images (256 patches each) on Qwen2-VL-2B's tower
# took 7.48 s frame by frame against 8.35 s in one run, the same features bit for bit
# (benchmarks/images_split.py); sixteen 16-patch images 2.32 s one by one against 1.75 s in one run
# (benchmarks/vision_runs.py). CUDA's figure is a guess (more launches per run, attention relatively
# cheaper), not yet measured.
PATCHES_PER_RUN = {"cpu": 256, "cuda": 1024}


def _frames(grids: torch.Tensor) -> torch.Tensor:
    """`grids` `[n, 3]` as one-frame grids `[frames, 3]` (a video's t temporal patches each a frame of
    its own, in order: the processor lays a video's patches out frame after frame)."""
    frames = torch.repeat_interleave(grids, grids[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def _runs_of_frames(sizes: list[int], budget: int) -> list[tuple[int, int]]:
    """`[start, stop)` ranges of consecutive frames of `sizes` patches, each run at most `budget`
    patches (one frame alone where it has more)."""
    runs, start, total = [], 0, 0
    for index, size in enumerate(sizes):
        if index > start and total + size > budget:
            runs.append((start, index))
            start, total = index, 0
        total += size
    if sizes:
        runs.append((start, len(sizes)))
    return runs


def _features(decoder: Decoder, vision: Vision, pixel_values: torch.Tensor | None,
              grids: torch.Tensor) -> torch.Tensor | None:
    """The vision model's features `[tokens, hidden]` of the images (or videos) on the device, run
    frame by frame (small frames packed up to `PATCHES_PER_RUN` patches a run) into one tensor."""
    if pixel_values is None:
        return None
    device = decoder.device
    frames = _frames(grids)
    patches = (frames[:, 1] * frames[:, 2]).tolist()
    grids_there = frames.to(device)  # one copy up; each run binds a slice of it
    pixels = pixel_values.to(device, vision.pixel_dtype).contiguous()
    features = torch.empty(sum(patches) // vision.merge**2, decoder.package.hidden_size,
                           dtype=runtime.output_dtype(vision.session, vision.features), device=device)
    first_patch = first_token = 0
    for start, stop in _runs_of_frames(patches, PATCHES_PER_RUN.get(device.type, PATCHES_PER_RUN["cuda"])):
        count = sum(patches[start:stop])
        tokens = count // vision.merge**2
        binding = vision.session.io_binding()
        runtime.bind_input(binding, vision.pixel_values, pixels[first_patch : first_patch + count])
        runtime.bind_input(binding, vision.grid, grids_there[start:stop])
        runtime.bind_output(binding, vision.features, features[first_token : first_token + tokens])
        vision.session.run(binding)
        first_patch, first_token = first_patch + count, first_token + tokens
    return features


def _row_features(features: dict, placed: list[list[Placed]], merge: int) -> list[torch.Tensor | None]:
    """Each row's feature rows in the order of its images and videos (None: a row with neither)."""
    pieces = {kind: iter(features[kind].split([t * h * w // merge**2 for t, h, w in
                                               (p.grid for row in placed for p in row if p.kind == kind)]))
              for kind in features if features[kind] is not None}
    rows = []
    for row in placed:
        taken = [next(pieces[p.kind]) for p in row]
        rows.append(torch.cat(taken) if taken else None)
    return rows


def rope_positions(shape, real: torch.Tensor, placed: list[list[Placed]],
                   merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `get_rope_index`: positions `[3, B, T]` (0 at padding) and each row's offset
    `[B]`: where text after the row goes on, less its real tokens. That is transformers' `rope_deltas`
    (the largest position + 1) except after a video whose time runs past its height and width, where
    it is where the text after it goes on in a forward over the whole sequence and in transformers'
    `generate` (the last position + 1, for a prompt ending in text)."""
    positions = torch.zeros(3, *shape, dtype=torch.int64)
    offsets = torch.zeros(shape[0], dtype=torch.int64)
    for row, media in enumerate(placed):
        columns = real[row].nonzero().flatten().tolist()
        first = columns[0] if columns else 0
        pieces, at, done = [], 0, first
        for item in media:
            pieces.append(torch.arange(item.start - done).expand(3, -1) + at)
            at += item.start - done
            t, h, w = item.grid
            temporal = (torch.arange(t) * item.interval).long()  # as transformers rounds a video's scaled time
            grid = torch.stack(torch.meshgrid(temporal, torch.arange(h // merge), torch.arange(w // merge),
                                              indexing="ij")).reshape(3, -1)
            pieces.append(grid + at)
            at += max(h, w) // merge
            done = item.stop
        pieces.append(torch.arange(first + len(columns) - done).expand(3, -1) + at)
        at += first + len(columns) - done
        positions[:, row, columns] = torch.cat(pieces, 1)
        offsets[row] = at - len(columns)
    return positions, offsets


def expanded(input_ids: torch.Tensor, token: int, times: int, pixel_values: torch.Tensor, grids: torch.Tensor,
             *per_item: torch.Tensor | None, frames_apart: bool = False) -> tuple:
    """`pixel_values` and `grids` of the images (or videos, `token` their placeholder) for the rows of
    `input_ids` each repeated `times` times (generate's `num_return_sequences` and beams), each row's
    following its copies; `per_item` (one value per image or video: `second_per_grid_ts`) likewise.
    `frames_apart`: a video holds a run per temporal patch (Qwen3-VL's)."""
    ids = input_ids.to("cpu", torch.int64)
    per_row = [len(runs) for runs in _runs(ids, torch.ones_like(ids, dtype=torch.bool), {token: IMAGE})]
    if frames_apart:
        per_row = _videos_per_row(per_row, grids[:, 0].tolist())
    patches = grids.prod(1).tolist()
    chunks = [torch.split(pixel_values, patches), grids.split(1)]
    chunks += [None if values is None else values.split(1) for values in per_item]
    out = [[] for _ in chunks]
    at = 0
    for count in per_row:
        for _ in range(times):
            for kept, parts in zip(out, chunks):
                if parts is not None:
                    kept.extend(parts[at : at + count])
        at += count
    if at != len(patches):
        raise ValueError(f"placeholder tokens and media do not match: the ids hold {at} runs of token {token}, "
                         f"the grids {len(patches)} images or videos")
    return tuple(torch.cat(kept) if parts is not None else None for kept, parts in zip(out, chunks))


def _videos_per_row(runs_per_row: list[int], frames: list[int]) -> list[int]:
    """Videos per row from the rows' runs of video tokens, each video taking one run per frame."""
    counts, at = [], 0
    for runs in runs_per_row:
        count = total = 0
        while total < runs and at + count < len(frames):
            total += frames[at + count]
            count += 1
        if total != runs:
            raise ValueError(f"placeholder tokens and videos do not match: a row holds {runs} runs of video tokens, "
                             f"its videos {total} frames")
        counts.append(count)
        at += count
    return counts


def prompt_media(decoder: Decoder, past, embeds, media: Media) -> Media | None:
    """forward's image and video arguments for a prompt with media (the package's vision model
    opened, or a NotSupportedError saying why it cannot take them), None without (a step's grids and
    text-only `mm_token_type_ids` or `token_type_ids`, which transformers' generation loop passes at
    every step and text tokenizers may give, are ignored)."""
    types, kinds = media.mm_token_type_ids, media.token_type_ids
    marked = isinstance(kinds, torch.Tensor) and bool((kinds != 0).any())  # one read of the device for each
    marks = marked or (isinstance(types, torch.Tensor) and bool((types != 0).any()))
    if past is not None:
        if media.pixels or marks:
            raise NotSupportedError("images or videos in a step over a cache: give a prompt's media with the prompt "
                                    "(forward without past_key_values, or generate)")
        return None
    if not media.pixels:
        if any(value is not None for value in (media.image_grid_thw, media.video_grid_thw, media.image_position_ids,
                                               media.image_sizes)) or marks:
            raise ValueError("image_grid_thw, video_grid_thw, image_position_ids, image_sizes, or mm_token_type_ids or "
                             "token_type_ids marking media, were given without pixel_values or pixel_values_videos")
        return None
    if embeds is not None:
        raise ValueError("pixel_values go with input_ids (whose image and video tokens take the features), not "
                         "inputs_embeds")
    name = "pixel_values" if media.pixel_values is not None else "pixel_values_videos"
    try:
        vision = for_decoder(decoder)
    except ImagesUnsupported as reason:
        raise NotSupportedError(f"{name}: {reason}") from None
    marked_videos = isinstance(types, torch.Tensor) and bool((types == VIDEO).any())
    videos = media.pixel_values_videos is not None or marked_videos
    if videos and vision.video_token is None:
        raise NotSupportedError(f"pixel_values_videos: {vision.no_videos}")
    unmarked = isinstance(kinds, torch.Tensor) and not marked
    media = _without_grad(media)
    return dataclasses.replace(media, token_type_ids=None) if unmarked else media  # a text tokenizer's zeros


def _without_grad(media: Media) -> Media:
    """`media` with its pixels detached where they require grad under `torch.no_grad()` (ONNX Runtime
    takes no tensor that requires grad: DLPack's BufferError); with gradients on, a NotSupportedError."""
    grads = {name: value for name in ("pixel_values", "pixel_values_videos")
             if isinstance(value := getattr(media, name), torch.Tensor) and value.requires_grad}
    if grads and torch.is_grad_enabled():
        raise NotSupportedError(f"{', '.join(grads)} require grad (an image being optimized?): an ONNX package runs "
                                f"inference only, its graphs compute no gradients; pass them detached (.detach()), "
                                f"or call it under torch.no_grad()")
    return dataclasses.replace(media, **{name: value.detach() for name, value in grads.items()}) if grads else media

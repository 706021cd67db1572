"""Images for multimodal packages whose decoder takes plain positions (0, 1, ... like text), in three
forms of vision model:

- Gemma 4's: `pixel_values` `[images, patches, values]` and `pixel_position_ids` `[images, patches,
  2]` (each patch's column and row; (-1, -1) pads an image to the batch's patch count), as
  transformers' Gemma 4 image processor makes them (forward's `pixel_values` and
  `image_position_ids`), giving one token per pooled `pooling_kernel_size`^2 patches;
- Pixtral's (Mistral 3): `pixel_values` `[images, 3, height, width]` (padded to the batch's largest)
  and `image_sizes` `[images, 2]` (each image's height and width), giving one token per
  `(patch_size x spatial_merge_size)`^2 pixels (mobius-onnx's exports of both);
- Gemma 3's (onnxruntime-genai's Gemma-3 vision packages, genai_config type `gemma3`): `pixel_values`
  `[images, 3, size, size]` (the processor resizes every image to the tower's size), giving
  `mm_tokens_per_image` tokens an image (the checkpoint's config.json in the package folder, else
  256, the number onnxruntime-genai's Gemma 3 processor writes). transformers attends both ways
  within each image where the processor's `token_type_ids` mark them: such a prompt runs in
  blocks.py's graph.

A prompt with images runs:
1. the vision model, one image a run (mobius-onnx's graphs take one), on its real patches (Gemma 4)
   or its own height and width (Pixtral), as transformers' towers leave the padding out;
2. the embedding model on the ids and those features (decoder.embed_rows), which gives the
   decoder's `inputs_embeds` (and Gemma 4's `per_layer_inputs`): the image tokens take the feature
   rows in order, as transformers' `masked_scatter` does;
3. the decoder from those, at positions 0, 1, ... like text.

transformers' Gemma 4 attends causally over an image where the text config leaves
`use_bidirectional_attention` unset (E2B and E4B), as the exported decoder does; with "vision" (the
26B-A4B and 31B models) it attends both ways within an image on its sliding layers, which the
exported decoder does not, so such a package (known by the checkpoint's config.json in its folder)
takes text only. Gemma 3's prompts with marked images do run both ways within each image, in
blocks.py's rewrite of the decoder's graph.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from . import attentions, blocks, inputs, runtime, variants
from .decoder import Decoder, embed_rows
from .package import NotSupportedError, PackageError

IMAGE = 1  # transformers' mm_token_type_ids of an image token
GEMMA4, PIXTRAL, GEMMA3 = "Gemma 4", "Pixtral", "Gemma 3"
GEMMA3_TOKENS = 256  # an image's tokens in onnxruntime-genai's Gemma 3 processor (and transformers' default)


@dataclasses.dataclass(frozen=True)
class PlainVision:
    """A package's vision model of one of these forms on the decoder's device, and the names around it."""

    session: runtime.Session
    form: str  # GEMMA4, PIXTRAL or GEMMA3
    pixel_values: str
    positions: str | None  # Gemma 4's pixel_position_ids input; None for Pixtral's
    features: str
    width: int | None  # values of one patch (Gemma 4) or channels (Pixtral), where the graph fixes it
    pixel_dtype: torch.dtype
    # Gemma 4: patches pooled into a token along each side; Pixtral: pixels per token along each side;
    # Gemma 3: an image's tokens
    stride: int
    largest: int | None  # Pixtral: the longest side its rotary table reaches; Gemma 3: the side (None: not known)
    image_token: int
    video_token: None = None  # videos are not run for these forms
    frames_apart: bool = False

    @property
    def no_videos(self) -> str:
        return f"videos of {self.form}-form packages are not run by ortmodule (images are)"

    def tokens(self) -> dict[int, int]:
        """The placeholder token of each kind of media: {token id: kind}."""
        return {self.image_token: IMAGE}


def form_of(inputs: dict, names: dict, position_rank: int, kind: str = "") -> str | None:
    """The form of a vision model taking `inputs` ({name: shape}; genai_config's vision names
    `names`) beside a decoder of `position_rank` in a package of genai_config type `kind`: GEMMA4,
    PIXTRAL, GEMMA3 or None (none of them)."""
    pixels = names.get("pixel_values", "pixel_values")
    if position_rank != 2 or pixels not in inputs:
        return None
    if set(inputs) == {pixels, names.get("pixel_position_ids", "pixel_position_ids")}:
        return GEMMA4
    if set(inputs) == {pixels} and len(inputs[pixels]) == 4:
        return GEMMA3 if kind.startswith("gemma3") else PIXTRAL
    return None


def open_vision(package, section: dict, session: runtime.Session, form: str, token: int,
                features: str) -> PlainVision:
    """The package's vision model of `form` (`section`: genai_config's model.vision)."""
    names = section.get("inputs", {})
    pixels = names.get("pixel_values", "pixel_values")
    shape = {value.name: value.shape for value in session.ort_session.get_inputs()}[pixels]
    width = shape[-1] if form == GEMMA4 else shape[1]
    settings = _processor_settings(package, section)
    checkpoint = _checkpoint_config(package) or {}
    config = checkpoint.get("vision_config") or {}
    if form == GEMMA4:
        positions = names.get("pixel_position_ids", "pixel_position_ids")
        stride = _setting(package, "pooling_kernel_size", settings.get("pooling_kernel_size"),
                          config.get("pooling_kernel_size"))
        largest = None
    elif form == GEMMA3:
        positions = None
        stride = _setting(package, "mm_tokens_per_image", checkpoint.get("mm_tokens_per_image"), GEMMA3_TOKENS)
        sides = [side for side in (shape[2], shape[3], config.get("image_size")) if isinstance(side, int) and side > 0]
        largest = sides[0] if sides else None
    else:
        positions = None
        merge = _setting(package, "spatial_merge_size", section.get("spatial_merge_size"),
                         checkpoint.get("spatial_merge_size"))
        stride = merge * _setting(package, "patch_size", settings.get("patch_size"), config.get("patch_size"))
        sides = [value for value in (settings.get("height"), settings.get("width"), config.get("image_size"))
                 if isinstance(value, int) and value > 0]
        largest = max(sides) if sides else None
    return PlainVision(session, form, pixels, positions, features, width if isinstance(width, int) else None,
                       runtime.input_dtype(session, pixels), stride, largest, token)


def _processor_settings(package, section: dict) -> dict:
    """The attributes of the steps of the vision section's processor settings (mobius-onnx's
    image_processor.json or processor_config.json), merged; {} where there are none."""
    name = section.get("config_filename")
    if not isinstance(name, str) or not (package.root / name).is_file():
        return {}
    path = package.root / name
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PackageError(f"{path}: cannot read it ({e})") from None
    merged = {}
    for step in (settings.get("processor") or {}).get("transforms") or []:
        merged.update(((step or {}).get("operation") or {}).get("attrs") or {})
    return merged


def _setting(package, name: str, *found) -> int:
    for value in found:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise PackageError(f"{package.root}: images need the vision model's {name} (in the processor settings the "
                       "genai_config.json vision section names, or the checkpoint's config.json in the folder)")


def _checkpoint_config(package) -> dict | None:
    path = package.root / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PackageError(f"{path}: cannot read it ({e})") from None


def refusal(package, form: str) -> str:
    """Why the package cannot take images in `form` ('' where it can)."""
    text = (_checkpoint_config(package) or {}).get("text_config") or {}
    if form == GEMMA4 and text.get("use_bidirectional_attention") == "vision":
        return ("the checkpoint's config.json sets use_bidirectional_attention='vision': transformers attends both "
                "ways within an image on its sliding layers, which the package's decoder (causal) does not")
    return ""


def in_blocks(vision: PlainVision, media) -> bool:
    """Whether a prompt's images run in blocks.py's graph: Gemma 3's, marked by token_type_ids."""
    marks = media.token_type_ids
    return vision.form == GEMMA3 and marks is not None and bool((marks != 0).any())


def prefill(decoder: Decoder, vision: PlainVision, ids: torch.Tensor, mask: torch.Tensor | None, rows,
            logit_index: torch.Tensor | None, cache, media, runs: variants.Variant | None = None,
            asked: tuple[bool, bool] = (False, False)):
    """Run a prompt batch with images (`ids` in the caller's layout, `rows` as inputs.check_batch
    made them; `media` an images.Media) through `runs` (a `variants.Variant` taking embeddings; None:
    the plain one), into `cache` where given: `Variant.prefill`'s logits at `logit_index`, hidden
    states and attention weights. A prompt `in_blocks` takes no `runs` (its graph is blocks.py's);
    `asked` asks it for hidden states and/or attention weights."""
    for name in ("image_grid_thw", "image_position_ids", "image_sizes", "token_type_ids"):
        if getattr(media, name) is not None and name not in _KEYWORDS[vision.form]:
            raise ValueError(f"{name} was given; this package's vision model ({vision.form}'s form) takes "
                             f"pixel_values with {' and '.join(_KEYWORDS[vision.form])}")
    host_ids = ids.to("cpu", torch.int64)
    real = torch.ones_like(host_ids, dtype=torch.bool) if mask is None else mask.to("cpu") != 0
    runs_of = _gemma4_images(media, vision) if vision.form == GEMMA4 else \
        _pixtral_images(media, vision) if vision.form == PIXTRAL else _gemma3_images(media, vision)
    tokens = [count for count, _ in runs_of]
    per_row = ((host_ids == vision.image_token) & real).sum(1).tolist()
    _check_counts(per_row, tokens, vision)
    _check_types(media.mm_token_type_ids, host_ids, real, vision)
    _check_types(media.token_type_ids, host_ids, real, vision, "token_type_ids")
    features = _features(decoder, vision, runs_of)
    row_features = [piece if count else None for piece, count in zip(features.split(per_row), per_row)]
    text = ids.masked_fill(~real.to(ids.device), 0 if vision.image_token else 1)  # padding takes no feature row
    made = embed_rows(decoder, vision.features, text, row_features)
    embeds = made.pop(variants.embeds_feed(decoder))
    if in_blocks(vision, media):
        return _in_blocks(decoder, rows, variants.rolled(rows, embeds), media.token_type_ids, logit_index, cache,
                          asked, real.to(ids.device))
    runs = runs if runs is not None else variants.for_decoder(decoder, False, True, extra_feeds=True)
    extra = {name: variants.rolled(rows, value) for name, value in made.items()}
    return runs.prefill(rows, logit_index, cache, variants.rolled(rows, embeds), None, extra, caller_mask=mask)


def _in_blocks(decoder: Decoder, rows, embeds: torch.Tensor, marks: torch.Tensor, logit_index, cache,
               asked: tuple[bool, bool], real: torch.Tensor):
    """Gemma 3's prompt with its images marked: each image attended both ways (blocks.py); hidden
    states and attention weights where `asked`, in the caller's layout (`real`: its real tokens), as
    `Variant.prefill`'s."""
    try:
        runner = blocks.for_decoder(decoder, *asked)
    except blocks.BlocksUnsupported as reason:
        raise NotSupportedError(f"token_type_ids marking images (transformers' Gemma 3 attends both ways within "
                                f"each): {reason}") from None
    marked = variants.rolled(rows, marks.to(embeds.device, torch.int64)[..., None])[..., 0]
    logits, states, weights = runner.run(rows, embeds, blocks.block_ids(marked), logit_index, cache)
    batch, width = rows.ids.shape
    caller = inputs.every_position(rows)
    states = tuple((s if caller is None else s.index_select(0, caller)).view(batch, width, -1) for s in states)
    ran = torch.arange(width, device=rows.lengths.device)[None, :] < rows.lengths[:, None]
    weights = tuple(attentions.to_caller(w, ran, real, ran, real) for w in weights)
    return logits, states or None, weights or None


# forward's, beside pixel_values
_KEYWORDS = {GEMMA4: ("image_position_ids",), PIXTRAL: ("image_sizes",), GEMMA3: ("token_type_ids",)}


def given(value) -> str:
    """What a media input is, for an error that names it: a tensor's dtype and shape, else its type."""
    return f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def check_pixels(values, name: str, layout: str) -> None:
    """A ValueError unless `values` is a float tensor of `layout`'s rank (its dimensions, comma-separated)."""
    if not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.dim() != layout.count(",") + 1:
        raise ValueError(f"{name} must be a float tensor [{layout}] (what the model's processor gives), "
                         f"got {given(values)}")


def _gemma4_images(media, vision: PlainVision) -> list[tuple[int, dict]]:
    """Each image's tokens and vision inputs: its real patches (positions other than (-1, -1))."""
    pixel_values, positions = media.pixel_values, media.image_position_ids
    if positions is None:
        raise ValueError("pixel_values need image_position_ids (each patch's column and row, as transformers' Gemma 4 "
                         "image processor gives them)")
    check_pixels(pixel_values, "pixel_values", "images, patches, patch values")
    if vision.width is not None and pixel_values.shape[2] != vision.width:
        raise ValueError(f"pixel_values patches hold {pixel_values.shape[2]} values; the vision model takes "
                         f"{vision.width} a patch")
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or \
            tuple(positions.shape) != (*pixel_values.shape[:2], 2):
        raise ValueError(f"image_position_ids must be an integer tensor [images, patches, 2] matching pixel_values "
                         f"{tuple(pixel_values.shape)}, got {given(positions)}")
    kept = (positions != -1).all(-1)
    counts = kept.sum(1).tolist()
    square = vision.stride**2
    if any(count == 0 or count % square for count in counts):
        raise ValueError(f"image_position_ids give {counts} real patches per image; each image needs a positive "
                         f"multiple of {square} (the vision model pools {vision.stride} x {vision.stride} patches)")
    images = []
    for image, count in enumerate(counts):
        at = kept[image].nonzero().flatten()
        images.append((count // square, {vision.pixel_values: pixel_values[image].index_select(0, at)[None],
                                         vision.positions: positions[image].index_select(0, at)[None]}))
    return images


def _pixtral_images(media, vision: PlainVision) -> list[tuple[int, dict]]:
    """Each image's tokens and vision inputs: its own height and width of the padded pixels."""
    pixel_values, sizes = media.pixel_values, media.image_sizes
    check_pixels(pixel_values, "pixel_values", "images, channels, height, width")
    if vision.width is not None and pixel_values.shape[1] != vision.width:
        raise ValueError(f"pixel_values have {pixel_values.shape[1]} channels; the vision model takes {vision.width}")
    if sizes is None:  # as transformers' Pixtral tower: every image the whole padded size
        sizes = torch.tensor([pixel_values.shape[2:]] * pixel_values.shape[0])
    if not isinstance(sizes, torch.Tensor) or sizes.is_floating_point() or \
            tuple(sizes.shape) != (pixel_values.shape[0], 2):
        raise ValueError(f"image_sizes must be an integer tensor [images, 2] (each image's height and width) for "
                         f"{pixel_values.shape[0]} images, got {given(sizes)}")
    sides = sizes.to("cpu", torch.int64).tolist()
    step, top = vision.stride, vision.largest
    for height, width in sides:
        if not (0 < height <= pixel_values.shape[2] and 0 < width <= pixel_values.shape[3]) or height % step or \
                width % step or (top is not None and max(height, width) > top):
            raise ValueError(f"image_sizes {sides}: each height and width must be a positive multiple of {step} (patch "
                             f"x merge) within pixel_values' {tuple(pixel_values.shape[2:])}"
                             + (f" and at most {top} (the vision model's largest side)" if top else ""))
    return [((height // step) * (width // step),
             {vision.pixel_values: pixel_values[image : image + 1, :, :height, :width]})
            for image, (height, width) in enumerate(sides)]


def _gemma3_images(media, vision: PlainVision) -> list[tuple[int, dict]]:
    """Each image's tokens and vision inputs: the whole image, at the tower's size."""
    pixel_values = media.pixel_values
    check_pixels(pixel_values, "pixel_values", "images, channels, height, width")
    if vision.width is not None and pixel_values.shape[1] != vision.width:
        raise ValueError(f"pixel_values have {pixel_values.shape[1]} channels; the vision model takes {vision.width}")
    side = vision.largest
    if side is not None and tuple(pixel_values.shape[2:]) != (side, side):
        raise ValueError(f"pixel_values are {tuple(pixel_values.shape[2:])} pixels; the vision model takes {side} x "
                         f"{side} (what transformers' Gemma 3 image processor makes)")
    return [(vision.stride, {vision.pixel_values: pixel_values[image : image + 1]})
            for image in range(pixel_values.shape[0])]


def _check_counts(per_row: list[int], tokens: list[int], vision: PlainVision) -> None:
    """The rows' image tokens must be the images' tokens, each image's within one row."""
    ends, total = {0}, 0
    for count in tokens:
        total += count
        ends.add(total)
    at, bounds = 0, []
    for count in per_row:
        at += count
        bounds.append(at)
    if at != total or any(bound not in ends for bound in bounds):
        raise ValueError(f"image tokens and images do not match: the rows hold {per_row} image tokens (id "
                         f"{vision.image_token}), the images make {tokens}; each row's tokens must be its images' in "
                         "order")


def _check_types(types, ids: torch.Tensor, real: torch.Tensor, vision: PlainVision,
                 name: str = "mm_token_type_ids") -> None:
    """`mm_token_type_ids` (or Gemma 3's `token_type_ids`: the processor's), where given, must mark the
    image tokens and nothing else."""
    if types is None:
        return
    if not isinstance(types, torch.Tensor) or tuple(types.shape) != tuple(ids.shape):
        raise ValueError(f"{name} must be a tensor of input_ids' shape {tuple(ids.shape)}")
    expected = (ids == vision.image_token).to(torch.int64) * IMAGE
    if bool(((types.to("cpu", torch.int64) != expected) & real).any()):
        raise ValueError(f"{name} mark other tokens than input_ids' image tokens ({vision.image_token})")


def _features(decoder: Decoder, vision: PlainVision, images: list[tuple[int, dict]]) -> torch.Tensor:
    """The vision model's features `[tokens, hidden]` of the images, one run per image (an output
    `[images, tokens, hidden]` is written as `[1, tokens, hidden]` a run)."""
    device = decoder.device
    features = torch.empty(sum(count for count, _ in images), decoder.package.hidden_size,
                           dtype=runtime.output_dtype(vision.session, vision.features), device=device)
    ranks = {value.name: len(value.shape) for value in vision.session.ort_session.get_outputs()}
    per_image = ranks.get(vision.features) == 3
    at = 0
    for count, feeds in images:
        binding = vision.session.io_binding()
        for name, value in feeds.items():
            dtype = vision.pixel_dtype if value.is_floating_point() else torch.int64
            runtime.bind_input(binding, name, value.to(device, dtype).contiguous())
        piece = features[at : at + count]
        runtime.bind_output(binding, vision.features, piece[None] if per_image else piece)
        vision.session.run(binding)
        at += count
    return features


def expanded(vision: PlainVision, input_ids: torch.Tensor, times: int, pixel_values: torch.Tensor,
             *per_image: torch.Tensor | None) -> tuple:
    """`pixel_values` and the `per_image` tensors (one row per image: image_position_ids or
    image_sizes; None stays None) for the rows of `input_ids` each repeated `times` times (generate's
    `num_return_sequences` and beams), each row's images following its copies."""
    ids = input_ids.to("cpu", torch.int64)
    order, at = [], 0
    for count in _images_per_row(vision, ids, pixel_values, per_image[-1] if vision.form == PIXTRAL else None):
        order += list(range(at, at + count)) * times
        at += count
    index = torch.tensor(order, dtype=torch.int64)
    return tuple(None if value is None else value.index_select(0, index.to(value.device))
                 for value in (pixel_values, *per_image))


def _images_per_row(vision: PlainVision, ids: torch.Tensor, pixel_values: torch.Tensor, sizes) -> list[int]:
    """How many of the images each row holds: Gemma 4's and Gemma 3's, one run of image tokens each;
    Pixtral's (whose image tokens are broken by row-break tokens), counted off by their tokens."""
    inside = ids == vision.image_token
    if vision.form in (GEMMA4, GEMMA3):
        per_row = (inside & ~torch.nn.functional.pad(inside, (1, 0))[:, :-1]).sum(1).tolist()
        if sum(per_row) != pixel_values.shape[0]:
            raise ValueError(f"placeholder tokens and images do not match: the ids hold {sum(per_row)} runs of token "
                             f"{vision.image_token}, pixel_values {pixel_values.shape[0]} images")
        return per_row
    sides = (sizes.tolist() if isinstance(sizes, torch.Tensor) else [list(pixel_values.shape[2:])] * len(pixel_values))
    tokens = iter([(height // vision.stride) * (width // vision.stride) for height, width in sides])
    per_row = []
    for wanted in inside.sum(1).tolist():
        count = total = 0
        while total < wanted:
            total += next(tokens, wanted + 1)
            count += 1
        if total != wanted:
            raise ValueError(f"placeholder tokens and images do not match: a row holds {wanted} image tokens (id "
                             f"{vision.image_token}), which its images' tokens do not add up to")
        per_row.append(count)
    return per_row

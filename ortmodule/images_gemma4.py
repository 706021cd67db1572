"""Images for multimodal packages whose vision model takes Gemma 4's form (mobius-onnx's Gemma 4
export): `pixel_values` `[images, patches, values]` and `pixel_position_ids` `[images, patches, 2]`
(each patch's column and row; (-1, -1) pads an image to the batch's patch count), as transformers'
Gemma 4 image processor makes them (forward's `pixel_values` and `image_position_ids`), giving
`image_features` `[tokens, hidden]`, one row per pooled `pooling_kernel_size`^2 patches.

A prompt with images runs:
1. the vision model, one image a run on its real patches (the padding left out, as transformers'
   tower drops it; mobius-onnx's graph takes one image a run);
2. the embedding model on the ids and those features (decoder.embed_rows), which gives the
   decoder's `inputs_embeds` and `per_layer_inputs`: the image tokens take the feature rows in
   order, as transformers' `masked_scatter` does;
3. the decoder from those, at positions 0, 1, ... like text.

transformers' Gemma 4 attends causally over an image where the text config leaves
`use_bidirectional_attention` unset (E2B and E4B), as the exported decoder does; with "vision" (the
26B-A4B and 31B models) it attends both ways within an image on its sliding layers, which the
exported decoder does not, so such a package (known by the checkpoint's config.json in its folder)
takes text only.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from . import runtime, variants
from .decoder import Decoder, embed_rows
from .package import PackageError

IMAGE = 1  # transformers' mm_token_type_ids of an image token


@dataclasses.dataclass(frozen=True)
class PatchVision:
    """A package's Gemma 4-form vision model on the decoder's device, and the names around it."""

    session: runtime.Session
    pixel_values: str
    positions: str
    features: str
    row_width: int | None  # the values of one patch, where the graph fixes it
    pixel_dtype: torch.dtype
    pooling: int  # patches pooled into one image token along each side
    image_token: int
    video_token: None = None  # videos are not run for this form
    no_videos: str = "videos of Gemma 4-form packages are not run by ortmodule (images are)"
    frames_apart: bool = False

    def tokens(self) -> dict[int, int]:
        """The placeholder token of each kind of media: {token id: kind}."""
        return {self.image_token: IMAGE}


def is_form(inputs: set[str], names: dict, position_rank: int) -> bool:
    """Whether a vision model taking `inputs` (genai_config's vision names `names`) beside a decoder
    of `position_rank` is of this form."""
    wanted = {names.get("pixel_values", "pixel_values"), names.get("pixel_position_ids", "pixel_position_ids")}
    return inputs == wanted and position_rank == 2


def open_vision(package, section: dict, session: runtime.Session, token: int, features: str) -> PatchVision:
    """The package's vision model of this form (`section`: genai_config's model.vision)."""
    names = section.get("inputs", {})
    pixels = names.get("pixel_values", "pixel_values")
    positions = names.get("pixel_position_ids", "pixel_position_ids")
    width = {value.name: value for value in session.ort_session.get_inputs()}[pixels].shape[-1]
    return PatchVision(session, pixels, positions, features, width if isinstance(width, int) else None,
                       runtime.input_dtype(session, pixels), _pooling(package, section), token)


def _pooling(package, section: dict) -> int:
    """The pooling kernel's side: from the vision section's processor settings (mobius-onnx's
    image_processor.json, its Gemma4ImageTransform), else the checkpoint's config.json."""
    found = []
    name = section.get("config_filename")
    if isinstance(name, str) and (package.root / name).is_file():
        path = package.root / name
        try:
            settings = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise PackageError(f"{path}: cannot read it ({e})") from None
        for step in (settings.get("processor") or {}).get("transforms") or []:
            attrs = ((step or {}).get("operation") or {}).get("attrs") or {}
            found.append(attrs.get("pooling_kernel_size"))
    config = _checkpoint_config(package)
    found.append(((config or {}).get("vision_config") or {}).get("pooling_kernel_size"))
    for value in found:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise PackageError(f"{package.root}: Gemma 4's images need the vision model's pooling_kernel_size (in the "
                       f"vision section's config_filename, {name!r}, or the checkpoint's config.json in the folder)")


def _checkpoint_config(package) -> dict | None:
    path = package.root / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PackageError(f"{path}: cannot read it ({e})") from None


def refusal(package) -> str:
    """Why the package cannot take images in this form ('' where it can)."""
    text = ((_checkpoint_config(package) or {}).get("text_config")) or {}
    if text.get("use_bidirectional_attention") == "vision":
        return ("the checkpoint's config.json sets use_bidirectional_attention='vision': transformers attends both "
                "ways within an image on its sliding layers, which the package's decoder (causal) does not")
    return ""


def prefill(decoder: Decoder, vision: PatchVision, ids: torch.Tensor, mask: torch.Tensor | None, rows,
            logit_index: torch.Tensor | None, cache, media, runs: variants.Variant | None = None):
    """Run a prompt batch with images (`ids` in the caller's layout, `rows` as inputs.check_batch
    made them; `media` an images.Media) through `runs` (a `variants.Variant` taking embeddings; None:
    the plain one), into `cache` where given: `Variant.prefill`'s logits at `logit_index` and hidden states."""
    if media.image_grid_thw is not None:
        raise ValueError("image_grid_thw is Qwen-VL's; this package's vision model (Gemma 4's form) takes "
                         "image_position_ids, as transformers' Gemma 4 image processor gives them")
    host_ids = ids.to("cpu", torch.int64)
    real = torch.ones_like(host_ids, dtype=torch.bool) if mask is None else mask.to("cpu") != 0
    images = _real_patches(media.pixel_values, media.image_position_ids, vision)
    tokens = [count // vision.pooling**2 for count in images]
    per_row = ((host_ids == vision.image_token) & real).sum(1).tolist()
    _check_counts(per_row, tokens, vision)
    _check_types(media.mm_token_type_ids, host_ids, real, vision)
    features = _features(decoder, vision, media.pixel_values, media.image_position_ids, images)
    row_features = [piece if count else None for piece, count in zip(features.split(per_row), per_row)]
    text = ids.masked_fill(~real.to(ids.device), 0 if vision.image_token else 1)  # padding takes no feature row
    made = embed_rows(decoder, vision.features, text, row_features)
    embeds = made.pop(variants.embeds_feed(decoder))
    runs = runs if runs is not None else variants.for_decoder(decoder, False, True, extra_feeds=True)
    extra = {name: variants.rolled(rows, value) for name, value in made.items()}
    return runs.prefill(rows, logit_index, cache, variants.rolled(rows, embeds), None, extra)


def _real_patches(pixel_values, positions, vision: PatchVision) -> list[int]:
    """Each image's real patches (positions other than (-1, -1)), checked against the pooling."""
    if positions is None:
        raise ValueError("pixel_values need image_position_ids (each patch's column and row, as transformers' Gemma 4 "
                         "image processor gives them)")
    shape = getattr(pixel_values, "shape", type(pixel_values).__name__)
    if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point() or pixel_values.dim() != 3:
        raise ValueError(f"pixel_values must be a float tensor [images, patches, patch values] (what the model's "
                         f"processor gives), got {shape}")
    if vision.row_width is not None and pixel_values.shape[2] != vision.row_width:
        raise ValueError(f"pixel_values patches hold {pixel_values.shape[2]} values; the vision model takes "
                         f"{vision.row_width} a patch")
    if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or \
            tuple(positions.shape) != (*pixel_values.shape[:2], 2):
        raise ValueError(f"image_position_ids must be an integer tensor [images, patches, 2] matching pixel_values "
                         f"{tuple(pixel_values.shape)}, got {getattr(positions, 'shape', type(positions).__name__)}")
    kept = (positions != -1).all(-1).to("cpu")
    counts = kept.sum(1).tolist()
    square = vision.pooling**2
    if any(count == 0 or count % square for count in counts):
        raise ValueError(f"image_position_ids give {counts} real patches per image; each image needs a positive "
                         f"multiple of {square} (the vision model pools {vision.pooling} x {vision.pooling} patches)")
    return counts


def _check_counts(per_row: list[int], tokens: list[int], vision: PatchVision) -> None:
    """The rows' image tokens must be the images' tokens, each image's within one row."""
    ends, total = set(), 0
    for count in tokens:
        total += count
        ends.add(total)
    at, bounds = 0, []
    for count in per_row:
        at += count
        bounds.append(at)
    if at != total or any(bound not in ends | {0} for bound in bounds):
        raise ValueError(f"image tokens and images do not match: the rows hold {per_row} image tokens (id "
                         f"{vision.image_token}), the images make {tokens} (real patches / {vision.pooling}^2); "
                         "each row's tokens must be its images' in order")


def _check_types(types, ids: torch.Tensor, real: torch.Tensor, vision: PatchVision) -> None:
    """`mm_token_type_ids` (the processor's), where given, must mark the image tokens and nothing else."""
    if types is None:
        return
    if not isinstance(types, torch.Tensor) or tuple(types.shape) != tuple(ids.shape):
        raise ValueError(f"mm_token_type_ids must be a tensor of input_ids' shape {tuple(ids.shape)}")
    expected = (ids == vision.image_token).to(torch.int64) * IMAGE
    if bool(((types.to("cpu", torch.int64) != expected) & real).any()):
        raise ValueError(f"mm_token_type_ids mark other tokens than input_ids' image tokens ({vision.image_token})")


def _features(decoder: Decoder, vision: PatchVision, pixel_values: torch.Tensor, positions: torch.Tensor,
              counts: list[int]) -> torch.Tensor:
    """The vision model's features `[tokens, hidden]` of the images, one run per image on its real patches."""
    device = decoder.device
    square = vision.pooling**2
    features = torch.empty(sum(counts) // square, decoder.package.hidden_size,
                           dtype=runtime.output_dtype(vision.session, vision.features), device=device)
    kept = (positions != -1).all(-1)
    at = 0
    for image, count in enumerate(counts):
        rows = kept[image].nonzero().flatten()
        pixels = pixel_values[image].index_select(0, rows.to(pixel_values.device))
        places = positions[image].index_select(0, rows.to(positions.device))
        binding = vision.session.io_binding()
        runtime.bind_input(binding, vision.pixel_values, pixels[None].to(device, vision.pixel_dtype).contiguous())
        runtime.bind_input(binding, vision.positions, places[None].to(device, torch.int64).contiguous())
        runtime.bind_output(binding, vision.features, features[at : at + count // square])
        vision.session.run(binding)
        at += count // square
    return features


def expanded(input_ids: torch.Tensor, token: int, times: int, pixel_values: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pixel_values` and `image_position_ids` (one row per image) for the rows of `input_ids` each
    repeated `times` times (generate's `num_return_sequences` and beams), each row's following its copies."""
    ids = input_ids.to("cpu", torch.int64)
    inside = ids == token
    starts = inside & ~torch.nn.functional.pad(inside, (1, 0))[:, :-1]  # each image is one run of its tokens
    per_row = starts.sum(1).tolist()
    if sum(per_row) != pixel_values.shape[0]:
        raise ValueError(f"placeholder tokens and images do not match: the ids hold {sum(per_row)} runs of token "
                         f"{token}, pixel_values {pixel_values.shape[0]} images")
    order = []
    at = 0
    for count in per_row:
        order += list(range(at, at + count)) * times
        at += count
    index = torch.tensor(order, dtype=torch.int64)
    return (pixel_values.index_select(0, index.to(pixel_values.device)),
            positions.index_select(0, index.to(positions.device)))

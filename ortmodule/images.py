"""Images for multimodal packages whose vision model takes what transformers' image processor makes
for Qwen2.5-VL: `pixel_values` `[patches, channels x temporal x patch x patch]` and `image_grid_thw`
`[images, 3]` (each image's temporal, height and width patches), giving `image_features`
`[image tokens, hidden]`, one row per merged patch (`spatial_merge_size`^2 patches).

A prompt with images runs, in `forward(input_ids, attention_mask, pixel_values=..., image_grid_thw=...)`:
1. the vision model (`model.vision` in genai_config.json), opened at the first call with images, once
   per decoder session (text never opens it);
2. the embedding model on the ids and those features: each image token takes the next feature row,
   in row-major order, as transformers' `masked_scatter` does;
3. the decoder from those embeddings (variants.py) at the mRoPE positions transformers'
   `get_rope_index` gives: text tokens count on in all three sections; an image's tokens take
   (t, h, w) on its merged grid, each offset by the position where the image starts, and the text
   after it goes on from that start plus the larger of the grid's height and width.

The cache keeps each row's offset between its next mRoPE position and its token count
(transformers' `rope_deltas`: `KVCache.position_offset`), so that later steps, given token ids,
continue at the right positions. Each run of image tokens in the ids is one image: its length must
be its grid's tokens (t x h x w / merge^2), else a ValueError, never features taken from another
image.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import torch

from . import runtime, variants
from .decoder import Decoder
from .package import PackageError

TEXT, IMAGE, VIDEO = 0, 1, 2  # transformers' mm_token_type_ids


class ImagesUnsupported(Exception):
    """The package cannot take images in the form ortmodule runs (the reason is the message)."""


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


_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> (its session, Vision)
_lock = threading.Lock()


def for_decoder(decoder: Decoder) -> Vision:
    """The decoder's vision model, opened at the first call with images (again after `to(device)`);
    `ImagesUnsupported` naming why where the package has none or one of another form."""
    with _lock:
        made = _made.get(decoder)
        if made is None or made[0] is not decoder.session:
            made = _made[decoder] = (decoder.session, _open(decoder))
        return made[1]


def _open(decoder: Decoder) -> Vision:
    package = decoder.package
    model = package.genai_config["model"]
    config = package.root / "genai_config.json"
    section, embedding = model.get("vision"), package.embedding
    if not isinstance(section, dict) or embedding is None:
        raise ImagesUnsupported("the package has no vision model (genai_config.json's model.vision) and embedding "
                                "model: it takes text only")
    if decoder.spec.position_rank != 3:
        raise ImagesUnsupported(f"the package's vision model is of a form ortmodule does not run yet "
                                f"('{package.model_type}': only Qwen2.5-VL's, whose decoder takes mRoPE positions "
                                "[3, batch, sequence])")
    names_in, names_out = section.get("inputs", {}), section.get("outputs", {})
    pixels, grid = names_in.get("pixel_values", "pixel_values"), names_in.get("image_grid_thw", "image_grid_thw")
    features = names_out.get("image_features", "image_features")
    token, merge = model.get("image_token_id"), section.get("spatial_merge_size")
    if not isinstance(token, int) or not isinstance(merge, int) or merge < 1:
        raise PackageError(f"{config}: images need model.image_token_id and model.vision.spatial_merge_size (integers)")
    path = package.root / str(section.get("filename", ""))
    if not path.is_file():
        raise PackageError(f"{config}: model.vision.filename is '{section.get('filename')}' but {path} does not exist")
    session = runtime.make_session(path, decoder.device, None, decoder.session_options, decoder.provider_options)
    taken = {value.name: value for value in session.ort_session.get_inputs()}
    made = {value.name for value in session.ort_session.get_outputs()}
    embedding_inputs = {name for name, _, _ in embedding.empty_inputs}
    if set(taken) != {pixels, grid} or features not in made or features not in embedding_inputs:
        raise ImagesUnsupported(f"the package's vision model takes {sorted(taken)} and gives {sorted(made)}, where "
                                f"ortmodule runs Qwen2.5-VL's form ('{pixels}', '{grid}' -> '{features}', an input of "
                                "the embedding model)")
    width = taken[pixels].shape[-1]
    return Vision(session, pixels, grid, features, width if isinstance(width, int) else None,
                  runtime.input_dtype(session, pixels), merge, token)


def prompt(decoder: Decoder, ids: torch.Tensor, mask: torch.Tensor | None, pixel_values, image_grid_thw,
           mm_token_type_ids=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt batch with images, in the caller's layout (`ids` already checked): its embeddings
    `[B, T, hidden]`, mRoPE positions `[3, B, T]` and each row's position offset `[B]`, on the device."""
    vision = for_decoder(decoder)
    host_ids = ids.to("cpu", torch.int64)
    real = torch.ones_like(host_ids, dtype=torch.bool) if mask is None else mask.to("cpu") != 0
    grids = _checked_grids(pixel_values, image_grid_thw, vision)
    images = _image_runs(host_ids, real, vision.image_token)
    _check_types(mm_token_type_ids, host_ids, real, vision.image_token)
    tokens = (grids.prod(1) // vision.merge**2).tolist()
    lengths = [stop - start for runs in images for start, stop in runs]
    if lengths != tokens:
        raise ValueError(f"image tokens and images do not match: the ids hold runs of {lengths} image tokens "
                         f"(id {vision.image_token}), image_grid_thw gives images of {tokens} (t x h x w / "
                         f"{vision.merge}^2); each image's placeholder tokens must be one run of exactly its tokens")
    features = _features(decoder, vision, pixel_values, grids, sum(tokens))
    # Padding holding the image token would take a feature row in the embedding graph's count.
    text = ids.masked_fill(~real.to(ids.device), 0 if vision.image_token else 1)
    embeds = _embed(decoder, vision, text, features, [sum(stop - start for start, stop in runs) for runs in images])
    positions, offsets = rope_positions(host_ids.shape, real, images, grids, vision.merge)
    device = decoder.device
    return embeds, positions.to(device), offsets.to(device)


def prefill(decoder: Decoder, ids: torch.Tensor, mask: torch.Tensor | None, rows, logit_index: torch.Tensor | None,
            cache, media: tuple, runs: variants.Variant | None = None):
    """Run a prompt batch with images (`ids` in the caller's layout, `rows` as inputs.check_batch
    made them) through `runs` (a `variants.Variant` taking embeddings; None: the plain one), into
    `cache` where given, which then keeps the rows' position offsets: `Variant.prefill`'s logits at
    `logit_index` and hidden states."""
    embeds, positions, offsets = prompt(decoder, ids, mask, *media)
    runs = runs if runs is not None else variants.for_decoder(decoder, False, True)
    positions = variants.rolled(rows, positions.permute(1, 2, 0)).permute(2, 0, 1)  # [3, B, T], rolled by row
    out = runs.prefill(rows, logit_index, cache, variants.rolled(rows, embeds), positions)
    if cache is not None:
        cache.position_offset = offsets
    return out


def _checked_grids(pixel_values, image_grid_thw, vision: Vision) -> torch.Tensor:
    if image_grid_thw is None:
        raise ValueError("pixel_values need image_grid_thw (each image's temporal, height and width patches, "
                         "as the processor gives them)")
    if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point() or pixel_values.dim() != 2:
        raise ValueError("pixel_values must be a float tensor [patches, patch values] (what the model's processor "
                         f"gives), got {getattr(pixel_values, 'shape', type(pixel_values).__name__)}")
    if vision.row_width is not None and pixel_values.shape[1] != vision.row_width:
        raise ValueError(f"pixel_values rows hold {pixel_values.shape[1]} values; the vision model takes "
                         f"{vision.row_width} a patch (channels x temporal x patch x patch)")
    if not isinstance(image_grid_thw, torch.Tensor) or image_grid_thw.is_floating_point() or \
            image_grid_thw.dim() != 2 or image_grid_thw.shape[1] != 3 or image_grid_thw.shape[0] == 0:
        raise ValueError("image_grid_thw must be an integer tensor [images, 3], got "
                         f"{getattr(image_grid_thw, 'shape', type(image_grid_thw).__name__)}")
    grids = image_grid_thw.to("cpu", torch.int64)
    if bool((grids < 1).any()) or bool((grids[:, 1:] % vision.merge).any()):
        raise ValueError(f"image_grid_thw {grids.tolist()}: every entry must be positive, and heights and widths "
                         f"multiples of the spatial merge size {vision.merge}")
    if int(grids.prod(1).sum()) != pixel_values.shape[0]:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, image_grid_thw "
                         f"{grids.tolist()} makes {int(grids.prod(1).sum())}")
    return grids


def _image_runs(ids: torch.Tensor, real: torch.Tensor, token: int) -> list[list[tuple[int, int]]]:
    """Per row, the (start, stop) columns of each run of image tokens among its real tokens."""
    runs = []
    for row, keep in zip(ids.tolist(), real.tolist()):
        found, start = [], None
        for column, (value, kept) in enumerate(zip([*row, -1], [*keep, False])):
            inside = kept and value == token
            if inside and start is None:
                start = column
            elif not inside and start is not None:
                found.append((start, column))
                start = None
        runs.append(found)
    return runs


def _check_types(types, ids: torch.Tensor, real: torch.Tensor, token: int) -> None:
    """`mm_token_type_ids` (the processor's), where given, must mark the image tokens and nothing else."""
    if types is None:
        return
    if not isinstance(types, torch.Tensor) or tuple(types.shape) != tuple(ids.shape):
        raise ValueError(f"mm_token_type_ids must be a tensor of input_ids' shape {tuple(ids.shape)}")
    types = types.to("cpu", torch.int64)
    if bool(((types == VIDEO) & real).any()):
        raise NotImplementedError("videos (mm_token_type_ids 2) are not supported: images only")
    if bool((((types == IMAGE) != (ids == token)) & real).any()):
        raise ValueError(f"mm_token_type_ids mark other tokens as images than the image token id {token} in input_ids")


def _features(decoder: Decoder, vision: Vision, pixel_values: torch.Tensor, grids: torch.Tensor,
              tokens: int) -> torch.Tensor:
    """The vision model's features `[image tokens, hidden]` on the device."""
    binding = vision.session.io_binding()
    device = decoder.device
    runtime.bind_input(binding, vision.pixel_values, pixel_values.to(device, vision.pixel_dtype).contiguous())
    runtime.bind_input(binding, vision.grid, grids.to(device))
    features = torch.empty(tokens, decoder.package.hidden_size, dtype=runtime.output_dtype(vision.session,
                                                                                          vision.features),
                           device=device)
    runtime.bind_output(binding, vision.features, features)
    vision.session.run(binding)
    return features


def _embed(decoder: Decoder, vision: Vision, ids: torch.Tensor, features: torch.Tensor,
           counts: list[int]) -> torch.Tensor:
    """The embedding model's `inputs_embeds` `[B, T, hidden]` for `ids` with the images' features
    (`counts`: each row's image tokens). One run per row: an exporter's graph may number the image
    tokens within each row (mobius-onnx's counts them along the row), so each row gets its own features."""
    embedding, session, device = decoder.package.embedding, decoder.embedding_session, decoder.device
    output = embedding.feeds[0][0]
    embeds = torch.empty(*ids.shape, decoder.package.hidden_size, dtype=runtime.output_dtype(session, output),
                         device=device)
    ids = ids.to(device, decoder.id_dtype)
    for row, row_features in enumerate(features.split(counts)):
        binding = session.io_binding()
        runtime.bind_input(binding, embedding.input_ids, ids[row : row + 1].contiguous())
        runtime.bind_input(binding, vision.features, row_features.contiguous())
        for name, empty in decoder.no_media:
            if name != vision.features:
                runtime.bind_input(binding, name, empty)
        runtime.bind_output(binding, output, embeds[row : row + 1])
        session.run(binding)
    return embeds


def rope_positions(shape, real: torch.Tensor, images: list, grids: torch.Tensor,
                   merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `get_rope_index` for images: positions `[3, B, T]` (0 at padding) and each
    row's offset `[B]` (its largest position + 1 - its real tokens)."""
    positions = torch.zeros(3, *shape, dtype=torch.int64)
    offsets = torch.zeros(shape[0], dtype=torch.int64)
    sizes = iter(grids.tolist())
    for row, runs in enumerate(images):
        columns = real[row].nonzero().flatten().tolist()
        first = columns[0] if columns else 0
        pieces, at, done = [], 0, first
        for start, stop in runs:
            pieces.append(torch.arange(start - done).expand(3, -1) + at)
            at += start - done
            t, h, w = next(sizes)
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h // merge), torch.arange(w // merge),
                                              indexing="ij")).reshape(3, -1)
            pieces.append(grid + at)
            at += max(h, w) // merge
            done = stop
        pieces.append(torch.arange(first + len(columns) - done).expand(3, -1) + at)
        row_positions = torch.cat(pieces, 1)
        positions[:, row, columns] = row_positions
        offsets[row] = int(row_positions.max()) + 1 - len(columns)
    return positions, offsets


def expanded(input_ids: torch.Tensor, pixel_values: torch.Tensor, grids: torch.Tensor, token: int,
             times: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pixel_values` and `image_grid_thw` for the rows of `input_ids` each repeated `times` times
    (generate's `num_return_sequences` and beams): each row's images follow its copies."""
    ids = input_ids.to("cpu", torch.int64)
    per_row = [len(runs) for runs in _image_runs(ids, torch.ones_like(ids, dtype=torch.bool), token)]
    patches = grids.prod(1).tolist()
    pixel_chunks, grid_chunks = torch.split(pixel_values, patches), grids.split(1)
    pixels, new_grids, at = [], [], 0
    for count in per_row:
        for _ in range(times):
            pixels.extend(pixel_chunks[at : at + count])
            new_grids.extend(grid_chunks[at : at + count])
        at += count
    if at != len(patches):
        raise ValueError(f"image tokens and images do not match: the ids hold {at} runs of image tokens, "
                         f"image_grid_thw {len(patches)} images")
    return torch.cat(pixels), torch.cat(new_grids)

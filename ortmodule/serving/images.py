"""Images in chat requests: `image_url` content parts, for a package that takes images (ortmodule's
images.py: Qwen2.5-VL's form; images_plain.py: Gemma 4's and Pixtral's) served with `--processor`,
the checkpoint folder whose image processor the model was trained with (a GenAI package carries
onnxruntime-genai's image settings, not transformers').

The server fetches nothing: an image is a `data:` URL, base64, of a format Pillow reads, of at most
`MAX_PIXELS` pixels. The chat template renders an image part (`{"type": "image"}`) as the model's
placeholder, which then becomes the image's tokens as transformers' processor expands it: Qwen2.5-VL's
image pad (between a vision start and end the template writes) its t x h x w / merge^2 image tokens;
Gemma 4's image token a begin-of-image, its soft tokens and an end-of-image (the ids of the
checkpoint's config.json); Pixtral's (Mistral 3's) image token a row of image tokens per row of the
image's merged grid, each row ended by a row break and the last by an image end (the tokens the
folder's processor_config.json names, as transformers' PixtralProcessor expands them). An image
request is one prompt with its images: the engine prefills it alone, whole (generations.py).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import images, images_plain
from .errors import ServingError

QWEN = "Qwen-VL"  # images.py's form (images_plain's forms are named there)
MAX_PIXELS = 50_000_000  # an image larger than this (width x height) is refused before it is decoded
# vLLM's `mm_processor_kwargs` a request may send, per form: the image processor's options of how many tokens an
# image becomes (Qwen's pixel bounds, Gemma 3's pan-and-scan crops), which the model takes whatever they are. Its
# other options (patch and merge sizes, normalization, the output's layout) would feed the vision model what it
# was not made for, and are refused by name.
# Each option's type and range: (type, lowest, highest); pixels within what the server decodes, crops a few.
REQUEST_OPTIONS = {QWEN: {"min_pixels": (int, 1, MAX_PIXELS), "max_pixels": (int, 1, MAX_PIXELS)},
                   images_plain.GEMMA3: {"do_pan_and_scan": (bool, None, None),
                                         "pan_and_scan_min_crop_size": (int, 1, 100_000),
                                         "pan_and_scan_max_num_crops": (int, 1, 64),
                                         "pan_and_scan_min_ratio_to_activate": (float, 0.0, 1000.0)}}


@dataclass(frozen=True)
class Media:
    """A prompt's images as the model takes them: forward's keywords (`pixel_values` with
    `image_grid_thw`, `image_position_ids` or `image_sizes`)."""

    inputs: dict[str, torch.Tensor]


def check_processor(package, processor: str) -> None:
    """What `ChatImages` needs that the package's files and the processor's folder tell, checked before the
    model loads (and its runs are timed: minutes for a big one): a ValueError naming the problem."""
    if not images.takes_images(package):
        raise ValueError(f"--processor: {images.TEXT_ONLY}")
    from transformers import AutoImageProcessor

    try:
        AutoImageProcessor.from_pretrained(processor, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--processor {processor}: no image processor there ({e})") from None


class ChatImages:
    """The image processor and the placeholder of a served package that takes images."""

    def __init__(self, model, processor: str, tokenizer, defaults: dict | None = None):
        try:
            from PIL import Image  # noqa: F401  (checked here, used at each request)
            from transformers import AutoImageProcessor
        except ImportError as e:
            raise ValueError(f"--processor: images need Pillow ({e}); pip install pillow") from None
        try:
            vision = images.for_decoder(model.decoder)
        except images.ImagesUnsupported as e:
            raise ValueError(f"--processor: {e}") from None
        try:
            self.processor = AutoImageProcessor.from_pretrained(processor, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"--processor {processor}: no image processor there ({e})") from None
        plain = isinstance(vision, images_plain.PlainVision)  # Gemma 4's, Pixtral's or Gemma 3's form, else Qwen-VL's
        self.form = vision.form if plain else QWEN
        self.token = vision.image_token
        # Qwen's merge; Pixtral's pixels a token; Gemma 3's tokens an image
        self.stride = vision.merge if self.form == QWEN else vision.stride
        self.ends = _image_ends(processor, "boi_token_id", "eoi_token_id") if self.form == images_plain.GEMMA4 else \
            _image_ends(processor, "boi_token_index", "eoi_token_index") if self.form == images_plain.GEMMA3 else \
            _pixtral_marks(processor, tokenizer) if self.form == images_plain.PIXTRAL else None
        self.placeholder = self.ends[0] if self.form == images_plain.GEMMA3 else self.token  # what the template writes
        if self.form == images_plain.PIXTRAL:
            _check_longest_edge(self.processor, vision.largest, processor)
        if self.form == images_plain.GEMMA3:
            _check_gemma3(self.stride, processor)
            self.newlines = tokenizer.encode("\n\n", add_special_tokens=False)
            self.tokenizer, self.cropped = tokenizer, {}  # pan-and-scan's runs, per number of crops
        self.defaults = self._checked_defaults(defaults or {})

    def _checked_defaults(self, defaults: dict) -> dict:
        """The server's `mm_processor_kwargs` (vLLM's `--mm-processor-kwargs`), checked as a request's are and run
        once on a small picture, so that a wrong one stops the server at start: a ValueError naming it."""
        if not defaults:
            return {}
        from PIL import Image

        try:
            self.check_options(defaults)
            self._processed([Image.new("RGB", (32, 32))], True, **defaults)
        except ServingError as e:
            raise ValueError(f"--mm-processor-kwargs: {e}") from None
        return defaults

    def decode(self, url: str, where: str):
        """The RGB image of a `data:` URL; a ServingError naming `where` for anything else."""
        from PIL import Image, UnidentifiedImageError

        header, comma, data = url.partition(",")
        if not header.startswith("data:") or not comma:
            raise ServingError(f"{where}: only data: URLs (data:image/png;base64,...) are taken; this server fetches "
                               "nothing", where)
        if not header.endswith(";base64"):
            raise ServingError(f"{where}: the data URL must be base64 (data:image/...;base64,...)", where)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ServingError(f"{where}: not base64 ({e})", where) from None
        try:
            picture = Image.open(io.BytesIO(raw))
            if picture.width * picture.height > MAX_PIXELS:
                raise ServingError(f"{where}: an image of {picture.width} x {picture.height} pixels; this server takes "
                                   f"at most {MAX_PIXELS:,}", where)
            return picture.convert("RGB")
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
            raise ServingError(f"{where}: not an image Pillow reads ({e})", where) from None

    def check_options(self, options: dict) -> None:
        """A request's `mm_processor_kwargs`: options of the image processor this form lets a request set
        (`REQUEST_OPTIONS`), else a ServingError naming the option."""
        taken = REQUEST_OPTIONS.get(self.form, {})
        for name, value in options.items():
            if name not in taken:
                what = f"takes {', '.join(taken)}" if taken else "takes none"
                raise ServingError(f"mm_processor_kwargs.{name}: this model's image processor ({self.form}'s form) "
                                   f"{what} here (what makes an image more or fewer tokens); its other options are "
                                   "the --processor folder's", "mm_processor_kwargs")
            kind, low, high = taken[name]
            if not _option_fits(value, kind, low, high):
                wanted = "true or false" if kind is bool else \
                    f"{'an integer' if kind is int else 'a number'} from {low} to {high:,}"
                raise ServingError(f"mm_processor_kwargs.{name} must be {wanted}, got {value!r}", "mm_processor_kwargs")

    def _processed(self, pictures: list, asked: bool = False, **options) -> dict:
        """The image processor's tensors for `pictures`; what it cannot take (the images, or a request's options:
        transformers checks their types) is a 400 naming it."""
        from huggingface_hub.errors import StrictDataclassError

        try:
            return self.processor(images=pictures, return_tensors="pt", **options)
        except (ValueError, TypeError, ArithmeticError, StrictDataclassError) as e:
            sizes = ", ".join(f"{picture.width} x {picture.height}" for picture in pictures)
            raise ServingError(f"the image processor could not take the images ({sizes} pixels)"
                               f"{' with the options ' + str(options) if options else ''}: {e}",
                               "mm_processor_kwargs" if asked else "messages") from None

    def expand(self, ids: list[int], pictures: list, options: dict | None = None) -> tuple[list[int], Media]:
        """`ids` with each image placeholder expanded to its image's tokens, and the images (`options`: a request's
        image processor options, checked by `check_options`)."""
        asked, options = bool(options), {**self.defaults, **(options or {})}  # the request's own, over the server's
        placed = ids.count(self.placeholder)
        if placed != len(pictures):
            raise ServingError(f"the chat template placed {placed} image placeholders (token {self.placeholder}) for "
                               f"{len(pictures)} images; this model's template must render each image part as one",
                               "messages")
        if self.form == QWEN:  # each image pad its image's tokens
            made = self._processed(pictures, asked, **options)
            counts = (made["image_grid_thw"].prod(1) // self.stride**2).tolist()
            runs = iter([[self.token] * count for count in counts])
            inputs = {name: made[name] for name in ("pixel_values", "image_grid_thw")}
        elif self.form == images_plain.GEMMA4:  # each image token its soft tokens between a begin and an end
            made = self._processed(pictures, asked, **options)
            begin, end = self.ends
            runs = iter([[begin, *[self.token] * count, end] for count in made["num_soft_tokens_per_image"].tolist()])
            inputs = {name: made[name] for name in ("pixel_values", "image_position_ids")}
        elif self.form == images_plain.GEMMA3:  # each begin-of-image its image between newlines, as Gemma3Processor
            made = self._processed(pictures, asked, **options)
            crops = made["num_crops"].tolist() if "num_crops" in made else [0] * len(pictures)
            runs = iter([self._gemma3_run(count) for count in crops])
            inputs = {"pixel_values": made["pixel_values"]}  # each image, then its crops
        else:  # Pixtral's: resized to multiples of patch x merge as PixtralProcessor asks; rows of tokens
            made = self._processed(pictures, patch_size=self.stride)
            runs = iter([_pixtral_run(self.token, *self.ends, height // self.stride, width // self.stride)
                         for height, width in made["image_sizes"].tolist()])
            inputs = {name: made[name] for name in ("pixel_values", "image_sizes")}
        expanded: list[int] = []
        for token in ids:
            expanded += next(runs) if token == self.placeholder else [token]
        if self.form == images_plain.GEMMA3:  # its images attended both ways, as transformers with the processor's
            inputs["token_type_ids"] = (torch.tensor([expanded]) == self.token).long()
        return expanded, Media(inputs)


    def _gemma3_run(self, crops: int) -> list[int]:
        """The tokens of one Gemma 3 image as Gemma3Processor writes them: between newlines, its
        begin, its tokens and its end; with pan-and-scan crops (`do_pan_and_scan`), the processor's
        sentence around the image and its crops, each written as the image is, tokenized as the
        processor's text is."""
        begin, end = self.ends
        if not crops:
            return [*self.newlines, begin, *[self.token] * self.stride, end, *self.newlines]
        if crops not in self.cropped:
            marks = self.tokenizer.convert_ids_to_tokens([begin, self.token, end])
            image = f"\n\n{marks[0]}{marks[1] * self.stride}{marks[2]}\n\n"
            text = (f"Here is the original image {image} and here are some crops to help you see better "
                    + " ".join([image] * crops))
            self.cropped[crops] = self.tokenizer.encode(text, add_special_tokens=False)
        return self.cropped[crops]


def _option_fits(value, kind: type, low, high) -> bool:
    """Whether a request's image processor option is of its `kind` (bool, int, or a float where an int too
    passes) and from `low` to `high`."""
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        return False
    return low <= value <= high


def _image_ends(processor: str, begin: str, end: str) -> tuple[int, int]:
    """Gemma's begin- and end-of-image ids, from the checkpoint's config.json in `processor` (its
    fields `begin` and `end`: Gemma 4's boi_token_id, Gemma 3's boi_token_index, ...)."""
    path = Path(processor) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--processor {processor}: Gemma's images need the checkpoint's config.json there (its "
                         f"{begin} and {end}): {e}") from None
    ends = config.get(begin), config.get(end)
    if not all(isinstance(value, int) and not isinstance(value, bool) for value in ends):
        raise ValueError(f"--processor {processor}: {path} needs {begin} and {end} (integers), got {ends}")
    return ends


def _check_gemma3(tokens: int, processor: str) -> None:
    """Gemma 3's processor settings the server follows: as many tokens an image as the package takes."""
    path, settings = _processor_config(processor)
    length = settings.get("image_seq_length", tokens)
    if length != tokens:
        raise ValueError(f"--processor {processor}: {path} gives an image {length} tokens (image_seq_length); the "
                         f"package's model takes {tokens}")


def _processor_config(processor: str) -> tuple[Path, dict]:
    """The `processor` folder's processor_config.json and its settings ({} where there is none)."""
    path = Path(processor) / "processor_config.json"
    try:
        return path, json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise ValueError(f"--processor {processor}: cannot read {path} ({e})") from None


def _pixtral_marks(processor: str, tokenizer) -> tuple[int, int]:
    """Pixtral's row-break and image-end ids: the tokens processor_config.json in `processor` names
    (PixtralProcessor's defaults [IMG_BREAK] and [IMG_END] where it names none), in the served tokenizer."""
    _, config = _processor_config(processor)
    names = config.get("image_break_token", "[IMG_BREAK]"), config.get("image_end_token", "[IMG_END]")
    vocabulary = tokenizer.get_vocab()
    missing = [name for name in names if not isinstance(name, str) or name not in vocabulary]
    if missing:
        raise ValueError(f"--processor {processor}: Pixtral's images need the row-break and image-end tokens {names} "
                         f"in the tokenizer; it has no {missing} (processor_config.json's image_break_token and "
                         "image_end_token name them)")
    return vocabulary[names[0]], vocabulary[names[1]]


def _pixtral_run(token: int, row_break: int, end: int, rows: int, columns: int) -> list[int]:
    """An image's tokens as PixtralProcessor writes them: each row of its grid, then a row break; the
    last break an image end."""
    run = ([token] * columns + [row_break]) * rows
    run[-1] = end
    return run


def _check_longest_edge(image_processor, largest: int | None, processor: str) -> None:
    """Pixtral's image processor must not resize past the vision model's largest side (every larger
    image would fail in the model)."""
    size = getattr(image_processor, "size", None) or {}
    edge = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
    if largest is not None and isinstance(edge, int) and edge > largest:
        raise ValueError(f"--processor {processor}: its image processor resizes images up to {edge} pixels a side "
                         f"(size.longest_edge), past the vision model's largest side, {largest}: set longest_edge to "
                         f"at most {largest}")

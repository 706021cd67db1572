"""`ortmodule export --images`: a Gemma 3 checkpoint's images in its package.

onnxruntime-genai's model builder writes Gemma 3's text decoder only. With `--images` the decoder
is written to take `inputs_embeds` (the builder's `exclude_embeds=true`), and this module adds what
onnxruntime-genai's Gemma 3 vision packages hold beside it, in their genai_config form (type
`gemma3`, `vision` and `embedding` sections):

- `vision.onnx`: `pixel_values` `[images, 3, size, size]` to `image_features` `[images, tokens,
  hidden]`: transformers' own `get_image_features` (the SigLIP tower, the pooling and the projection
  into the text model's width), exported by `torch.onnx`;
- `embedding.onnx`: `input_ids` and `image_features` to `inputs_embeds`: the text model's scaled
  token embeddings, each image token's replaced by the next row of the features, in order along the
  batch (transformers' `masked_scatter`);
- the checkpoint's `config.json` (its `mm_tokens_per_image` and image token ids, which ortmodule reads).

ortmodule runs such a package with images (images_plain.py, blocks.py). The vision and embedding
models compute in float32: for packages whose decoder takes float32 embeddings (fp32, int4 and
int8 exports for the CPU).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch

ARCHITECTURES = ("Gemma3ForConditionalGeneration",)


class _Vision(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model.get_image_features(pixel_values).pooler_output


class _Embedding(torch.nn.Module):
    def __init__(self, embed, image_token: int):
        super().__init__()
        self.embed, self.image_token = embed, image_token

    def forward(self, input_ids, image_features):
        tokens = self.embed(input_ids)  # Gemma's scaled embeddings
        rows = image_features.reshape(-1, tokens.shape[-1])
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])  # never empty: text indexes row 0
        is_image = input_ids == self.image_token
        at = (torch.cumsum(is_image.reshape(-1).long(), 0) - 1).clamp(min=0)
        picked = rows.index_select(0, at).reshape(tokens.shape)
        return torch.where(is_image[..., None], picked.to(tokens.dtype), tokens)


def add_images(checkpoint: Path, package: Path) -> None:
    """Write the vision and embedding models of the Gemma 3 `checkpoint` into `package` (whose
    decoder the builder wrote with exclude_embeds=true), with their genai_config sections and the
    checkpoint's config.json."""
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    size = model.config.vision_config.image_size
    hidden = model.config.get_text_config().hidden_size
    token = model.config.image_token_id
    with torch.no_grad(), warnings.catch_warnings():
        # The tracer's notes on shapes it fixes (image size, head size: the tower's are fixed by design),
        # and torch's notice that this exporter (TorchScript's, which needs only onnx) is the older one:
        # the newer one needs onnxscript, which ortmodule does not depend on.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(_Vision(model.model), (torch.zeros(1, 3, size, size),), str(package / "vision.onnx"),
                          dynamo=False, input_names=["pixel_values"], output_names=["image_features"],
                          opset_version=17,
                          dynamic_axes={"pixel_values": {0: "images"}, "image_features": {0: "images"}})
        example = (torch.tensor([[1, token, token, 2]]), torch.zeros(1, 2, hidden))
        torch.onnx.export(_Embedding(model.get_input_embeddings(), token), example, str(package / "embedding.onnx"),
                          dynamo=False, input_names=["input_ids", "image_features"], output_names=["inputs_embeds"],
                          opset_version=17,
                          dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                                        "image_features": {0: "images", 1: "image_tokens"},
                                        "inputs_embeds": {0: "batch", 1: "sequence"}})
    path = package / "genai_config.json"
    genai = json.loads(path.read_text())
    genai["model"]["vision"] = {"filename": "vision.onnx", "inputs": {"pixel_values": "pixel_values"},
                                "outputs": {"image_features": "image_features"}}
    genai["model"]["embedding"] = {"filename": "embedding.onnx",
                                   "inputs": {"input_ids": "input_ids", "image_features": "image_features"},
                                   "outputs": {"inputs_embeds": "inputs_embeds"}}
    genai["model"]["image_token_id"] = token
    path.write_text(json.dumps(genai, indent=4))
    shutil.copy(checkpoint / "config.json", package / "config.json")

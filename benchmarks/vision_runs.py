"""How many patches one run of the vision model should take (ortmodule/images.py, PATCHES_PER_RUN):
a batch of image prompts scored with the vision model run frame by frame, packed up to 1,024 and
4,096 patches a run, and every image in one run, beside transformers' vision tower alone, on
Qwen2.5-VL's real vision tower (32 blocks, window attention, 670 M weights) under a small text model
(synthetic: the text model's size does not matter here), random weights, exported by mobius-onnx
(fp32 on a CPU, bf16 on CUDA).

    python benchmarks/vision_runs.py [--device cuda] [--images 8] [--side 448] [--rounds 3]
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ortmodule_dev
from conftest import median_seconds  # noqa: E402

from ortmodule import OrtModelForCausalLM, images  # noqa: E402
from ortmodule_dev import fixtures  # noqa: E402

TOWER = (("depth", 32), ("hidden_size", 1280), ("intermediate_size", 3420), ("num_heads", 16), ("patch_size", 14),
         ("window_size", 112), ("fullatt_block_indexes", [7, 15, 23, 31]))


def spec(device: str) -> fixtures.FixtureSpec:
    return fixtures.FixtureSpec("qwen2_5_vl", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=512, context_length=32768, initializer_range=0.02,
                                mrope_section=(8, 12, 12), vision=TOWER,
                                precision="bf16" if device == "cuda" else "fp32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = args.device
    fixture = fixtures.build(spec(device))
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir, device=device)
    hf_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf = transformers.AutoModelForImageTextToText.from_pretrained(fixture.hf_dir, dtype=hf_dtype).to(device).eval()
    pictures = [Image.fromarray((np.random.RandomState(i).rand(args.side, args.side, 3) * 255).astype("uint8"))
                for i in range(args.images)]
    made = transformers.Qwen2VLImageProcessorPil()(images=pictures, return_tensors="pt")
    config = hf.config
    per_image = int(made["image_grid_thw"][0].prod())
    row = [5, 6, config.vision_start_token_id, *[config.image_token_id] * (per_image // 4), config.vision_end_token_id]
    ids = torch.tensor([row] * args.images, device=device)
    given = dict(input_ids=ids, pixel_values=made["pixel_values"].to(device),
                 image_grid_thw=made["image_grid_thw"].to(device))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{name}: {args.images} images of {args.side} x {args.side} ({per_image} patches each), "
          f"{fixture.spec.precision} package")
    default = images.PATCHES_PER_RUN.get(device, images.PATCHES_PER_RUN["cuda"])
    with torch.no_grad():
        theirs = median_seconds(lambda: hf.model.get_image_features(given["pixel_values"], given["image_grid_thw"]),
                       args.rounds, device)
    print(f"  transformers' vision tower alone: {theirs * 1e3:.1f} ms")
    first = None
    for budget in (1, 1024, 4096, per_image * args.images):
        images.PATCHES_PER_RUN[device] = budget
        out = model(**given, cont_len=1).logits
        first = out if first is None else first
        seconds = median_seconds(lambda: model(**given, cont_len=1), args.rounds, device)
        label = {1: "frame by frame", per_image * args.images: "every image in one run"}.get(
            budget, f"up to {budget} patches a run")
        print(f"  ortmodule, {label}: {seconds * 1e3:.1f} ms (largest logit difference from frame by frame "
              f"{(out.float() - first.float()).abs().max():.3g})")
    images.PATCHES_PER_RUN[device] = default
    print(f"  (ortmodule's default on {device}: {default} patches a run)")


if __name__ == "__main__":
    main()

"""Where an image prompt's time goes: benchmarks/test_images.py's `score` batch (CPU size) timed whole,
and the same batch with every image token replaced by a text token and no image (the text model
alone, the same lengths), for ortmodule and transformers on the same weights; the difference is the
vision model's (and, for ortmodule, the embedding model's) share. ortmodule twice: its vision model
run frame by frame as it runs by default (ortmodule/images.py, PATCHES_PER_RUN), and every image in
one run (as before 2026-11-28), whose features are checked equal.

    python benchmarks/images_split.py [--rounds 3] [--profile-vision]

`--profile-vision` also runs the package's vision graph alone under ONNX Runtime's profiler, all of
the batch's images in one run as the graph takes them, and prints each operator's share of its time.
"""

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import SIZES, median_seconds  # noqa: E402
from test_images import prompts, weight_counts  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402

from ortmodule import OrtModelForCausalLM, images  # noqa: E402
from ortmodule_dev import fixtures  # noqa: E402


def profile_vision(fixture, given: dict) -> None:
    """Each operator type's share of the vision graph's kernel time, one profiled run after a warm-up."""
    import tempfile

    import onnxruntime as ort

    genai = json.loads((fixture.package_dir / "genai_config.json").read_text())["model"]["vision"]
    options = ort.SessionOptions()
    options.enable_profiling = True
    folder = tempfile.mkdtemp(prefix="vision-profile-")
    options.profile_file_prefix = str(Path(folder) / "vision")
    session = ort.InferenceSession(str(fixture.package_dir / genai["filename"]), options,
                                   providers=["CPUExecutionProvider"])
    feeds = {genai["inputs"]["pixel_values"]: given["pixel_values"].numpy(),
             genai["inputs"]["image_grid_thw"]: given["image_grid_thw"].numpy()}
    session.run(None, feeds)
    start = time.perf_counter()
    session.run(None, feeds)
    print(f"vision graph, all images in one run: {time.perf_counter() - start:.2f} s (profiled, two runs below)")
    kernels = collections.Counter()
    profile = Path(session.end_profiling())
    events = json.loads(profile.read_text())
    profile.unlink()
    Path(folder).rmdir()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            kernels[event["args"]["op_name"]] += event["dur"]
    total = sum(kernels.values())
    for op, micros in kernels.most_common(6):
        print(f"  {op}: {micros / 2e6:.2f} s a run, {100 * micros / total:.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile-vision", action="store_true")
    args = parser.parse_args()
    options = SIZES["cpu"]["images"]
    fixture = fixtures.build(options["spec"])
    model = OrtModelForCausalLM.from_pretrained(fixture.package_dir)
    hf = AutoModelForImageTextToText.from_pretrained(fixture.hf_dir, dtype=torch.float32).eval()
    given = prompts(fixture, hf.config, options, "cpu")
    text = given["input_ids"].masked_fill(given["input_ids"] == hf.config.image_token_id, 100)
    keep = options["keep"]
    vision, body, _ = weight_counts(fixture)
    patches = int(given["image_grid_thw"].prod(1).sum())
    tokens = given["input_ids"].numel()
    print(f"{tuple(given['input_ids'].shape)} ids, {patches} patches; matmul work: vision "
          f"{2 * vision * patches / 1e12:.2f} TFLOP, text {2 * body * tokens / 1e12:.2f} TFLOP")

    if args.profile_vision:
        profile_vision(fixture, given)

    def theirs(**inputs):
        hf.model.rope_deltas = None
        with torch.no_grad():
            return hf(**inputs, logits_to_keep=keep)

    def one_run():
        budget = images.PATCHES_PER_RUN["cpu"]
        images.PATCHES_PER_RUN["cpu"] = patches  # every image in one run of the vision model
        try:
            return model(**given, cont_len=keep)
        finally:
            images.PATCHES_PER_RUN["cpu"] = budget

    ours = model(**given, cont_len=keep).logits
    print(f"frame by frame against one run: largest logit difference {(ours - one_run().logits).abs().max():.3g}")
    runs = {
        "ortmodule, frame by frame (default)": (lambda: model(**given, cont_len=keep),
                                                lambda: model(text, cont_len=keep)),
        "ortmodule, one vision run": (one_run, None),
        "transformers": (lambda: theirs(**given), lambda: theirs(input_ids=text)),
    }
    text_s = None
    for name, (whole, text_only) in runs.items():
        all_s = median_seconds(whole, args.rounds)
        text_s = median_seconds(text_only, args.rounds) if text_only else text_s
        print(f"{name}: with images {all_s:.2f} s, text model alone {text_s:.2f} s, images' share "
              f"{all_s - text_s:.2f} s ({100 * (all_s - text_s) / all_s:.0f}%)")


if __name__ == "__main__":
    main()

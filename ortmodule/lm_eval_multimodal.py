"""`lm_eval --model ortmodule-multimodal`: lm-eval's `hf-multimodal` backend (HFMultimodalLM) over a
GenAI package that takes images (images.py: Qwen2.5-VL's form; images_plain.py: Gemma 4's), for
tasks with images (MMMU's form: `doc_to_image`, `generate_until`, which is what lm-eval's class
runs with images; its text-only requests go to `--model ortmodule`'s backend over the same model,
where `hf-multimodal` runs them through HFLM's paths).

lm-eval's class is used as it is, with the model loaded from the package and the processor from
where the checkpoint's is (`processor=`: a GenAI package carries onnxruntime-genai's image
settings, not transformers' processor), but for two things `--model ortmodule` does as well: image
prompts generate in batches by their work (tokens, images' included, not `batch_size` rows; `auto`
fills the token budget), and each row stops at its own stop sequences.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.hf_vlms import DEFAULT_IMAGE_PLACEHOLDER, HFMultimodalLM
from lm_eval.models.utils import flatten_image_list, replace_placeholders, resize_image

from . import hub
from .hf import build_config
from .lm_eval import (
    OrtModuleLM,
    check_dtype,
    generate_in_batches,
    generate_with_stops,
    new_tokens,
    positive_int,
    refuse_hflm_options,
    refuse_unknown_args,
)
from .modeling import OrtModelForCausalLM
from .package import read_package
from .scoring import default_token_budget

# hf-multimodal's own model args (images' placement and size); the rest are HFLM's, which the text-only
# requests' backend takes too.
_IMAGE_ARGS = frozenset({"image_token_id", "image_string", "interleave", "max_images", "convert_img_format",
                         "min_pixels", "max_pixels", "image_width", "image_height", "image_max_side"})


@register_model("ortmodule-multimodal")
class OrtModuleMultimodalLM(HFMultimodalLM):
    """`lm_eval --model ortmodule-multimodal --model_args pretrained=PACKAGE_DIR,processor=CHECKPOINT`
    (the Hugging Face folder or hub name whose processor made the package's images: its
    `preprocessor_config.json` and tokenizer; where the package folder holds them, `processor` may be
    left out). Also `device` (cpu, cuda, cuda:N), `provider_options` (a dict, from Python),
    `token_budget` (tokens of a generation batch under `batch_size=auto`, images' included), and
    lm-eval's own `hf-multimodal` arguments (`max_images`, `min_pixels`, `max_pixels`, `batch_size`,
    `auto` included, ...; on a Gemma 3 package `image_string` defaults to the processor's begin-of-image, which
    Gemma3Processor expands). `pretrained` may be an `OrtModelForCausalLM` (then `processor` is needed)."""

    AUTO_MODEL_CLASS = transformers.AutoModelForImageTextToText

    def __init__(self, pretrained, processor=None, device: str | None = None,
                 provider_options: dict | None = None, token_budget: int | str | None = None, **kwargs):
        if kwargs.get("tokenizer") is not None:
            raise ValueError("ortmodule-multimodal takes the checkpoint's processor as processor=, not tokenizer=")
        pretrained = str(pretrained) if isinstance(pretrained, Path) else pretrained
        if processor is None:
            if not isinstance(pretrained, str) or not (Path(pretrained) / "preprocessor_config.json").is_file():
                raise ValueError(
                    "ortmodule-multimodal needs processor=<the Hugging Face checkpoint folder or hub name the package "
                    "was exported from>: a GenAI package holds onnxruntime-genai's image settings, not the "
                    "processor lm-eval runs (preprocessor_config.json)")
            processor = pretrained
        self._processor_source = str(processor) if isinstance(processor, Path) else processor
        self._provider_options = provider_options
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device is None else device
        refuse_hflm_options(kwargs)
        self._token_budget = positive_int(token_budget, "token_budget")
        # Text-only requests go to `--model ortmodule`'s backend over the same model (`_text_backend`).
        self._text_args = {name: value for name, value in kwargs.items() if name not in _IMAGE_ARGS}
        self._text_args["token_budget"] = token_budget
        self._text_lm: OrtModuleLM | None = None
        # hf-multimodal refuses `auto`; here it sizes the image prompts' generation batches by the token budget.
        self._auto = str(kwargs.get("batch_size", 1)).startswith("auto")
        if self._auto:
            kwargs["batch_size"] = 1
        if isinstance(pretrained, OrtModelForCausalLM):
            self._package, self._config = pretrained.package, pretrained.config
            self._set_image_token(self._config)
        super().__init__(pretrained, device=device, **kwargs)
        kind = str(self._package.genai_config["model"].get("type", ""))
        if not kwargs.get("image_string") and kind.startswith("gemma3"):
            # Gemma 3's processor expands its begin-of-image, not the image token lm-eval would write for
            # `<image>` (hf-multimodal needs image_string=<start_of_image> for it)
            self.image_token = getattr(self.tokenizer, "boi_token", None) or "<start_of_image>"

    def _set_image_token(self, config) -> None:
        token = self._package.genai_config["model"].get("image_token_id")
        if not isinstance(token, int):
            raise ValueError(f"{self._package.root}: genai_config.json names no model.image_token_id: the package "
                             "takes no images (lm-eval's --model ortmodule runs its text)")
        config.image_token_id = token

    def _get_config(self, pretrained: str, revision: str | None = None, subfolder: str | None = None, **kwargs) -> None:
        self._package = read_package(hub.resolve(pretrained, subfolder or None, revision))  # a folder or a Hub repo
        self._config = build_config(self._package)
        self._set_image_token(self._config)

    def _create_model(self, pretrained: str, dtype: str | torch.dtype | None = "auto", **kwargs) -> None:
        check_dtype(dtype, self._package)
        refuse_unknown_args(self, kwargs)
        self._model = OrtModelForCausalLM(self._package, device=self._device, provider_options=self._provider_options)

    def _create_tokenizer(self, pretrained, tokenizer, **kwargs) -> None:
        source = self._processor_source
        self.processor = transformers.AutoProcessor.from_pretrained(source, **self.pixels) \
            if isinstance(source, str) else source
        self.tokenizer = self.processor.tokenizer

    @property
    def max_length(self) -> int:
        return self._max_length or self._package.context_length

    @property
    def token_budget(self) -> int:
        """Tokens (prompts, images' included, and new tokens) of an image generation batch under
        `batch_size=auto` (model arg `token_budget`; by default `scoring.default_token_budget` of the device)."""
        if self._token_budget is None:
            self._token_budget = default_token_budget(self._model.device)
        return self._token_budget

    def _text_backend(self) -> OrtModuleLM:
        """`--model ortmodule`'s backend over this model and tokenizer, with this backend's HFLM arguments,
        for the text-only requests (made at the first of them)."""
        if self._text_lm is None:
            self._text_lm = OrtModuleLM(pretrained=self._model, tokenizer=self.tokenizer,
                                        device=str(self._model.device), **self._text_args)
        self._text_lm.cache_hook = self.cache_hook
        return self._text_lm

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._by_kind(requests, "loglikelihood", disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._by_kind(requests, "loglikelihood_rolling", disable_tqdm)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests without images as `--model ortmodule` runs them; prompts with images as
        hf-multimodal runs them, in batches by their work (`_generate_with_images`)."""
        return self._by_kind(requests, "generate_until", disable_tqdm)

    def _by_kind(self, requests, method: str, disable_tqdm: bool) -> list:
        """`method` on the requests without images through the text backend and on those with images as
        hf-multimodal runs them (generation in batches by their work; lm-eval 0.4.13 refuses the
        others), the answers in the requests' order:
        lm-eval hands one call every task's requests of a type, and hf-multimodal takes the first
        request's kind for all of them (an image task and a text task in one run fail there)."""
        kinds = [len(req.args) >= 3 for req in requests]
        answers: list = [None] * len(requests)
        for images in (False, True):
            indices = [i for i, kind in enumerate(kinds) if kind is images]
            if not indices:
                continue
            part = [requests[i] for i in indices]
            if not images:
                done = getattr(self._text_backend(), method)(part, disable_tqdm)
            elif method == "generate_until":
                done = self._generate_with_images(part, disable_tqdm)
            elif method == "loglikelihood_rolling":
                done = HFMultimodalLM.loglikelihood_rolling(self, part)  # lm-eval's refusal
            else:
                done = HFMultimodalLM.loglikelihood(self, part, disable_tqdm)  # lm-eval's refusal
            for i, answer in zip(indices, done, strict=True):
                answers[i] = answer
        return answers

    def _generate_with_images(self, requests, disable_tqdm: bool) -> list[str]:
        """hf-multimodal's `generate_until` in batches by their work (lm_eval.generate_in_batches): a batch
        takes prompts while their tokens (each image's as the processor expands it) and new tokens fit,
        not `batch_size` rows; under `auto` the token budget. Each prompt is encoded once more than
        hf-multimodal encodes it, to count its tokens."""
        widths = self._prompt_widths(requests)
        tokens = [min(width, max(self.max_length - new, 1)) + new
                  for width, new in zip(widths, new_tokens(requests, self.max_gen_toks))]
        return generate_in_batches(self, HFMultimodalLM.generate_until, requests, tokens,
                                   [(-width, req.args[0]) for width, req in zip(widths, requests)],
                                   None if self._auto else self.batch_size_per_gpu, disable_tqdm,
                                   "Running generate_until requests with text+image input")

    def _model_multimodal_generate(self, inputs, max_length, stop, **generation_kwargs):
        """hf-multimodal's, each row stopped at its own stop sequences (lm_eval.StopSequences: lm-eval's
        criteria run a batch until one sequence is in every row; on a CPU a stopped row leaves the decode
        steps); lm-eval's own for a thinking model."""
        if getattr(self, "think_end_token", None) is not None:
            return super()._model_multimodal_generate(inputs, max_length, stop, **generation_kwargs)
        return generate_with_stops(self, inputs, max_length, stop, **generation_kwargs)

    def _prompt_widths(self, requests) -> list[int]:
        """Each image prompt's tokens as hf-multimodal's `generate_until` encodes it (its images resized
        and expanded by the processor), the processor run on several prompts at once (its image work
        leaves Python's lock: on a GPU's host cores this pass would otherwise add a second serial pass
        over every image to hf-multimodal's own)."""
        count = lambda req: self._prompt_tokens(req.args[0], req.args[2])  # noqa: E731
        # The first alone: a fast tokenizer's call sets its padding and truncation state where it differs
        # (a write that would race between threads); the rest find it set and only read it.
        first = [count(req) for req in requests[:1]]
        workers = max(1, min(len(requests) - 1, os.cpu_count() or 1, 8))
        with ThreadPoolExecutor(workers, thread_name_prefix="ortmodule-images") as pool:
            return first + list(pool.map(count, requests[1:]))

    def _prompt_tokens(self, context: str, aux: dict) -> int:
        """One prompt's tokens: what `tok_batch_multimodal_encode` does for one prompt, without its
        padding side set and restored on the shared tokenizer (which threads would race on) or its
        tensors moved to the device."""
        images = [resize_image(image, self.image_width, self.image_height, self.image_max_side)
                  for image in aux["visual"]][: self.max_images]
        if self.rgb:
            images = [image.convert("RGB") for image in images]
        if not self.chat_applied:
            context = replace_placeholders(context, DEFAULT_IMAGE_PLACEHOLDER, self.image_token, self.max_images)
        batch = flatten_image_list([images]) if getattr(self.config, "model_type", "") == "llava" else [images]
        encoding = self.processor(images=batch, text=[context], truncation=self.truncation, padding="longest",
                                  return_tensors="pt")
        return int(encoding["input_ids"].shape[1])

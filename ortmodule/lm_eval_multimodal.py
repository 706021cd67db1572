"""`lm_eval --model ortmodule-multimodal`: lm-eval's `hf-multimodal` backend (HFMultimodalLM) over a
GenAI package that takes images (images.py: Qwen2.5-VL's form; images_plain.py: Gemma 4's), for
tasks with images (MMMU's form: `doc_to_image`, `generate_until`, which is what lm-eval's class
runs with images; its text-only requests go to `--model ortmodule`'s backend over the same model,
where `hf-multimodal` runs them through HFLM's paths).

lm-eval's class is used as it is, with the model loaded from the package and the processor from
where the checkpoint's is (`processor=`: a GenAI package carries onnxruntime-genai's image
settings, not transformers' processor), but for two things `--model ortmodule` does as well: image
prompts generate in batches by their work (tokens, images' included, not `batch_size` rows; `auto`
fills the token budget), and each row stops at its own stop sequences; and the processor encodes the
image batches on worker threads ahead of the batch that generates (`ImagesAhead`).
"""

from __future__ import annotations

import copy
import logging
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.hf_vlms import DEFAULT_IMAGE_PLACEHOLDER, HFMultimodalLM
from lm_eval.models.utils import flatten_image_list, handle_stop_sequences, replace_placeholders, resize_image

from . import hub
from .hf import build_config
from .lm_eval import (
    ArgumentsOnce,
    ModelArgsError,
    OrtModuleLM,
    check_dtype,
    check_max_length,
    checked_loading_options,
    generate_with_stops,
    plan_generation,
    positive_int,
    refuse_hflm_options,
    refuse_unknown_args,
    run_in_batches,
)
from .modeling import OrtModelForCausalLM
from .package import read_package
from .scoring import default_token_budget

logger = logging.getLogger(__name__)

# hf-multimodal's own model args (images' placement and size); the rest are HFLM's, which the text-only
# requests' backend takes too.
_IMAGE_ARGS = frozenset({"image_token_id", "image_string", "interleave", "max_images", "convert_img_format",
                         "min_pixels", "max_pixels", "image_width", "image_height", "image_max_side"})


@register_model("ortmodule-multimodal")
class OrtModuleMultimodalLM(ArgumentsOnce, HFMultimodalLM):
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
            raise ModelArgsError("ortmodule-multimodal takes the checkpoint's processor as processor=, not tokenizer=")
        pretrained = str(pretrained) if isinstance(pretrained, Path) else pretrained
        if processor is None:
            if not isinstance(pretrained, str) or not (Path(pretrained) / "preprocessor_config.json").is_file():
                raise ModelArgsError(
                    "ortmodule-multimodal needs processor=<the Hugging Face checkpoint folder or hub name the package "
                    "was exported from>: a GenAI package holds onnxruntime-genai's image settings, not the "
                    "processor lm-eval runs (preprocessor_config.json)")
            processor = pretrained
        self._processor_source = str(processor) if isinstance(processor, Path) else processor
        checked_loading_options({"provider_options": provider_options})
        self._provider_options = provider_options
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device is None else device
        refuse_hflm_options(kwargs)
        self._token_budget = positive_int(token_budget, "token_budget")
        # Text-only requests go to `--model ortmodule`'s backend over the same model (`_text_backend`).
        self._text_args = {name: value for name, value in kwargs.items() if name not in _IMAGE_ARGS}
        self._text_args["token_budget"] = token_budget
        self._text_lm: OrtModuleLM | None = None
        self._processor_copies: list | None = []  # for the image batches' workers (None: it cannot be copied)
        # hf-multimodal refuses `auto`; here it sizes the image prompts' generation batches by the token budget.
        self._auto = str(kwargs.get("batch_size", 1)).startswith("auto")
        if self._auto:
            kwargs["batch_size"] = 1
        if isinstance(pretrained, OrtModelForCausalLM):
            self._package, self._config = pretrained.package, pretrained.config
            self._set_image_token(self._config)
        super().__init__(pretrained, device=device, **kwargs)
        check_max_length(self._max_length, self._model)
        kind = str(self._package.genai_config["model"].get("type", ""))
        if not kwargs.get("image_string") and kind.startswith("gemma3"):
            # Gemma 3's processor expands its begin-of-image, not the image token lm-eval would write for
            # `<image>` (hf-multimodal needs image_string=<start_of_image> for it)
            self.image_token = getattr(self.tokenizer, "boi_token", None) or "<start_of_image>"

    def _set_image_token(self, config) -> None:
        token = self._package.genai_config["model"].get("image_token_id")
        if not isinstance(token, int):
            raise ModelArgsError(f"{self._package.root}: genai_config.json names no model.image_token_id: the "
                                 "package takes no images (lm-eval's --model ortmodule runs its text)")
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
        # lm-eval appends a request's images as one more argument: a third (a context and a continuation, or
        # generation arguments), or for a rolling document its second.
        kinds = [len(req.args) >= (2 if method == "loglikelihood_rolling" else 3) for req in requests]
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
            elif method == "loglikelihood_rolling":  # hf-multimodal's refusal (it looks for a third argument)
                raise NotImplementedError("ortmodule-multimodal, as hf-multimodal, does not score rolling documents "
                                          "with images (the log-likelihood a model assigns to an image is not "
                                          "measured); documents without images run as `--model ortmodule` runs them")
            else:
                done = HFMultimodalLM.loglikelihood(self, part, disable_tqdm)  # lm-eval's refusal
            for i, answer in zip(indices, done, strict=True):
                answers[i] = answer
        return answers

    def _generate_with_images(self, requests, disable_tqdm: bool) -> list[str]:
        """hf-multimodal's `generate_until` in batches by their work (lm_eval.plan_generation): a batch
        takes prompts while their tokens (each image's as the processor expands it) and new tokens fit,
        not `batch_size` rows; under `auto` the token budget. The processor encodes the batches on worker
        threads ahead of the batch that generates (`ImagesAhead`), and a batch ends without hf-multimodal's
        `gc.collect()` and `torch.cuda.empty_cache()` (`_image_batch`). Each prompt is encoded once more
        than hf-multimodal encodes it, to count its tokens."""
        batches = plan_generation(self, requests, self._prompt_widths(requests),
                                  None if self._auto else self.batch_size_per_gpu)
        with ImagesAhead(self, [[requests[i] for i in batch] for batch in batches]) as ahead:
            return run_in_batches(self, lambda lm, part, _: lm._image_batch(part, ahead.take()), requests, batches,
                                  disable_tqdm, "Running generate_until requests with text+image input")

    def _image_batch(self, requests, encoding) -> list[str]:
        """One batch of hf-multimodal's `generate_until` loop (its stop sequences, `max_gen_toks`, left
        truncation, decoding and cache hook) on the batch's processor `encoding` (`_processed`), without
        the loop's `gc.collect()` and `torch.cuda.empty_cache()` after each batch (some 0.3 s of the
        host's time a batch beside lm-eval's and transformers' objects, with the device idle)."""
        arguments = requests[0].args[1]  # one generation setting a batch (lm_eval.generation_batches)
        kwargs = copy.deepcopy(arguments)
        until = handle_stop_sequences(kwargs.pop("until", None),
                                      eos=self.tok_decode(self.eot_token_id, skip_special_tokens=False))
        max_gen_toks = kwargs.pop("max_gen_toks", self.max_gen_toks)
        encoding = encoding.to(self.device, self.model.dtype)
        keep = self.max_length - max_gen_toks
        if keep:  # hf-multimodal's left truncation
            encoding["input_ids"] = encoding["input_ids"][:, -keep:]
            encoding["attention_mask"] = encoding["attention_mask"][:, -keep:]
        width = encoding["input_ids"].shape[1]
        kwargs.setdefault("max_length", width + max_gen_toks)
        answers = []
        for tokens, request in zip(self._model_multimodal_generate(encoding, stop=until, **kwargs).tolist(),
                                   requests, strict=True):
            answer = self.tok_decode(tokens[width:])
            for term in until:
                if term:
                    answer = answer.split(term)[0]
            self.cache_hook.add_partial("generate_until", (request.args[0], arguments), answer)
            answers.append(answer)
        return answers

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
        """One prompt's tokens, as `_processed` encodes it with the backend's own processor (one row: the
        tokenizer's padding side plays no part)."""
        return int(self._processed(self.processor, [context], [aux["visual"]])["input_ids"].shape[1])

    def _processed(self, processor, contexts: list[str], visuals: list[list]):
        """Prompts and their images as hf-multimodal's `generate_until` and `tok_batch_multimodal_encode`
        make them for `processor` (images resized, at most `max_images`, placeholders replaced, padded to
        the longest on the tokenizer's padding side), on the host: without the padding side set and
        restored on the shared tokenizer, which threads would race on, or the tensors moved to the device."""
        images = [[resize_image(image, self.image_width, self.image_height, self.image_max_side)
                   for image in row][: self.max_images] for row in visuals]
        if self.rgb:
            images = [[image.convert("RGB") for image in row] for row in images]
        if not self.chat_applied:
            contexts = [replace_placeholders(context, DEFAULT_IMAGE_PLACEHOLDER, self.image_token, self.max_images)
                        for context in contexts]
        if getattr(self.config, "model_type", "") == "llava":
            images = flatten_image_list(images)
        return processor(images=images, text=list(contexts), truncation=self.truncation, padding="longest",
                         return_tensors="pt")

    def _encoders(self, count: int) -> list:
        """`count` copies of the processor for worker threads, each its tokenizer padding on the left as
        hf-multimodal pads (kept between calls); none, with a warning, where the processor cannot be
        copied (`ImagesAhead` then encodes each batch when it comes, as hf-multimodal does)."""
        made = self._processor_copies
        while made is not None and len(made) < count:
            try:
                made.append(copy.deepcopy(self.processor))
            except Exception as e:  # noqa: BLE001  any processor object a user passes
                logger.warning("ortmodule-multimodal: the processor cannot be copied for worker threads (%s: %s); "
                               "image batches are encoded when they come", type(e).__name__, e)
                self._processor_copies = made = None  # not tried again
                break
            made[-1].tokenizer.padding_side = "left"
        return [] if made is None else made[:count]

    def _processed_here(self, requests):
        """A batch's encoding with the backend's own processor, on the calling thread, padded on the left
        as hf-multimodal's `tok_batch_multimodal_encode` pads it (its tokenizer's padding side set, then
        restored)."""
        before, self.tokenizer.padding_side = self.tokenizer.padding_side, "left"
        try:
            return self._processed(self.processor, [req.args[0] for req in requests],
                                   [req.args[2]["visual"] for req in requests])
        finally:
            self.tokenizer.padding_side = before


class ImagesAhead:
    """Image generation batches encoded by the processor on worker threads while the batches before
    them generate: up to `workers` batches ahead (by default one on a CPU; on a GPU one for each two of
    the host's cores, at most 4), each worker with its own copy of the processor (a fast tokenizer's
    call writes its padding state, and the model's thread decodes and encodes stop sequences with the
    backend's tokenizer meanwhile).
    `take()` gives the next batch's encoding in order, waiting for it where it is not done."""

    def __init__(self, lm: OrtModuleMultimodalLM, batches: list[list], workers: int | None = None):
        if workers is None:  # on a CPU the model's runs take the cores, and one worker keeps ahead of them
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            workers = 1 if lm.device.type == "cpu" else max(1, min(4, cores // 2))
        copies = lm._encoders(workers)
        self.workers = len(copies)  # 0: a processor that cannot be copied, each batch encoded when it comes
        self.lm, self.batches, self.next, self.futures = lm, batches, 0, {}
        self.processors: queue.SimpleQueue = queue.SimpleQueue()
        for processor in copies:
            self.processors.put(processor)
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ortmodule-images") if copies else None
        for index in range(min(self.workers, len(batches))):
            self._submit(index)

    def _submit(self, index: int) -> None:
        self.futures[index] = self.pool.submit(self._encode, self.batches[index])

    def _encode(self, requests):
        processor = self.processors.get()
        try:
            return self.lm._processed(processor, [req.args[0] for req in requests],
                                      [req.args[2]["visual"] for req in requests])
        finally:
            self.processors.put(processor)

    def take(self):
        index, self.next = self.next, self.next + 1
        if self.pool is None:
            return self.lm._processed_here(self.batches[index])
        if index + self.workers < len(self.batches):
            self._submit(index + self.workers)
        return self.futures.pop(index).result()

    def __enter__(self) -> ImagesAhead:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

"""`HuggingFaceSurface`: what transformers' code and libraries call on a model beyond forward, the
base of `OrtModelForCausalLM` (modeling.py): `device`, `dtype` and `to` over the decoder, the
`GenerationMixin` hooks (`generate` and `_sample` to ortmodule's loop on the device, prompts with
images included; `_expand_inputs_for_generation` with each row's images and videos), and
`NotSupportedError` for the PyTorch modules and methods a package does not have.
"""

from __future__ import annotations

import copy
import hashlib
import shutil
import warnings
from pathlib import Path

import torch
from transformers import GenerationConfig, GenerationMixin

from . import embeddings, generation, images, images_plain, runtime
from .backbone import WithBackbone
from .batch_generation import BatchGeneration
from .cache import KVCache, carried, keep_known
from .hf import CACHE_NAME
from .package import NotSupportedError, model_files
from .parameters import count_parameters

# What transformers models have and these do not, with what to do instead.
_NO_PYTORCH_MODULES = (
    "the ONNX graph holds the weights, and ortmodule exposes no PyTorch modules but the embedding table, "
    "the LM head (get_input_embeddings(), get_output_embeddings()) and the backbone that gives the last hidden "
    "state (model.model, model.base_model); for per-token "
    "log-probabilities use model(input_ids, ...).logits (with cont_len / logits_to_keep for the positions you need) "
    "or ortmodule.loglikelihood"
)
_INFERENCE_ONLY = "an ONNX package runs inference only: its graph holds the weights, and nothing of it trains"
_FIXED_WEIGHTS = "the package's weights were fixed when it was exported"
_UNSUPPORTED_ATTRIBUTES = {
    "lm_head": _NO_PYTORCH_MODULES,
    "gradient_checkpointing_enable": _INFERENCE_ONLY,
    # trl's trainers tag the model they train first
    "add_model_tags": f"{_INFERENCE_ONLY}; train a transformers model and pass the package as the frozen one "
                      "(trl's ref_model= or teacher_model=)",
    "enable_input_require_grads": _INFERENCE_ONLY,
    "push_to_hub": "save the package with save_pretrained(folder), then upload the folder with huggingface_hub's "
                   "upload_folder",
    # transformers' PEFT integration and its weight setters
    **dict.fromkeys(("load_adapter", "add_adapter", "set_adapter", "enable_adapters", "disable_adapters",
                     "delete_adapter", "active_adapters", "get_adapter_state_dict", "enable_peft_hotswap"),
                    f"{_FIXED_WEIGHTS}: merge the adapter into the checkpoint (peft's merge_and_unload), then "
                    "export that"),
    **dict.fromkeys(("set_input_embeddings", "set_output_embeddings", "set_decoder", "dequantize"),
                    f"{_FIXED_WEIGHTS}: change the checkpoint, then export it again"),
}


class _InferenceOnly(torch.autograd.Function):
    """The identity on a loss, whose backward raises NotSupportedError: a training step's loss (`training_loss`)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise NotSupportedError(f"backward() through OrtModelForCausalLM's loss (Trainer.train, a training loop): "
                                f"{_INFERENCE_ONLY}; evaluate with model.eval() or under torch.no_grad()")


def training_loss(loss: torch.Tensor) -> torch.Tensor:
    """`loss` as a model in train mode with gradients on gives it: the same value, which trains nothing
    but names why at `backward()` (a NotSupportedError) where torch would say that the loss does not
    require grad."""
    return _InferenceOnly.apply(loss, torch.ones((), requires_grad=True))


def note_autocast(device: torch.device, dtype: torch.dtype) -> None:
    """A warning where `torch.autocast` asks another precision than the package's (once per process and
    precision: Python's default filter): the graph computes in the precision it was exported in."""
    if torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) != dtype:
        asked = str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")
        warnings.warn(f"torch.autocast({device.type}, {asked}) does not change an ONNX package's precision: this "
                      f"one computes in {str(dtype).removeprefix('torch.')}, as it was exported; export the model in "
                      f"{asked} for that precision", stacklevel=2)


def _on_the_anchor(func, args, kwargs):
    """`func` as torch runs it on a plain tensor; where an in-place op on `device_anchor` fails (a weight
    copied, added or averaged into the empty tensor), a NotSupportedError naming why instead of torch's
    size mismatch. `.data` gives the anchor's data as an `_AnchorData`, so that writes through it are
    refused the same way."""
    with torch._C.DisableTorchFunctionSubclass():
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:
            name = getattr(func, "__name__", "")
            if name.endswith("_") and not name.startswith("_"):  # in place (`+=` comes as `add_`)
                raise NotSupportedError(
                    f"{name}() into OrtModelForCausalLM's device_anchor: {_FIXED_WEIGHTS}, and its one torch parameter "
                    "is an empty tensor that tells the device and dtype. A policy's weights copied or averaged into "
                    "the model (trl's sync_ref_model, an EMA of weights) have nothing to write to: keep such updates "
                    "off with a package, or export the updated checkpoint as a new package") from e
            raise
    if func == torch.Tensor.data.__get__:
        return out.as_subclass(_AnchorData)
    return out


class DeviceAnchor(torch.nn.Parameter):
    """The type of `device_anchor`: torch's Parameter, which ops see as a plain tensor, whose failing
    in-place writes are refused naming why (`_on_the_anchor`)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _on_the_anchor(func, args, kwargs or {})

    def __repr__(self) -> str:
        return f"Parameter containing:\n{self.detach()!r}"


class _AnchorData(torch.Tensor):
    """`device_anchor.data`: a plain tensor to ops, whose failing in-place writes are refused naming why."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _on_the_anchor(func, args, kwargs or {})


FINGERPRINT = "package_fingerprint"


def _refuse_weights(state_dict, prefix: str) -> None:
    """A NotSupportedError for weights in a state dict given to `load_state_dict` (a fine-tuned
    checkpoint's, say): the package's graph holds the weights, and torch would report them as unexpected
    keys, or with `strict=False` skip them and leave the package's numbers."""
    weights = [key[len(prefix):] for key in state_dict if key.startswith(prefix) and key != prefix + "device_anchor"]
    if weights:
        shown = ", ".join(weights[:3]) + (f" and {len(weights) - 3} more" if len(weights) > 3 else "")
        raise NotSupportedError(f"load_state_dict: {shown} are weights, which an OrtModelForCausalLM does not take: "
                                f"its package's ONNX graph holds them, fixed at export. Export the checkpoint with "
                                f"these weights (ortmodule export) and load that package")


def package_fingerprint(decoder) -> torch.Tensor:
    """32 bytes (uint8) that differ between packages and between loading options that change the numbers:
    a hash of every file under the package's folder (its path there, size and modification time) and the
    decoder's options; the same for the same files and options."""
    digest = hashlib.sha256(repr((decoder.rewrite_lm_head, decoder.quantized_prefill,
                                  decoder.prefill_attention)).encode())
    root = decoder.package.root
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        status = path.stat()
        digest.update(f"{path.relative_to(root)}|{status.st_size}|{status.st_mtime_ns}\n".encode())
    return torch.tensor(list(digest.digest()), dtype=torch.uint8)


_RELOAD = "_ortmodule_reload"


def pickled_state(model) -> dict:
    """What pickle keeps of a model: everything `copy.deepcopy` copies (config, generation config, attributes
    set on the model), and in place of ONNX Runtime's sessions, which cannot be pickled, the package's folder,
    the device, the loading options and the package's fingerprint. So a model passed to another process
    (multiprocessing, `datasets.map(num_proc=...)`, torch.multiprocessing's spawn) loads its package there, as
    a deep copy loads it here; the tables `get_input_embeddings` / `get_output_embeddings` made are made again
    there, and the measured costs read from the cache folder."""
    decoder = model.decoder
    if decoder.session_options is not None:
        raise TypeError("a model loaded with session_options cannot be pickled (ONNX Runtime's SessionOptions "
                        "cannot be): load it in the other process with from_pretrained")
    state = {name: value for name, value in model.__dict__.items()
             if name not in ("decoder", "package", "_costs") and not name.startswith("_made_")}
    state["_parameters"] = {k: v for k, v in model._parameters.items() if k != "device_anchor"}  # made again
    state[_RELOAD] = {"path": str(model.package.root.absolute()), "device": str(decoder.device),  # another cwd there
                      "options": decoder.options(), "fingerprint": package_fingerprint(decoder).tolist()}
    return state


def restore(model, state: dict) -> None:
    """A pickled model's state back (`pickled_state`): its package loaded again from its folder, which must hold
    the same files (a `PackageError` naming the folder where it is gone or its files changed since)."""
    from .decoder import Decoder  # (decoder.py's imports reach this module's users)
    from .package import PackageError, read_package

    state = dict(state)
    reload = state.pop(_RELOAD)
    package = read_package(reload["path"])
    decoder = Decoder(package, torch.device(reload["device"]), None, **reload["options"])
    if package_fingerprint(decoder).tolist() != reload["fingerprint"]:
        raise PackageError(f"{package.root}: the package's files changed since the model was pickled, so it would "
                           "not compute what the pickled model computed; pickle the model again")
    model.__dict__.update(state, package=package, decoder=decoder, _costs={})
    model._anchor()


class Conversions:
    """torch's conversions of a module, each through the model's `to`, which moves the sessions to another
    device and refuses another dtype than the package's (torch's own would change only `device_anchor`, so
    that `next(model.parameters())` no longer told what the model computes in)."""

    def half(self):
        return self.to(torch.float16)

    def float(self):
        return self.to(torch.float32)

    def bfloat16(self):
        return self.to(torch.bfloat16)

    def double(self):
        return self.to(torch.float64)

    def type(self, dst_type: torch.dtype):
        if not isinstance(dst_type, torch.dtype):
            raise TypeError(f"OrtModelForCausalLM.type({dst_type!r}): give a torch.dtype (this package's is "
                            f"{self.dtype}); to(device) moves the model")
        return self.to(dst_type)

    def cuda(self, device: int | None = None):
        return self.to("cuda" if device is None else f"cuda:{device}")

    def cpu(self):
        return self.to("cpu")

    def to_empty(self, *, device, recurse: bool = True):
        """The package loaded on `device` (torch's moves parameters without their values; a package's weights
        are its graph's, loaded again there)."""
        return self.to(device)


class HuggingFaceSurface(WithBackbone, Conversions, BatchGeneration, GenerationMixin):
    """What transformers' generation code and libraries call on a model beyond forward: transformers'
    `GenerationMixin` (generate, compute_transition_scores, ...) with its sampling loop on the device,
    and clear errors for the PyTorch modules an ONNX package does not have."""

    # transformers' causal-LM loss (its LOSS_MAPPING key, as transformers' models name theirs): Trainer reads it
    # to count `num_items_in_batch` over the shifted labels, as forward's loss divides by it.
    loss_type = "ForCausalLM"
    supports_gradient_checkpointing = is_gradient_checkpointing = False
    _parameter_counts: tuple[int, int] | None = None  # num_parameters' (all, embeddings), read at first call

    @property
    def loss_function(self):
        """transformers' causal-LM loss (`loss_function(logits, labels, vocab_size, ...)`), as on its models."""
        from transformers.loss.loss_utils import LOSS_MAPPING

        return LOSS_MAPPING[self.loss_type]

    def get_memory_footprint(self, return_buffers: bool = True) -> int:
        """Bytes of the package's ONNX graphs and the weight files they read (`package.model_files`: the graphs
        genai_config names, not other files of the folder), what its sessions load: the counterpart of
        transformers' parameters and buffers. The KV cache and ONNX Runtime's own buffers come on top, as
        transformers' activations do."""
        return sum(f.stat().st_size for f in model_files(self.package))

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.kv_dtype

    def _anchor(self) -> None:
        """`device_anchor`, the model's one parameter: empty and frozen, on its device in its dtype. The
        weights are the ONNX graph's; code that reads a model's device or dtype from its first parameter
        (`next(model.parameters()).device`, through a wrapping module too) finds them there. It holds no
        element (`num_parameters()` counts the graph's weights); a weight written into it is refused naming
        why (`DeviceAnchor`)."""
        self.device_anchor = DeviceAnchor(torch.empty(0, dtype=self.dtype, device=self.device), requires_grad=False)

    def to(self, *args, **kwargs) -> HuggingFaceSurface:
        """Move the sessions to another device. The dtype is fixed by the exported package."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype != self.dtype:
            raise TypeError(
                f"cannot convert an ONNX package to {dtype}: it was exported as {self.dtype}; "
                "export the model again with the precision you need"
            )
        if device is not None:
            device = runtime.parse_device(device)
            if device != self.device:
                self.decoder.load(device)
                self._anchor()
        return self

    @runtime.entry_point
    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None,
                 **kwargs):
        """transformers' `generate` (every option, logits processor, stopping criterion and mode:
        greedy, sampling, beam search), with greedy decoding and sampling run on the device; plus
        `generator`, a `torch.Generator` for reproducible sampling. Returns what transformers
        returns: the prompts as given followed by the new tokens (or a `GenerateOutput`)."""
        note_autocast(self.device, self.dtype)
        return generation.generate(self, inputs, generation_config, **kwargs)

    def __deepcopy__(self, memo: dict) -> HuggingFaceSurface:
        """A model with sessions of its own: the package loaded again on the same device with the same
        options, everything else (config, generation config, attributes set on the model) copied, so that
        the two run apart, as deep copies of transformers' models do (trl makes reference models so)."""
        copied = type(self).__new__(type(self))
        memo.update({id(self): copied, id(self.decoder): self.decoder.again(), id(self.package): self.package})
        for name, value in self.__dict__.items():
            copied.__dict__[name] = copy.deepcopy(value, memo)
        return copied

    def __getstate__(self) -> dict:
        """Pickled by reference to its package (`pickled_state`): unpickled, the package is loaded again."""
        return pickled_state(self)

    def __setstate__(self, state: dict) -> None:
        restore(self, state)

    def __getattr__(self, name: str):
        if name in _UNSUPPORTED_ATTRIBUTES:
            raise NotSupportedError(f"OrtModelForCausalLM has no {name}: {_UNSUPPORTED_ATTRIBUTES[name]}")
        return super().__getattr__(name)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """torch's (`device_anchor`) and `package_fingerprint`, so that code that hashes a model's state (trl's
        key for its cache of precomputed reference log-probabilities) tells packages and their options apart."""
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        out[prefix + FINGERPRINT] = package_fingerprint(self.decoder)
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args):
        state_dict.pop(prefix + FINGERPRINT, None)  # nothing to load: the package's files are what runs
        _refuse_weights(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        """The package's token embeddings as transformers gives them: a frozen `torch.nn.Embedding` on
        the model's device, read from the graph once per device (embeddings.py); not a submodule."""
        return self._table("get_input_embeddings", lambda: embeddings.input_embeddings(
            self.package, self.config.model_type, self.device))

    def get_output_embeddings(self) -> torch.nn.Linear:
        """The package's LM head as transformers gives it: a frozen `torch.nn.Linear(hidden, vocab)` on
        the model's device (embeddings.py), read once per device; not a submodule."""
        return self._table("get_output_embeddings", lambda: embeddings.output_embeddings(self.package, self.device))

    def save_pretrained(self, save_directory: str | Path, push_to_hub: bool = False, **kwargs) -> None:
        """The package as a folder of its own at `save_directory` (created; files of the same names
        replaced): every file copied, links followed, so that a package from the hub's cache becomes
        self-contained. transformers' serialization options (`safe_serialization`, `max_shard_size`,
        ...) have no effect: the files are the export's."""
        if push_to_hub:
            raise NotSupportedError("save_pretrained(push_to_hub=True): save the folder, then upload it with "
                                    "huggingface_hub's upload_folder")
        root, target = self.package.root.resolve(), Path(save_directory).resolve()
        if target == root or root in target.parents:
            raise ValueError(f"save_pretrained({save_directory!r}): that is the package's own folder {root}")
        shutil.copytree(self.package.root, target, dirs_exist_ok=True)  # links followed: their files copied

    def set_attn_implementation(self, attn_implementation: str | dict) -> None:
        """transformers' switch of attention kernels (code asks for "eager" before `output_attentions`):
        without effect here, as `from_pretrained(attn_implementation=...)`. The package's graph fixes
        the attention op, and its CPU kernels give attention weights whatever was asked."""
        if not isinstance(attn_implementation, (str, dict)):
            raise TypeError(f"attn_implementation must be a string (or a dict of them), got "
                            f"{type(attn_implementation).__name__}")

    def _table(self, name: str, make) -> torch.nn.Module:
        made = self.__dict__.get(f"_made_{name}")  # kept out of nn.Module's registry: no parameters()
        if made is None or made[0] != self.device:
            try:
                made = self.__dict__[f"_made_{name}"] = (self.device, make())
            except ValueError as reason:
                raise NotSupportedError(f"OrtModelForCausalLM.{name}(): {reason}") from None
        return made[1]

    def resize_token_embeddings(self, *args, **kwargs):
        raise NotSupportedError(
            "OrtModelForCausalLM.resize_token_embeddings(): the vocabulary is fixed by the exported package; add the "
            "tokens to the PyTorch model and export it again"
        )

    def is_remote_code(self) -> bool:
        return False

    def tie_weights(self) -> None:
        """Nothing to tie: the weights live in the ONNX graph."""

    def can_generate(self) -> bool:
        return True

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """The weights of the package's graphs (a multimodal package's vision and embedding models too), as
        transformers counts the model's parameters (`parameters.count_parameters`: rotary tables left out,
        quantized weights at their elements, a tied LM head once). None is trainable; `exclude_embeddings`
        leaves out the embedding tables, as transformers leaves out its `nn.Embedding` weights."""
        if only_trainable:
            return 0
        if self._parameter_counts is None:  # read from the graphs once
            self._parameter_counts = count_parameters(self.package)
        total, embeddings = self._parameter_counts
        return total - embeddings if exclude_embeddings else total

    def extra_repr(self) -> str:
        return f"path={self.name_or_path}, device={self.device}, dtype={self.dtype}"

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return True  # transformers makes an empty DynamicCache; forward starts its own KVCache from it

    def get_experts_implementation(self) -> dict:
        return {}  # the graph's kernels are fixed at export: nothing for transformers' decode loop to switch

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs):
        """transformers' own, after an empty transformers cache the caller passed again (its multi-turn pattern) is
        replaced by the KVCache it stands for (`cache.carried`), continued as a KVCache passed (`keep_known`)."""
        given = model_kwargs.get(CACHE_NAME)
        kept = None if isinstance(given, KVCache) or given is None else carried(given, self.decoder)
        if kept is not None and given.get_seq_length() == 0:
            model_kwargs[CACHE_NAME] = kept
        return GenerationMixin._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        model_kwargs.pop("generator", None)  # ortmodule's own argument, taken by its sampling loop
        GenerationMixin._validate_model_kwargs(self, model_kwargs)

    def _prepare_attention_mask_for_generation(self, inputs_tensor, generation_config, model_kwargs):
        """transformers' mask inferred from pad tokens where generate gets none; for a fresh prompt, one with a gap
        or an empty row is refused naming the pad token (`generation.check_inferred_mask`). Continuing a cache (an
        assistant's drafts each round, a continued generate), only each row's leading pad tokens are
        padding: a pad token inside the text counts as a token, as the cache already holds it. transformers
        masks such a token (its assistant's drafted pad token, say), which a step over this cache cannot."""
        mask = GenerationMixin._prepare_attention_mask_for_generation(self, inputs_tensor, generation_config,
                                                                     model_kwargs)
        cache = model_kwargs.get(CACHE_NAME)
        if cache is None or mask.dim() != 2 or cache.get_seq_length() == 0:
            generation.check_inferred_mask(mask, generation_config.pad_token_id)
            return mask
        leading = mask.cummax(1).values  # 0 only before each row's first real token
        if not torch.equal(leading, mask):
            warnings.warn(
                "generate got no attention_mask, continues a cache, and holds pad_token_id "
                f"{generation_config.pad_token_id} after a row's first token: ortmodule counts it as a token "
                "there (transformers would mask it; in assisted decoding that changes only the assistant's "
                "drafts); pass attention_mask to say otherwise", UserWarning, stacklevel=2)
        return leading

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False, input_ids=None,
                                      **model_kwargs):
        """transformers' repetition of every row for `num_return_sequences` and beams, with each row's
        images and videos repeated with it (their tensors are not one row each: images.expanded)."""
        given = {name: model_kwargs.get(name) for name in images.NAMES}
        ids = input_ids
        input_ids, model_kwargs = GenerationMixin._expand_inputs_for_generation(
            self, expand_size, is_encoder_decoder, input_ids, **model_kwargs)
        if expand_size != 1 and isinstance(ids, torch.Tensor):
            _expand_media(self.decoder, ids, expand_size, given, model_kwargs)
        return input_ids, model_kwargs

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        """transformers' greedy/sampling loop, run on the device by generation.sample (a prompt's
        images too, and a KVCache the caller passed, continued); from `inputs_embeds`, returning hidden
        states or attention weights, or images over a cache, transformers' own loop over forward."""
        cache = model_kwargs.get(CACHE_NAME)
        on_device = _device_loop(self, input_ids, cache, generation_config, model_kwargs)
        if on_device is not None:
            return generation.sample(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                                     **on_device, **model_kwargs)
        if model_kwargs.pop("generator", None) is not None:
            raise ValueError("generator= cannot be combined with inputs_embeds, output_hidden_states, "
                             "output_attentions or images over a cache in generate()")
        out = GenerationMixin._sample(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                      synced_gpus, streamer, **model_kwargs)
        if isinstance(cache, KVCache):  # the tokens it holds, for the next call's keep_known
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            cache.tokens = sequences[:, : cache.seen].clone() if sequences.shape[1] >= cache.seen else None
        return out


def _device_loop(model, input_ids, cache, generation_config, model_kwargs: dict) -> dict | None:
    """generation.sample's arguments where ortmodule's loop on the device runs a generate (the cache and the
    images taken out of `model_kwargs`), else None (transformers' loop): from a prompt (no cache, or an empty
    transformers cache, the caller's then carried on: `cache.carry`), with its images; continuing a KVCache,
    cropped first to the columns the ids share with it (`keep_known`), without images. Not with `inputs_embeds`
    or where hidden states or attention weights are returned."""
    if isinstance(cache, KVCache):
        keep_known(cache, input_ids)
    if generation_config.output_hidden_states or generation_config.output_attentions or \
            model_kwargs.get("inputs_embeds") is not None:
        return None
    if isinstance(cache, KVCache):
        if any(model_kwargs.get(name) is not None for name in images.NAMES):
            return None
        model_kwargs.pop(CACHE_NAME)
        return {"given": cache}
    blank = cache is not None and cache.get_seq_length() == 0
    if cache is not None and not blank:
        return None  # a transformers cache holding entries: forward refuses it, naming it
    model_kwargs.pop(CACHE_NAME, None)  # an empty DynamicCache: the caller's is carried on, not transformers'
    media = images.prompt_media(model.decoder, None, None,
                                images.Media(**{name: model_kwargs.pop(name, None) for name in images.NAMES}))
    return {"media": media, "carry_to": cache if blank and getattr(cache, "_is_user_defined", False) else None}


def _expand_media(decoder, ids: torch.Tensor, expand_size: int, given: dict, model_kwargs: dict) -> None:
    """Each row's images and videos in `model_kwargs` repeated `expand_size` times with the row (`given`:
    the media as generate got them)."""
    token = decoder.package.genai_config["model"].get("image_token_id")
    if isinstance(given["pixel_values"], torch.Tensor) and given["image_grid_thw"] is None:
        try:  # Gemma 4's and Pixtral's forms: one row of pixel_values per image
            vision = images.for_decoder(decoder)
        except images.ImagesUnsupported:  # refused by name when forward gets them
            vision = None
        if isinstance(vision, images_plain.PlainVision):
            names = ("pixel_values", "image_position_ids", "image_sizes")
            for name, value in zip(names, images_plain.expanded(vision, ids, expand_size,
                                                                *(given[name] for name in names))):
                model_kwargs[name] = value
            return
    kinds = [("pixel_values", "image_grid_thw", (), token, False)]
    if isinstance(given["pixel_values_videos"], torch.Tensor):
        try:
            vision = images.for_decoder(decoder)
            kinds.append(("pixel_values_videos", "video_grid_thw", ("second_per_grid_ts",), vision.video_token,
                          vision.frames_apart))
        except images.ImagesUnsupported:  # refused by name when forward gets them
            pass
    for pixels, grids, extra, token, apart in kinds:
        if isinstance(given[pixels], torch.Tensor) and isinstance(given[grids], torch.Tensor) and token is not None:
            names = (pixels, grids, *extra)
            for name, value in zip(names, images.expanded(ids, token, expand_size, *(given[n] for n in names),
                                                          frames_apart=apart)):
                model_kwargs[name] = value

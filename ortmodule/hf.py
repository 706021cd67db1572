"""The Hugging Face objects a package stands for: its config, generation config and tokenizer,
read from the package's own files (a Hub repository's package is fetched first: hub.py)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import graph_config, hub, inputs, runtime
from .package import Package, PackageError

logger = logging.getLogger("ortmodule")

# The name transformers gives the KV cache in model outputs and in generate's model inputs: `cache`
# from transformers 5.24, `past_key_values` before. forward and generate take either name.
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def load_tokenizer(path: str | Path, subfolder: str | None = None, revision: str | None = None, **kwargs):
    """The package's Hugging Face fast tokenizer, read from its own files (a Hub repository's package:
    fetched first, as `from_pretrained` fetches it, hub.py)."""
    root = hub.resolve(path, subfolder, revision)
    if not (root / "tokenizer.json").is_file():
        raise PackageError(f"{root}: no tokenizer.json in the package folder")
    try:
        return AutoTokenizer.from_pretrained(root, local_files_only=True, **kwargs)
    except Exception as e:  # noqa: BLE001  tokenizers' and transformers' own errors for a damaged file
        raise PackageError(
            f"{root}: the tokenizer files cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
        ) from None


def build_config(package: Package) -> PretrainedConfig:
    """The package's config.json when present, else a config built from what genai_config.json says; its
    `dtype` (and its text config's) the package's precision, as transformers sets a loaded model's."""
    config = checkpoint_config(package.root) or _genai_config(package)
    config.dtype = config.get_text_config().dtype = runtime.torch_dtype(package.decoder.kv_type)
    return config


def _genai_config(package: Package) -> PretrainedConfig:
    """A transformers config of the package's model type from what genai_config.json says, with the fields
    its graph states (graph_config.py) and its causal LM class as `architectures`."""
    fields = dict(  # noqa: C408  transformers' config field names as keywords
        vocab_size=package.vocab_size,
        hidden_size=package.hidden_size,
        num_hidden_layers=package.num_hidden_layers,
        num_attention_heads=package.num_attention_heads,
        num_key_value_heads=package.num_key_value_heads,
        head_dim=package.head_size,
        max_position_embeddings=package.context_length,
        bos_token_id=package.bos_token_id,
        eos_token_id=package.eos_token_id,
        pad_token_id=package.pad_token_id,
    )
    model_type, architecture = graph_config.transformers_type(package.model_type)
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError, StrictDataclassError):  # a type it does not know, or its checks
        config = PretrainedConfig(**fields)  # (the graph's own check at load names a shape it cannot run)
    else:
        try:
            stated = graph_config.graph_fields(package, config)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, OSError) as e:  # a graph of a form
            logger.warning("ortmodule: %s: the config fields its graph states were not read (%s: %s); they are the "
                           "config class's defaults", package.root, type(e).__name__, e)  # not foreseen there
            stated = {}
        for name, value in stated.items():
            with contextlib.suppress(ValueError, TypeError, StrictDataclassError):  # what the class's checks refuse
                setattr(config, name, value)
        config.architectures = [architecture] if architecture else None
    config.name_or_path = str(package.root)
    return config


def checkpoint_config(root: Path) -> PretrainedConfig | None:
    """The config.json a package folder keeps of its checkpoint, read alone (None where it has none)."""
    config_file = root / "config.json"
    if not config_file.is_file():
        return None
    try:
        return AutoConfig.from_pretrained(root, local_files_only=True)
    except (ValueError, KeyError):  # a model type this transformers does not know
        return PretrainedConfig.from_dict(json.loads(config_file.read_text()))


# genai_config.json's search fields that come from the checkpoint's generation config (four by the model
# builder, the rest by `ortmodule export`: exporter.carry_generation_defaults), with transformers' defaults:
# what transformers' `generate` applies by default on the checkpoint (Qwen2.5's
# instruct models ship repetition_penalty 1.05, say). Not taken: `max_length` (the builder writes the context
# length there, where transformers' default is 20), `early_stopping` (the builder writes true whatever the
# checkpoint says), `diversity_penalty` (group beam search left transformers 5), `min_length` (always 0).
SEARCH_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0,
                   "no_repeat_ngram_size": 0, "num_beams": 1, "num_return_sequences": 1, "length_penalty": 1.0}


def build_generation_config(package: Package) -> GenerationConfig:
    """genai_config.json's search section as transformers' GenerationConfig: each of `SEARCH_DEFAULTS`' fields
    set where the package's value differs from transformers' default, the others left unset (None), as in
    the config transformers loads from a checkpoint's generation_config.json. The builder writes every field,
    so set and unset tell apart only by their values; code that reads which fields a model sets (the
    text-generation pipeline applies its own defaults, sampling at temperature 0.7, to the unset ones) then
    sees what transformers' model on the checkpoint shows."""
    search = package.search
    return GenerationConfig(
        bos_token_id=package.bos_token_id,
        eos_token_id=package.eos_token_id,
        pad_token_id=package.pad_token_id,
        **{name: search[name] for name, default in SEARCH_DEFAULTS.items()
           if search.get(name, default) != default},
    )


# transformers' `from_pretrained` arguments, as `OrtModelForCausalLM.from_pretrained` takes them:
# without effect on a package (its attention kernels and loading are ONNX Runtime's), for fetching a
# Hub repository (hub.py), and what a package cannot honour (its weights were fixed at export).
WITHOUT_EFFECT = {"trust_remote_code", "attn_implementation", "low_cpu_mem_usage", "use_safetensors",
                  "resume_download", "output_loading_info", "offload_folder", "offload_state_dict", "max_memory",
                  "offload_buffers", "use_kernels", "key_mapping", "experts_implementation", "tqdm_class"}
FETCHING = {"token", "local_files_only", "proxies", "force_download"}
FIXED_AT_EXPORT = {"quantization_config", "load_in_8bit", "load_in_4bit", "gguf_file", "tp_plan", "adapter_kwargs",
                   "adapter_name", "variant"}
# Config fields that transformers' `from_pretrained` sets on the model's config from its keywords (it sets any
# field the config has; the others, the model's shape and settings, the package's graph fixed at export):
# booleans, and the special token ids (an id, None, or for `eos_token_id` a list of ids).
CONFIG_FIELDS = {"output_attentions", "output_hidden_states", "use_cache"}
TOKEN_FIELDS = {"pad_token_id", "bos_token_id", "eos_token_id"}


def unexpected_loading_options(kwargs: dict) -> list[str]:
    """The names among `kwargs` that are none of transformers' loading arguments a package takes or refuses
    by name (`loading_options`), sorted."""
    return sorted(set(kwargs) - WITHOUT_EFFECT - FETCHING - FIXED_AT_EXPORT - CONFIG_FIELDS - TOKEN_FIELDS -
                  {"dtype", "torch_dtype", "device_map"})


def loading_options(device, kwargs: dict) -> tuple[object, dict, object, dict]:
    """transformers' loading arguments among `kwargs` (`from_pretrained`'s extra keywords): the device
    (from `device`, or `device_map` as transformers takes it on one device), the Hub fetching options,
    the dtype asked for ("auto" where none) and the config fields to set (`CONFIG_FIELDS`, booleans);
    a TypeError naming any other argument, a ValueError for one a package cannot honour."""
    unknown = unexpected_loading_options(kwargs)
    if unknown:
        raise TypeError(f"OrtModelForCausalLM.from_pretrained() got unexpected keyword arguments: {unknown} (of the "
                        f"config fields transformers sets from its keywords a package takes "
                        f"{', '.join(sorted(CONFIG_FIELDS | TOKEN_FIELDS))}: the others, the model's shape and "
                        "settings, were fixed when it was exported)")
    fixed = sorted(name for name in FIXED_AT_EXPORT if kwargs.get(name) not in (None, False))
    if fixed:
        raise ValueError(f"{', '.join(fixed)}: a GenAI package's weights and precision were fixed when it was exported "
                         "(quantize or merge the checkpoint, then export it)")
    if "dtype" in kwargs and "torch_dtype" in kwargs:
        raise ValueError("give dtype or torch_dtype (its older name), not both")
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype", "auto"))
    placed = kwargs.get("device_map")
    if isinstance(placed, dict):
        if len(set(placed.values())) != 1:
            raise ValueError(f"device_map={placed!r}: a package runs on one device (ONNX Runtime's session), not "
                             "split across several")
        placed = next(iter(placed.values()))
    if placed == "auto":
        placed = "cuda" if torch.cuda.is_available() else "cpu"
    if placed is not None and device is not None and torch.device(placed) != torch.device(device):
        raise ValueError(f"device={device!r} and device_map={kwargs['device_map']!r} name different devices")
    fields = {k: v for k, v in kwargs.items() if k in CONFIG_FIELDS | TOKEN_FIELDS}
    for name, value in fields.items():
        if name in CONFIG_FIELDS and not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    return (placed if placed is not None else device), {k: v for k, v in kwargs.items() if k in FETCHING}, dtype, \
        fields


def check_token_fields(fields: dict, package: Package) -> None:
    """The special token ids among `loading_options`' config fields: ids (a list of them for `eos_token_id`)
    or None, within the package's vocabulary."""
    for name in sorted(TOKEN_FIELDS & set(fields)):
        value = fields[name]
        ids = inputs.eos_token_ids(value) if name == "eos_token_id" else [] if value is None else [value]
        if any(type(i) is not int for i in ids):
            raise TypeError(f"{name} must be a token id{' (or a list of them)' if name == 'eos_token_id' else ''} "
                            f"or None, got {value!r}")
        if inputs.outside_vocabulary(ids, package.vocab_size) is not None:
            raise ValueError(f"{name}={value!r} is outside the vocabulary [0, {package.vocab_size})")


def check_dtype(dtype, package: Package, asked=None) -> None:
    """A dtype asked of a model of `package`, before any session is made: "auto" (or None), or the
    package's own precision (a torch dtype or its name), else a ValueError naming both (`asked`: the
    caller's spelling of it)."""
    own = runtime.torch_dtype(package.decoder.kv_type)
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if dtype is None or dtype == "auto" or dtype == own or named == own:
        return
    shown, precision = dtype if asked is None else asked, str(own).removeprefix("torch.")
    raise ValueError(f"dtype={shown!r}: {package.root} computes in {precision}, "
                     "fixed when it was exported (`ortmodule export --precision ...` makes another; or leave dtype "
                     "out)")

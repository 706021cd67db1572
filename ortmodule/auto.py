"""transformers' auto classes on GenAI packages, so that code which loads its model by name runs on a
package unchanged: while `auto_classes()` is on (a `with` block, or `enable_auto_classes()` until
`disable_auto_classes()`), `AutoModelForCausalLM.from_pretrained(name)` and
`AutoModelForImageTextToText.from_pretrained(name)` give an `OrtModelForCausalLM` where `name` (a folder,
or a Hub repository id, with `subfolder`) holds a GenAI package, and `AutoConfig.from_pretrained(name)`
that model's config; any other name loads as transformers loads it. `ortmodule run PROGRAM ...` runs a
program (lm-eval's `lm_eval`, lighteval, a script) with them on (programs.py).

transformers' loading keywords mean what they mean to `OrtModelForCausalLM.from_pretrained` (hf.py's
`loading_options`); besides, `revision`, `subfolder`, `cache_dir` (the Hub's cache, as transformers takes
it: not ortmodule's cache folder) and the fetching options find the package, `config` carries its
`output_attentions` / `output_hidden_states`, and `generation_config` replaces the package's.

`auto_classes()` patches this process; `ortmodule run` reaches the Python processes a program starts too
(`accelerate launch`'s workers: autoload/sitecustomize.py, first on their PYTHONPATH). Loads that
ortmodule itself makes inside a patched call go to transformers' own methods.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import transformers

from . import hf, hub
from .modeling import OrtModelForCausalLM
from .package import read_package

# The auto classes whose `from_pretrained` gives the model of a package (one class for text and images).
MODEL_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText")
# How transformers finds the files, taken here to find the package (`cache_dir`: the Hub's cache).
_FINDING = ("revision", "subfolder", "cache_dir", *sorted(hf.FETCHING))
# What transformers' auto classes pass along among themselves, without effect on a package.
_INTERNAL = ("_from_auto", "_from_pipeline", "_commit_hash", "code_revision")

_lock = threading.Lock()
_state = {"depth": 0, "originals": {}}
_inside = threading.local()  # a patched call under way on this thread: nested loads are transformers' own


def enable_auto_classes() -> None:
    """Patch transformers' auto classes (module docstring) until as many `disable_auto_classes()` calls."""
    with _lock:
        _state["depth"] += 1
        if _state["depth"] > 1:
            return
        for name in MODEL_CLASSES:
            cls = getattr(transformers, name)
            _state["originals"][name] = cls.__dict__.get("from_pretrained")
            cls.from_pretrained = classmethod(_model_loader(cls.from_pretrained.__func__))
        _state["originals"]["AutoConfig"] = transformers.AutoConfig.__dict__["from_pretrained"]
        transformers.AutoConfig.from_pretrained = classmethod(_config_loader(
            transformers.AutoConfig.from_pretrained.__func__))


def disable_auto_classes() -> None:
    """Undo one `enable_auto_classes()`; the last one restores transformers' methods."""
    with _lock:
        if _state["depth"] == 0:
            raise RuntimeError("disable_auto_classes() without enable_auto_classes(): the auto classes are not patched")
        _state["depth"] -= 1
        if _state["depth"] > 0:
            return
        for name, original in _state["originals"].items():
            cls = getattr(transformers, name)
            if original is None:  # the method was inherited: the class's own attribute goes
                del cls.from_pretrained
            else:
                cls.from_pretrained = original
        _state["originals"].clear()


@contextlib.contextmanager
def auto_classes():
    """`with ortmodule.auto_classes(): model = AutoModelForCausalLM.from_pretrained(package)`."""
    enable_auto_classes()
    try:
        yield
    finally:
        disable_auto_classes()


def package_folder(name, kwargs: dict, config_only: bool = False) -> Path | None:
    """The local folder of the package that `name` with transformers' finding keywords `kwargs` names
    (fetched from the Hub where it is a repository's: with `config_only`, its JSON files alone where it
    has a config.json), or None where it names no package."""
    if not isinstance(name, (str, Path)):
        return None
    fetching = {key: kwargs[key] for key in (*hf.FETCHING, "cache_dir") if kwargs.get(key) is not None}
    return hub.locate(name, kwargs.get("subfolder") or None, kwargs.get("revision"), config_only=config_only,
                      **fetching)


@contextlib.contextmanager
def _unpatched():
    """Loads made inside a patched call (ortmodule's own config, a checkpoint) are transformers'."""
    _inside.active = True
    try:
        yield
    finally:
        _inside.active = False


def _model_loader(original):
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if getattr(_inside, "active", False):
            return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        with _unpatched():
            folder = package_folder(pretrained_model_name_or_path, kwargs)
            if folder is None:
                return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)
            if model_args:
                raise TypeError(f"{cls.__name__}.from_pretrained({pretrained_model_name_or_path!r}, ...): a GenAI "
                                "package takes no positional model arguments (its model is the exported graph)")
            return _load_package(folder, kwargs)
    return from_pretrained


def _load_package(folder: Path, kwargs: dict) -> OrtModelForCausalLM:
    rest = {key: value for key, value in kwargs.items() if key not in (*_FINDING, *_INTERNAL)}
    config = rest.pop("config", None)
    generation_config = rest.pop("generation_config", None)
    for field in sorted(hf.CONFIG_FIELDS):  # a config passed in (AutoConfig's, changed) carries these
        if getattr(config, field, None) is True:
            rest.setdefault(field, True)
    model = OrtModelForCausalLM.from_pretrained(folder, **rest)
    if generation_config is not None:
        model.generation_config = generation_config
    return model


def _config_loader(original):
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        if getattr(_inside, "active", False):
            return original(cls, pretrained_model_name_or_path, **kwargs)
        with _unpatched():
            # As transformers reads a config: config.json alone where the package keeps its checkpoint's
            folder = package_folder(pretrained_model_name_or_path, kwargs, config_only=True)
            if folder is None:
                return original(cls, pretrained_model_name_or_path, **kwargs)
            config = hf.checkpoint_config(folder)
            if config is None:
                config = hf.build_config(read_package(folder))
            unused = {}
            for key, value in kwargs.items():  # config fields, as transformers sets them from its keywords
                if key in (*_FINDING, *_INTERNAL, "trust_remote_code", "return_unused_kwargs", "gguf_file"):
                    continue
                if hasattr(config, key):
                    setattr(config, key, value)
                else:
                    unused[key] = value
            return (config, unused) if kwargs.get("return_unused_kwargs") else config
    return from_pretrained

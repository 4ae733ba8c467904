"""A model named by its hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`), read from the local Hugging Face cache.

vLLM downloads such a model into --download-dir (default: the Hugging Face cache) at --revision (a branch, tag or
commit; default "main"). This engine never downloads: a model fetched before (`huggingface-cli download`, or an
earlier vLLM run) loads from that cache by the same name, flags and revision, and one not there is refused with
the command that fetches it. A path that exists is loaded as it is (vLLM ignores the revision there too).
"""

import os


def local_model_path(name: str, download_dir: str | None = None, revision: str | None = None,
                     field: str = "model") -> str:
    """`name` itself if it is a file or a directory, else the cached snapshot of the hub repository it names; a
    FileNotFoundError naming `field` when it is neither."""
    path = os.path.expanduser(name)
    if os.path.exists(path):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(name, revision=revision, cache_dir=download_dir, local_files_only=True)
    except HFValidationError:
        raise FileNotFoundError(f"{field}={name!r} is neither a .gguf file nor a checkpoint directory, nor a hub "
                                "repository's name") from None
    except LocalEntryNotFoundError:
        cache = download_dir or constants.HF_HUB_CACHE
        raise FileNotFoundError(
            f"{field}={name!r} is no file or directory here, and the Hugging Face cache {cache} holds no snapshot "
            f"of it at revision {revision or 'main'!r}. Models are never downloaded by this engine: fetch it first "
            f"(`huggingface-cli download {name}{f' --revision {revision}' if revision else ''}"
            f"{f' --cache-dir {download_dir}' if download_dir else ''}`), or give a path") from None

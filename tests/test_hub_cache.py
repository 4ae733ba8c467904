"""vLLM's hub names with --download-dir, --revision and --tokenizer-revision, read from a Hugging Face cache laid
out as huggingface_hub leaves it, never downloaded. Over HTTP: tests/test_server_vllm_fields.py serves its model by
a hub name."""

import pytest

from jax_engine.config import EngineArgs
from jax_engine.loader import load_engine_checkpoint
from jax_engine.loader.hub_cache import local_model_path
from tests.tiny_checkpoints import snapshot_in_hub_cache

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def cache(tiny_checkpoint_dir, templateless_checkpoint_dir, tmp_path_factory):
    """org/tiny at its main branch and tag v1; org/tiny at another commit (the templateless files) on branch dev."""
    cache = tmp_path_factory.mktemp("hub-cache")
    snapshot_in_hub_cache(cache, "org/tiny", tiny_checkpoint_dir, refs=("main", "v1"))
    snapshot_in_hub_cache(cache, "org/tiny", templateless_checkpoint_dir, refs=("dev",), commit=COMMIT)
    return cache


def test_a_hub_name_is_read_at_its_revision(cache):
    main = local_model_path("org/tiny", str(cache))
    assert main == local_model_path("org/tiny", str(cache), "v1") and main.endswith("0123456789abcdef" * 2 + "01234567")
    assert local_model_path("org/tiny", str(cache), "dev").endswith(COMMIT)
    assert local_model_path("org/tiny", str(cache), COMMIT).endswith(COMMIT)  # a commit names its snapshot
    assert local_model_path(str(cache)) == str(cache)  # a path that exists is taken as it is


def test_the_engine_loads_a_hub_name_and_its_tokenizer_at_their_revisions(cache, tiny_checkpoint):
    checkpoint = load_engine_checkpoint(EngineArgs(model="org/tiny", download_dir=str(cache), revision="dev",
                                                   tokenizer="org/tiny", tokenizer_revision="v1"))
    assert checkpoint.config.vocab_size == tiny_checkpoint.config.vocab_size
    assert checkpoint.tokenizer.chat_template == tiny_checkpoint.tokenizer.chat_template  # v1's, not dev's (none)
    plain = load_engine_checkpoint(EngineArgs(model="org/tiny", download_dir=str(cache), revision="dev"))
    assert not plain.tokenizer.chat_template


@pytest.mark.parametrize("name, revision, message", [
    ("org/absent", None, r"holds no snapshot of it at revision 'main'.*`huggingface-cli download org/absent "
                         r"--cache-dir .*`"),
    ("org/tiny", "v2", r"at revision 'v2'.*`huggingface-cli download org/tiny --revision v2 --cache-dir"),
    ("not a name!", None, "is neither a .gguf file nor a checkpoint directory, nor a hub repository's name"),
])
def test_a_model_not_in_the_cache_is_refused_saying_how_to_fetch_it(cache, name, revision, message):
    with pytest.raises(FileNotFoundError, match=f"model={name!r}.*{message}"):
        load_engine_checkpoint(EngineArgs(model=name, download_dir=str(cache), revision=revision))
    with pytest.raises(FileNotFoundError, match=f"tokenizer={name!r}"):
        load_engine_checkpoint(EngineArgs(model="org/tiny", download_dir=str(cache), tokenizer=name,
                                          tokenizer_revision=revision))

"""Loading a model's tokenizer (HF folder or GGUF) and the facts the engine needs from it."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mmserve.errors import UnsupportedModel

# Files whose presence marks a folder as a Hugging Face tokenizer folder.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def resolve_tokenizer_source(
    path: str | Path, gguf_file: str | None = None
) -> tuple[Path, str | None]:
    """Turn ModelConfig.model into (folder, gguf file name or None).

    Accepts an HF folder, a `.gguf` file, or a folder holding exactly one `.gguf` and no HF
    tokenizer files. Raises FileNotFoundError naming what was looked for.
    """
    path = Path(path)
    if gguf_file is not None:
        return path, gguf_file
    if path.is_file():
        if path.suffix != ".gguf":
            raise FileNotFoundError(f"{path}: expected a folder or a .gguf file")
        return path.parent, path.name
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such folder or .gguf file")
    if any((path / name).is_file() for name in _HF_TOKENIZER_FILES):
        return path, None
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) != 1:
        raise FileNotFoundError(
            f"{path}: expected {' or '.join(_HF_TOKENIZER_FILES)} or exactly one .gguf, "
            f"found {len(ggufs)} .gguf files"
        )
    return path, ggufs[0]


def load_tokenizer(
    path_or_folder: str | Path, gguf_file: str | None = None
) -> PreTrainedTokenizerFast:
    """Load a fast (Rust-backed) tokenizer from local files only.

    Remote code is never run and the hub is never contacted. A slow (pure Python) tokenizer
    is refused because streaming detokenisation needs the Rust backend (`DecodeStream`).
    Note: reading the tokenizer out of a GGUF parses its whole metadata in Python, which
    takes seconds for a 50k vocabulary; an HF folder loads in well under a second.
    """
    folder, gguf_name = resolve_tokenizer_source(path_or_folder, gguf_file)
    with _gguf_alone(folder, gguf_name) as folder:
        tokenizer = AutoTokenizer.from_pretrained(
            str(folder),
            gguf_file=gguf_name,
            trust_remote_code=False,
            local_files_only=True,
        )
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise UnsupportedModel(
            f"{path_or_folder}: tokenizer {type(tokenizer).__name__} has no fast (tokenizers) "
            "backend; streaming detokenisation needs one"
        )
    return tokenizer


@contextlib.contextmanager
def _gguf_alone(folder: Path, gguf_name: str | None) -> Iterator[Path]:
    """folder, or, for a GGUF beside an HF tokenizer's files, a temporary folder holding only a
    link to the GGUF. Given gguf_file, transformers still reads the folder's tokenizer.json and
    tokenizer_config.json, and then drops the GGUF's bos, eos and chat template;
    convert_hf_to_gguf.py writes its GGUF into the HF folder unless told otherwise."""
    if gguf_name is None or not any((folder / name).is_file() for name in _HF_TOKENIZER_FILES):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="mmserve-gguf-") as alone:
        (Path(alone) / gguf_name).symlink_to((folder / gguf_name).resolve())
        yield Path(alone)


def eos_token_ids(
    tokenizer: PreTrainedTokenizerFast, generation_eos: int | Iterable[int] | None = None
) -> tuple[int, ...]:
    """All token ids that end generation: the tokenizer's eos plus generation_config's.

    Chat models often end a turn with a token (e.g. `<|eot_id|>`) that only
    generation_config.json lists, so both sources are needed. Sorted, no duplicates.
    """
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos is not None:
        ids.update(int(i) for i in generation_eos)
    return tuple(sorted(ids))


def vocab_size(tokenizer: PreTrainedTokenizerFast) -> int:
    """Number of token ids the tokenizer can produce, added/special tokens included.

    The model's embedding table may be larger (padded); ids in between are valid for the
    model but never produced by the tokenizer.
    """
    return len(tokenizer)

"""The job's data source from its config ([training] dataset, token_dtype, tokenizer, dataset_column, data_order,
eval_fraction, data_source): opened by any worker that loads micro-batches, and checked once per job, before any
worker starts, so that bad data gets one message rather than one per worker."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from recycle.data.corpus import builtin_corpus
from recycle.data.encode import CACHE_DTYPE, encode_hf_dataset, encode_text_file, is_hf_dataset
from recycle.data.source import DataSource, check_microbatch, load_data_source
from recycle.data.tokens import TokenStream, check_utf8, check_vocab, open_text_bytes, open_token_file, stream_of_bytes
from recycle.data.windows import TokenWindows
from recycle.errors import ConfigError

if TYPE_CHECKING:
    from recycle.config import Config

__all__ = ["BUILTIN", "data_source", "check_data", "config_stream"]

BUILTIN = "builtin"


def _path(config: Config, key: str) -> Path:
    """A [training] path key's file: as given, or (relative and not found) beside the config file."""
    name = getattr(config.training, key)
    path = Path(name)
    base = os.path.dirname(config.source)
    if not path.is_absolute() and base and not path.exists():
        path = Path(base) / path
    return path


def config_stream(config: Config) -> TokenStream:
    """The config's corpus as a token stream: the built-in corpus, a token file, a Hugging Face dataset on disk, or
    a text file (its UTF-8 bytes, or its tokens through a local tokenizer)."""
    t = config.training
    where = f"[training] dataset = {t.dataset!r}"
    if t.dataset == BUILTIN:
        if t.token_dtype or t.tokenizer or t.dataset_column:
            raise ConfigError(f"{where} is byte-level text; token_dtype, tokenizer and dataset_column apply to your "
                              "own files: drop them or name a dataset file")
        return stream_of_bytes(builtin_corpus(), BUILTIN)
    path = _path(config, "dataset")
    if str(path) != t.dataset:
        where += f" ({path})"
    tokenizer = _path(config, "tokenizer") if t.tokenizer else None
    if tokenizer is not None and not tokenizer.is_file():
        raise ConfigError(f"[training] tokenizer = {t.tokenizer!r} is not a file; give the path of a local "
                          "tokenizer.json (nothing is downloaded)")
    if is_hf_dataset(path):
        if t.token_dtype:
            raise ConfigError(f"{where} is a Hugging Face dataset folder, whose column types say how ids are "
                              "stored; drop [training] token_dtype")
        cached, column = encode_hf_dataset(path, t.dataset_column, tokenizer, where)
        return replace(open_token_file(cached, CACHE_DTYPE, where), source=f"{path} (column {column!r})")
    if not path.is_file():
        raise ConfigError(f"{where} is not a file; give a UTF-8 text file, a token file (with token_dtype), a "
                          "Hugging Face dataset folder (save_to_disk) or \"builtin\"")
    if t.dataset_column:
        raise ConfigError(f"[training] dataset_column = {t.dataset_column!r} names a column of a Hugging Face dataset "
                          f"folder, but {str(path)!r} is a file; drop dataset_column")
    if t.token_dtype:
        if tokenizer is not None:
            raise ConfigError(f"{where}: token_dtype reads it as token ids and tokenizer encodes it as text; give "
                              "one of the two")
        return open_token_file(path, t.token_dtype, where)
    if tokenizer is not None:
        return replace(open_token_file(encode_text_file(path, tokenizer, where), CACHE_DTYPE, where),
                       source=f"{path} (tokenized)")
    if path.suffix == ".bin":
        raise ConfigError(f"{where} looks like a token file (.bin); give [training] token_dtype = 'uint16' "
                          "or 'uint32' (the width its ids were written with), or use a UTF-8 text file")
    return open_text_bytes(path)


def data_source(config: Config, split: str = "train") -> DataSource:
    """The job's DataSource: the user's [training] data_source (--data-source), or windows of the config's corpus.
    Opening maps the corpus; nothing of it is read until a micro-batch is."""
    t = config.training
    if t.data_source:
        if split != "train":
            raise ConfigError(f"a --data-source ({t.data_source!r}) has no held-out split; evaluate with the built-in "
                              "sources' [training] eval_fraction")
        return load_data_source(t.data_source)(config)
    return _windows(config, split)


def _windows(config: Config, split: str) -> TokenWindows:
    t, w = config.training, config.workload
    return TokenWindows(config_stream(config), w.microbatch_size, w.seq_len,
                        config.num_replicas * config.num_microbatches, t.data_order, t.seed, t.eval_fraction, split)


def _vocab_size(config: Config, model_factory: str) -> int | None:
    """The vocabulary of the model the job trains (None: a factory's model, which recycle cannot see into)."""
    if model_factory:
        return None
    if config.model.hf_config:
        from recycle.models.hf import load_hf_config, resolve_hf_path

        path = resolve_hf_path(config.model.hf_config, os.path.dirname(config.source) or None)
        return int(load_hf_config(path, config.workload.seq_len).vocab_size)
    from recycle.models.gpt import resolve_shape

    return resolve_shape(config.model, config.workload.seq_len).vocab_size


def _check_eval(config: Config) -> None:
    """An evaluation's micro-batches fit the message tags, and the held-out split holds a window."""
    t = config.training
    if not t.eval_every:
        return
    from recycle.runtime.worker.evaluation import MAX_EVAL_MICROBATCHES

    count = t.eval_batches * config.num_replicas * config.num_microbatches
    if count > MAX_EVAL_MICROBATCHES:
        raise ConfigError(f"[training] eval_batches = {t.eval_batches} makes an evaluation of {count:,} micro-batches "
                          f"(x {config.num_replicas} x {config.num_microbatches} per batch), over the "
                          f"{MAX_EVAL_MICROBATCHES:,} its messages can number; use fewer eval_batches")
    _windows(config, "eval")  # a held-out split too short for one window is refused here


def check_data(config: Config, model_factory: str = "") -> None:
    """Everything about the data that can be wrong, once per job: the file, its length, its encoding or its ids
    against the model's vocabulary (scanned in chunks, so memory stays flat), and a user's source's first answer."""
    if config.training.data_source:
        check_microbatch(data_source(config)(0, 0), f"data source {config.training.data_source!r}")
        return
    _check_eval(config)
    stream = _windows(config, "train").stream
    where = f"[training] dataset = {config.training.dataset!r}"
    if stream.unit == "bytes":
        if stream.source != BUILTIN:
            check_utf8(stream, where)
        return
    vocab = _vocab_size(config, model_factory)
    if vocab is not None:
        check_vocab(stream, vocab, where)

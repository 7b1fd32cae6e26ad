"""Training data: token streams on disk (memory-mapped), the sources that cut them into micro-batches, and the
`DataSource` protocol a user's own source follows."""

from recycle.data.corpus import builtin_corpus
from recycle.data.source import DataSource, load_data_source, source_name
from recycle.data.tokens import TokenStream
from recycle.data.windows import TokenWindows, builtin_windows

__all__ = ["DataSource", "TokenStream", "TokenWindows", "builtin_corpus", "builtin_windows", "load_data_source",
           "source_name"]

"""Built-in models and their stage partitioning."""

"""CLI commands, one module each: register(subparsers) adds the parser and sets func(args) -> exit code."""

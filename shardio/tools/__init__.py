"""The `shardio` command and what it runs: info, preview, the loader benchmark; the CLIs' one look."""

"""Inputs: telling a tar, a Parquet file, a folder or a Python source apart, listing them and reading their samples."""

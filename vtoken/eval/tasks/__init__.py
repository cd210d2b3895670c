"""The lmms-eval task pack (YAML + glue): pass this directory to `--include_path`."""

"""Build: one Dask task per split (read, tokenize, write a chunk); the driver commits to the catalog."""

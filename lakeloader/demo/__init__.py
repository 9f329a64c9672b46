"""Demo data: generated corpora for `make demo`, the notebooks and the tests (not used by the pipeline)."""

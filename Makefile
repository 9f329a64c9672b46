# The README's two commands: `make demo` and `make test`. Both create the virtual environment
# (.venv) on first use and install lakeloader with the pinned versions of constraints.txt.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu

.PHONY: demo test install clean bench

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m lakeloader.demo.corpus prepare demo/data
	$(BIN)/lakeloader build configs/demo.yaml
	$(BIN)/lakeloader sql configs/demo.yaml "SELECT name, num_shards, num_chunks, num_docs, num_tokens, round(num_tokens / num_docs) AS tokens_per_doc, num_rejects FROM datasets ORDER BY name"
	$(BIN)/lakeloader sql configs/demo.yaml "SELECT dataset, count(*) AS chunks, sum(num_bytes)::BIGINT AS chunk_bytes, max(num_tokens) AS max_chunk_tokens FROM chunks GROUP BY dataset ORDER BY dataset"
	$(BIN)/python examples/stream_to_jax.py configs/demo.yaml --steps 20
	$(BIN)/python -m lakeloader.demo.formats prepare demo/data
	$(BIN)/lakeloader build configs/formats.yaml
	$(BIN)/python -m lakeloader.demo.formats show configs/formats.yaml
	$(BIN)/python -m lakeloader.demo.images demo/data/images
	$(BIN)/lakeloader build configs/images.yaml
	$(BIN)/lakeloader sql configs/images.yaml "SELECT dataset, count(*) AS images, count(DISTINCT image_id) AS distinct_images, round(avg(width)) AS avg_width, round(avg(height)) AS avg_height, sum(num_bytes)::BIGINT AS bytes FROM images GROUP BY dataset ORDER BY dataset"

# Two pytest-xdist workers: the tests are isolated (own lakes, caches, servers), and on 2 cores
# the suite takes ~9 minutes instead of ~15.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n logical --maxprocesses 2

bench: $(STAMP)
	$(BIN)/python benchmarks/build_throughput.py
	$(BIN)/python benchmarks/tokenizer_backends.py
	$(BIN)/python benchmarks/loader_throughput.py
	$(BIN)/python benchmarks/loader_start.py
	$(BIN)/python benchmarks/jax_feed.py
	$(BIN)/python benchmarks/loader_workers.py
	$(BIN)/python benchmarks/build_scaling.py
	$(BIN)/python benchmarks/driver_commits.py
	$(BIN)/python benchmarks/integrity_overhead.py
	$(BIN)/python benchmarks/packing.py
	$(BIN)/python benchmarks/selection.py
	$(BIN)/python benchmarks/documents_index.py
	$(BIN)/python benchmarks/status_stats.py

clean:
	rm -rf demo/lake demo/formats-lake demo/data benchmarks/out

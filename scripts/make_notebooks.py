"""Write the notebooks in notebooks/ from the cell sources below and execute them in place.

    .venv/bin/python scripts/make_notebooks.py [--no-execute]

The committed notebooks carry the outputs of a clean run on the demo lake (run `make demo`'s
corpus step first; notebook 01 builds the lake). tests/test_notebooks.py executes them again.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parents[1] / "notebooks"

SETUP = '''\
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")  # keep Dask's own INFO logs out
CONFIG = os.environ.get("LAKELOADER_DEMO_CONFIG", "../configs/demo.yaml")
DATA = os.environ.get("LAKELOADER_DEMO_DATA", "../demo/data")'''

NOTEBOOKS: dict[str, list[tuple[str, str]]] = {
    "01_build_lake": [
        ("markdown", "# 1. Build a lake\n\nFrom a YAML config to a tokenized Parquet lake with a DuckDB "
                     "catalog, built by a local Dask cluster. Re-running the build resumes: committed "
                     "chunks are never tokenized again."),
        ("code", SETUP),
        ("code", "import logging\nimport lakeloader\nfrom lakeloader.demo.corpus import prepare_corpus\n\n"
                 "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')"),
        ("markdown", "The demo corpus is real text from the Python standard library: source files "
                     "(`code`), help topics and docstrings (`docs`) and plain text lines (`notes`)."),
        ("code", "corpus = prepare_corpus(DATA)\n{name: [p.name for p in files] for name, files in corpus.items()}"),
        ("code", "config = lakeloader.load_config(CONFIG)\nprint(open(CONFIG).read())"),
        ("markdown", "`build_lake` plans every dataset, prints the Dask dashboard address, shows a progress "
                     "bar with chunks, documents and tokens/s, and returns a report."),
        ("code", "report = lakeloader.build_lake(config, workers=2)\nreport"),
        ("code", "print(f'{report.tokens:,} tokens in {report.seconds:.1f}s = {report.tokens_per_s:,.0f} tokens/s')\n"
                 "lake = lakeloader.open_lake(config)\nlake.status()['datasets']"),
        ("markdown", "A second build finds nothing to do:"),
        ("code", "lakeloader.build_lake(config, workers=2, progress=False).chunks_built"),
    ],
    "02_catalog_sql": [
        ("markdown", "# 2. Ask the catalog\n\nThe catalog is a DuckDB database: `lake.sql` returns pandas "
                     "DataFrames. Tables: `datasets`, `shards`, `chunks`, `row_groups`, `rejects`, `builds`."),
        ("code", SETUP),
        ("code", "import matplotlib.pyplot as plt\nimport lakeloader\n\n"
                 "lake = lakeloader.open_lake(CONFIG)\n"
                 "lake.sql('SELECT name, num_shards, num_chunks, num_docs, num_tokens, num_rejects FROM datasets ORDER BY name')"),
        ("markdown", "## Tokens per dataset"),
        ("code", "tokens = lake.sql('SELECT name, num_tokens FROM datasets ORDER BY num_tokens DESC')\n"
                 "ax = tokens.plot.bar(x='name', y='num_tokens', legend=False, title='tokens per dataset')\n"
                 "ax.set_ylabel('tokens');"),
        ("markdown", "## Documents\n\nThe `documents` view has one row per document of the committed chunks: "
                     "`dataset, chunk, doc` (its place in the chunk file), `source, line` (where it came from), "
                     "`num_tokens`, `num_parts`, a `tokens_<kind>` column per part kind, and one column per "
                     "metadata field (`metadata_fields` in the config). It reads only the columns a query "
                     "needs, never the tokens."),
        ("code", "lake.sql('SELECT dataset, source, count(*) AS documents, sum(num_tokens) AS tokens, "
                 "max(num_tokens) AS longest FROM documents GROUP BY ALL ORDER BY dataset, source LIMIT 8')"),
        ("markdown", "`lake.stats()` (or `lakeloader stats CONFIG [--by FIELD]`) gives documents, tokens and "
                     "length percentiles per dataset:"),
        ("code", "lake.stats()"),
        ("markdown", "## Document lengths\n\nA histogram in SQL: documents per quarter-octave of length, per "
                     "dataset (a few hundred rows, however many documents). `lakeloader stats CONFIG --plot "
                     "FILE.png` draws the same."),
        ("code", "hist = lake.sql('SELECT dataset, floor(log2(greatest(num_tokens, 1)) * 4) / 4 AS log2_len, "
                 "count(*) AS documents FROM documents GROUP BY ALL ORDER BY ALL')\n"
                 "fig, axes = plt.subplots(1, hist.dataset.nunique(), figsize=(12, 3))\n"
                 "for ax, (name, group) in zip(axes, hist.groupby('dataset')):\n"
                 "    left = 2.0 ** group.log2_len\n"
                 "    ax.bar(left, group.documents, width=left * (2 ** 0.25 - 1), align='edge')\n"
                 "    ax.set_xscale('log')\n"
                 "    ax.set_xlabel('document length (tokens)')\n"
                 "    ax.set_title(f'{name}: {group.documents.sum():,} documents')\n"
                 "axes[0].set_ylabel('documents')\n"
                 "fig.tight_layout()"),
        ("markdown", "## Shard progress and the global order"),
        ("code", "lake.sql('SELECT dataset, shard_index, source, status, num_splits, chunks_done, docs_done, tokens_done FROM shards ORDER BY dataset, shard_index')"),
        ("code", "lake.sql(\"SELECT global_index, shard_index, split_index, num_docs, num_tokens FROM chunks WHERE dataset = 'code' ORDER BY global_index LIMIT 12\")"),
        ("markdown", "Cumulative offsets (what a seek binary-searches) and the builds:"),
        ("code", "lake.sql(\"SELECT dataset, global_index, first_doc, first_token, num_tokens FROM chunk_offsets WHERE dataset = 'docs' LIMIT 5\")"),
        ("code", "lake.sql('SELECT build_id, status, workers, chunks_built, tokens, round(tokens_per_s) AS tokens_per_s FROM builds')"),
    ],
    "03_stream_to_jax": [
        ("markdown", "# 3. Stream into JAX\n\nGlobal `jax.Array` batches sharded over a device mesh; "
                     "each process reads only the rows its devices hold."),
        ("code", SETUP),
        ("code", "import time\nimport jax\nimport numpy as np\nimport matplotlib.pyplot as plt\n"
                 "from jax.sharding import Mesh, PartitionSpec\nfrom tokenizers import Tokenizer\n"
                 "from lakeloader import JaxFeed\n\n"
                 "mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('data', 'model'))\n"
                 "feed = JaxFeed(CONFIG, mesh, PartitionSpec('data', None))\nmesh"),
        ("code", "batch = feed.batch(0)\n{name: (a.shape, a.dtype, a.sharding.spec) for name, a in batch.items()}"),
        ("markdown", "Each row's dataset, as its position in `loader.dataset_names` (log the loss per dataset "
                     "with it):"),
        ("code", "names = feed.loader.dataset_names\n"
                 "[names[i] for i in np.asarray(batch['dataset_ids'])[:8]]"),
        ("markdown", "Decode the first row: documents come from the lake without special tokens; "
                     "EOS is added at collation."),
        ("code", "lake = feed.loader.lake\n"
                 "tokenizer_path = lake.sql('SELECT tokenizer_path FROM dataset_plans LIMIT 1').tokenizer_path[0]\n"
                 "tokenizer = Tokenizer.from_file(lake.path_of(tokenizer_path))\n"
                 "print(tokenizer.decode(np.asarray(batch['input_ids'][0])[:160].tolist(), skip_special_tokens=False))"),
        ("code", "fig, ax = plt.subplots(2, 1, figsize=(12, 4), sharex=True)\n"
                 "ax[0].imshow(np.asarray(batch['segment_ids']), aspect='auto', interpolation='nearest')\n"
                 "ax[0].set_title('segment_ids (one colour per document)')\n"
                 "ax[1].imshow(np.asarray(batch['positions']), aspect='auto', interpolation='nearest')\n"
                 "ax[1].set_title('positions (restart at each document)'); fig.tight_layout()"),
        ("markdown", "## Where did a row come from?"),
        ("code", "feed.loader.explain(0).query('row == 0')[['dataset', 'epoch', 'chunk', 'source', 'location', 'example_start', 'example_stop']]"),
        ("markdown", "## Throughput, and an instant seek"),
        ("code", "steps, started = 50, time.perf_counter()\n"
                 "for _, b in zip(range(steps), feed.iter_from(0)):\n"
                 "    jax.block_until_ready(b)\n"
                 "seconds = time.perf_counter() - started\n"
                 "tokens = steps * b['input_ids'].size\n"
                 "print(f'{steps / seconds:.0f} steps/s, {tokens / seconds:,.0f} tokens/s')\n"
                 "started = time.perf_counter(); far = feed.batch(10**6)\n"
                 "print(f'batch 1,000,000 after {(time.perf_counter() - started) * 1e3:.0f} ms')"),
        ("markdown", "Save and restore: the loader state is a small JSON dict (the step, the fingerprint and "
                     "definition of the config's batches, the mixture the run has followed)."),
        ("code", "import json\nstate = feed.state(7)\nprint(state['step'], state['fingerprint'], sorted(state), "
                 "len(json.dumps(state)), 'bytes')\nrestored = next(feed.restore(state))\n"
                 "all(np.array_equal(restored[k], feed.batch(7)[k]) for k in restored)"),
        ("code", "feed.close()"),
    ],
    "04_audit_mixture": [
        ("markdown", "# 4. Audit a mixture\n\nWhich dataset fills each position of each batch is a closed-form "
                     "function of (seed, step): every whole-batch prefix of a stage stays within 2 examples of "
                     "the target per dataset, and tiny weights never vanish. The build registers the config's "
                     "mixture in the catalog, so the plan is also plain SQL."),
        ("code", SETUP),
        ("code", "import tempfile\nfrom IPython.display import Image\nimport lakeloader\n"
                 "from lakeloader.catalog.audit import audit, mixture_plan\nfrom lakeloader.report.audit_plot import plot_audit\n"
                 "from lakeloader.specs import mixture_spec\n\n"
                 "config = lakeloader.load_config(CONFIG)\nconfig.mixture"),
        ("markdown", "## Target vs realized over steps 0..999\n\nStep ranges are half-open everywhere: "
                     "`audit(CONFIG, 0, 1000)` in Python, `--steps 0:1000` on the command line and "
                     "`mixture_plan(id, 0, 1000)` in SQL all mean steps 0..999."),
        ("code", "audit(CONFIG, 0, 1000)"),
        ("code", "png = tempfile.mktemp(suffix='.png')\nplot_audit(CONFIG, 0, 1000, png)\nImage(png)"),
        ("markdown", "## The same in SQL\n\n`mixture_plan(id, first, stop)` gives, per step `first..stop-1` "
                     "and dataset, how many examples it contributed and which ones (`[before, after)` of its "
                     "stream); `mixture_proportions` aggregates a range."),
        ("code", "lake = lakeloader.open_lake(CONFIG)\nmixture_id = mixture_spec(config).mixture_id\n"
                 "lake.sql(f\"SELECT * FROM mixtures WHERE mixture_id = '{mixture_id}'\")"),
        ("code", "lake.sql(f\"SELECT step, dataset, examples, before, after, deviation FROM mixture_plan('{mixture_id}', 5, 7) ORDER BY step, dataset\")"),
        ("code", "lake.sql(f\"SELECT dataset, target_weight, share, examples, max_deviation FROM mixture_proportions('{mixture_id}', 0, 100000)\")"),
        ("markdown", "What fed step 5, row by row (the loader's own view):"),
        ("code", "from lakeloader import Loader\n"
                 "with Loader(CONFIG) as loader:\n"
                 "    rows = loader.explain(5).groupby('row').first()[['dataset', 'epoch', 'example', 'source', 'location']]\n"
                 "rows.head(8)"),
    ],
    "05_images": [
        ("markdown", "# 5. Images in the lake, pixels in the batch\n\nAn interleaved dataset with `images: stored` "
                     "keeps each image's bytes in the lake beside its chunk; the loader decodes and resizes the "
                     "images a batch's rows place into fixed-shape uint8 arrays (`pixel_values` under a `fixed` "
                     "resolution), next to the tokens, with `image_positions` saying where each image's placeholder "
                     "run starts in its row."),
        ("code", SETUP),
        ("code", "import tempfile\nfrom pathlib import Path\n\nimport matplotlib.pyplot as plt\nimport numpy as np\n"
                 "import yaml\n\nimport lakeloader\nfrom lakeloader.demo.images import write_image_corpus\n\n"
                 "root = Path(tempfile.mkdtemp())\n"
                 "files = write_image_corpus(root / 'data')   # matplotlib's sample images and icons, Pillow-made ones\n"
                 "interleaved = {'images': 'stored', 'image_tokens': 16, 'max_images': 4,\n"
                 "               'resolution': {'kind': 'fixed', 'size': [96, 96]}}\n"
                 "config = {'lake': str(root / 'lake'), 'tokenizer': str(Path('../demo/tokenizer.json').resolve()),\n"
                 "          'datasets': {'images': {'sources': [str(p) for p in files['tar']], 'format': 'interleaved',\n"
                 "                                  'interleaved': interleaved}},\n"
                 "          'build': {'split_size': '64KB'},\n"
                 "          'loader': {'seq_len': 256, 'batch_size': 8, 'packing': 'pack', 'shuffle': {'kind': 'none'}}}\n"
                 "path = root / 'images.yaml'\npath.write_text(yaml.safe_dump(config))\n"
                 "lakeloader.build_lake(path, workers=1, progress=False).chunks_built"),
        ("code", "loader = lakeloader.Loader(path)\nbatch = loader.batch(0)\n"
                 "{name: (a.shape, str(a.dtype)) for name, a in batch.items()}"),
        ("markdown", "Each image of the batch with the text of its document (the image placeholders left out): "
                     "the pixels are the image resized to fit 96 x 96 keeping its aspect, at the top left."),
        ("code", "image_token = loader.tokenizer.token_to_id('<|image|>')\n"
                 "placed = np.argwhere(batch['image_mask'])[:12]\n"
                 "fig, axes = plt.subplots(3, 4, figsize=(12, 9.5))\n"
                 "for ax, (row, number) in zip(axes.flat, placed):\n"
                 "    position = batch['image_positions'][row, number]\n"
                 "    document = batch['segment_ids'][row] == batch['segment_ids'][row, position]\n"
                 "    ids = [int(t) for t in batch['input_ids'][row][document] if t != image_token]\n"
                 "    text = loader.tokenizer.decode(ids).strip()\n"
                 "    ax.imshow(batch['pixel_values'][row, number])\n"
                 "    ax.set_title(f'row {row}, image {number}\\n{text[:34]}', fontsize=9)\n"
                 "    ax.set_xlabel('x (pixels)'); ax.set_ylabel('y (pixels)')\n"
                 "for ax in axes.flat[len(placed):]:\n"
                 "    ax.axis('off')\n"
                 "fig.suptitle('batch 0: each image as the loader placed it, with its document\\'s text')\n"
                 "fig.tight_layout()"),
        ("code", "loader.close()"),
    ],
}


def write(name: str, cells: list[tuple[str, str]]) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
                      for kind, src in cells]
    path = HERE / f"{name}.ipynb"
    nbformat.write(notebook, path)
    return path


def execute(path: Path, cwd: Path | None = None) -> None:
    """Run a notebook top to bottom and save its outputs in place."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(cwd or path.parent)}}).execute()
    nbformat.write(notebook, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-execute", action="store_true")
    args = parser.parse_args()
    for name, cells in NOTEBOOKS.items():
        path = write(name, cells)
        if not args.no_execute:
            execute(path)
        print(path)


if __name__ == "__main__":
    main()

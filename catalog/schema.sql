-- lakeloader catalog schema. One DuckDB database per lake; the build driver is its only writer.
-- Tables hold what was planned and what was committed; catalog/views.sql derives progress from them.

CREATE TABLE IF NOT EXISTS lake_meta (
    key   VARCHAR PRIMARY KEY,
    value VARCHAR NOT NULL
);

-- One row per dataset: the plan currently in force (a changed config replaces it).
CREATE TABLE IF NOT EXISTS dataset_plans (
    name           VARCHAR PRIMARY KEY,
    fingerprint    VARCHAR NOT NULL,       -- hash of sources, tokenizer, encoder, format, fields, split size
    format         VARCHAR NOT NULL,       -- text | chat | supervised | fim | infill | interleaved
    fields         VARCHAR[] NOT NULL,     -- part kinds: text | roles (chat) | prompt, response | text, image
    chunk_dir      VARCHAR NOT NULL,       -- folder of the chunk files, relative to the lake root
    tokenizer_path VARCHAR NOT NULL,       -- the lake's copy of the tokenizer, relative to the lake root
    token_type     VARCHAR NOT NULL,       -- uint16 | uint32: fits the vocabulary
    vocab_size     INTEGER NOT NULL,
    split_size     BIGINT NOT NULL,
    on_error       VARCHAR NOT NULL,       -- raise | skip
    planned_at     TIMESTAMP NOT NULL,
    encoder        VARCHAR                 -- what encoded the chunks, with its version: "fastokens 0.3.5",
                                           -- "tokenizers 0.23.3" (part of the fingerprint)
);
-- Catalogs created before the encoder was recorded (NULL: tokenizers, version unknown).
ALTER TABLE dataset_plans ADD COLUMN IF NOT EXISTS encoder VARCHAR;
-- A dataset defined by a filter (config keys from, where): its source dataset and predicate
-- (NULL for a dataset built from sources). Its chunks are its source's files, one to one in the
-- same global order, with counts over the selected documents; its fingerprint hashes the
-- source's and the normalized predicate.
ALTER TABLE dataset_plans ADD COLUMN IF NOT EXISTS source_dataset VARCHAR;
ALTER TABLE dataset_plans ADD COLUMN IF NOT EXISTS selection VARCHAR;

-- What each config's definition of a dataset name was last planned as: a name is a config's label,
-- a plan its definition's fingerprint, and the lake holds one plan per name at a time (in
-- dataset_plans). A reader of a config reads the lake's plan of a name only if the row of its own
-- definition names that plan (catalog/identity.py). One row per (name, definition), replaced by
-- each build of it. Datasets defined by a filter have none (their plan's fingerprint is checked
-- against their source's and predicate instead).
CREATE TABLE IF NOT EXISTS dataset_definitions (
    dataset     VARCHAR NOT NULL,
    definition  VARCHAR NOT NULL,          -- hash of the config's definition (plan.planner.definition_fingerprint)
    fingerprint VARCHAR NOT NULL,          -- the plan its last build made of it
    config      VARCHAR,                   -- the config file that built it (NULL: a Config object)
    recorded_at TIMESTAMP NOT NULL,
    PRIMARY KEY (dataset, definition)
);

-- Plans grown append-only (plan/growth.py): a dataset's files were its built plan's, unchanged, plus
-- new ones, so the grown plan keeps that plan's chunks at their global indexes and appends the new
-- files' chunks. One row per growth, kept while later plans replace the dataset's (a run that read
-- an older plan follows the chain from it to the plan in force: feed/run_state.py).
CREATE TABLE IF NOT EXISTS plan_growth (
    dataset       VARCHAR NOT NULL,
    fingerprint   VARCHAR NOT NULL,        -- the grown plan
    extends       VARCHAR NOT NULL,        -- the plan it grew from
    chunks_before BIGINT NOT NULL,         -- that plan's chunks: global indexes 0 .. chunks_before - 1
    grown_at      TIMESTAMP NOT NULL,
    PRIMARY KEY (dataset, fingerprint)
);

-- One row per input file of a dataset, in shard order.
CREATE TABLE IF NOT EXISTS shard_plans (
    dataset     VARCHAR NOT NULL,
    shard_index INTEGER NOT NULL,
    source      VARCHAR NOT NULL,          -- path or URL of the file
    layout      VARCHAR NOT NULL,          -- jsonl | text | parquet
    compression VARCHAR,                   -- gzip | zstd | NULL
    size_bytes  BIGINT NOT NULL,
    version     VARCHAR NOT NULL,          -- mtime or ETag seen at planning
    num_splits  INTEGER NOT NULL,
    source_raw  BLOB,                      -- exact bytes of source (file names that are not UTF-8
                                           -- show as \xNN in source; the build reads this one)
    PRIMARY KEY (dataset, shard_index)
);
-- Catalogs created before source_raw existed.
ALTER TABLE shard_plans ADD COLUMN IF NOT EXISTS source_raw BLOB;

-- One row per chunk, inserted at planning in global order; the build fills in the rest.
CREATE TABLE IF NOT EXISTS chunks (
    dataset      VARCHAR NOT NULL,
    global_index BIGINT NOT NULL,          -- position in the dataset's global chunk order
    shard_index  INTEGER NOT NULL,
    split_index  INTEGER NOT NULL,
    path         VARCHAR NOT NULL,         -- chunk file, relative to the lake root
    split_kind   VARCHAR NOT NULL,         -- bytes | row_group | file
    split_start  BIGINT NOT NULL,          -- first byte, or row group index
    split_stop   BIGINT NOT NULL,          -- end byte (exclusive), or row group index + 1
    first_row    BIGINT NOT NULL,          -- Parquet: file row of the row group's first row
    status       VARCHAR NOT NULL DEFAULT 'planned',   -- planned | committed
    num_docs     BIGINT,
    num_tokens   BIGINT,
    num_records  BIGINT,                   -- lines/rows of the split, usable or not
    num_bytes    BIGINT,                   -- size of the chunk file
    checksum     VARCHAR,                  -- sha256 of the chunk file
    num_rejects  INTEGER,
    source_bytes BIGINT,                   -- bytes of input read (decompressed)
    build_id     INTEGER,
    worker       VARCHAR,
    seconds      DOUBLE,
    committed_at TIMESTAMP,
    num_parts    BIGINT[],                 -- parts of each kind (dataset_plans.fields order)
    part_tokens  BIGINT[],                 -- stored tokens of each kind
    PRIMARY KEY (dataset, global_index)
);

-- A chunk's media file (<chunk>.media.parquet, interleaved.images: stored; NULL: none): its size
-- and sha256, checked and repaired like the chunk file's.
ALTER TABLE chunks ADD COLUMN IF NOT EXISTS media_bytes BIGINT;
ALTER TABLE chunks ADD COLUMN IF NOT EXISTS media_checksum VARCHAR;

-- The images of committed chunks of datasets storing them: one row per image occurrence in a
-- document (the same image twice is two rows, stored once in the chunk's media file).
CREATE TABLE IF NOT EXISTS chunk_images (
    dataset      VARCHAR NOT NULL,
    global_index BIGINT NOT NULL,
    doc          BIGINT NOT NULL,          -- the document, within the chunk
    image        INTEGER NOT NULL,         -- the image, within the document (0, 1, ...)
    image_id     VARCHAR NOT NULL,         -- sha256 (hex) of the image's original bytes
    width        INTEGER NOT NULL,         -- after EXIF orientation
    height       INTEGER NOT NULL,
    format       VARCHAR NOT NULL,         -- JPEG | PNG | WEBP | GIF | ...
    mode         VARCHAR NOT NULL,         -- the stored image's mode: RGB, L, P, RGBA, CMYK, I;16, ...
    num_bytes    BIGINT NOT NULL,          -- of the original (compressed) file
    PRIMARY KEY (dataset, global_index, doc, image)
);

-- Media files rewritten by a build's end (ingest/media_dedup.py): a chunk's media file without the
-- images a lower chunk of its dataset holds, so each image is stored once per dataset. An image's
-- home is the media file of the lowest chunk holding it (chunk_images): that chunk's row here,
-- else its <chunk>.media.parquet. A chunk without a row reads its own <chunk>.media.parquet.
CREATE TABLE IF NOT EXISTS media_files (
    dataset      VARCHAR NOT NULL,
    global_index BIGINT NOT NULL,
    path         VARCHAR NOT NULL,         -- relative to the lake root (contracts/media.py deduped_media_path)
    num_images   INTEGER NOT NULL,         -- the images it holds
    num_bytes    BIGINT NOT NULL,
    checksum     VARCHAR NOT NULL,         -- sha256
    PRIMARY KEY (dataset, global_index)
);

-- Row groups of committed chunks: readers seek to a token without opening other row groups.
CREATE TABLE IF NOT EXISTS row_groups (
    dataset      VARCHAR NOT NULL,
    global_index BIGINT NOT NULL,
    row_group    INTEGER NOT NULL,
    first_doc    BIGINT NOT NULL,          -- within the chunk
    num_docs     BIGINT NOT NULL,
    first_token  BIGINT NOT NULL,          -- within the chunk
    num_tokens   BIGINT NOT NULL,
    num_parts    BIGINT[] NOT NULL,        -- parts of each kind
    part_tokens  BIGINT[] NOT NULL,        -- stored tokens of each kind
    PRIMARY KEY (dataset, global_index, row_group)
);

-- The documents a chunk of a dataset defined by a filter selects from its file: one row per row
-- group of the file (the dataset's row_groups row of the same number counts them), committed with
-- the chunk.
CREATE TABLE IF NOT EXISTS selections (
    dataset          VARCHAR NOT NULL,
    global_index     BIGINT NOT NULL,
    row_group        INTEGER NOT NULL,
    source_first_doc BIGINT NOT NULL,      -- the row group's first document in the file
    docs             INTEGER[] NOT NULL,   -- the selected documents, within the row group, ascending
    PRIMARY KEY (dataset, global_index, row_group)
);

-- Packing plans (loader.packing pack | pad) whose per-chunk counts are kept: one row per plan.
-- plan_key hashes seq_len, mode, algorithm, window, long-document policy and the collation
-- template (special tokens and their lengths), so a loader finds the counts that fit it.
CREATE TABLE IF NOT EXISTS packing_plans (
    plan_key    VARCHAR NOT NULL,
    dataset     VARCHAR NOT NULL,
    seq_len     BIGINT NOT NULL,
    mode        VARCHAR NOT NULL,          -- pack | pad
    spec        VARCHAR NOT NULL,          -- the settings, as JSON
    created_at  TIMESTAMP NOT NULL,
    PRIMARY KEY (plan_key, dataset)
);

-- Examples of each committed chunk under a packing plan.
CREATE TABLE IF NOT EXISTS chunk_examples (
    dataset        VARCHAR NOT NULL,
    global_index   BIGINT NOT NULL,
    plan_key       VARCHAR NOT NULL,
    num_examples   BIGINT NOT NULL,
    num_tokens     BIGINT NOT NULL,        -- non-padding tokens of those examples (specials included)
    truncated_docs BIGINT NOT NULL,        -- long_documents: truncate
    dropped_tokens BIGINT NOT NULL,
    split_docs     BIGINT NOT NULL,        -- long_documents: split
    PRIMARY KEY (dataset, global_index, plan_key)
);

-- Inputs skipped under on_error: skip (and sources missing at planning).
CREATE TABLE IF NOT EXISTS rejects (
    dataset      VARCHAR NOT NULL,
    source       VARCHAR NOT NULL,
    location     VARCHAR NOT NULL,         -- "line 17", "row 3", "after line 900", ...
    line         BIGINT,                   -- 1-based line, or 0-based Parquet row, where known
    reason       VARCHAR NOT NULL,
    shard_index  INTEGER,
    split_index  INTEGER,
    global_index BIGINT,                   -- NULL for sources rejected at planning
    build_id     INTEGER,
    recorded_at  TIMESTAMP NOT NULL
);

CREATE SEQUENCE IF NOT EXISTS build_ids START 1;

-- One row per build run.
CREATE TABLE IF NOT EXISTS builds (
    build_id       INTEGER PRIMARY KEY DEFAULT nextval('build_ids'),
    started_at     TIMESTAMP NOT NULL,
    ended_at       TIMESTAMP,
    status         VARCHAR NOT NULL,       -- running | succeeded | failed | interrupted
    workers        INTEGER,
    scheduler      VARCHAR,
    dashboard      VARCHAR,
    host           VARCHAR,
    pid            INTEGER,
    version        VARCHAR,
    chunks_built   BIGINT DEFAULT 0,
    docs           BIGINT DEFAULT 0,
    tokens         BIGINT DEFAULT 0,
    source_bytes   BIGINT DEFAULT 0,
    rejects        BIGINT DEFAULT 0,
    retries        BIGINT DEFAULT 0,
    seconds        DOUBLE,
    tokens_per_s   DOUBLE,
    error          VARCHAR,
    encoder        VARCHAR                 -- what encoded the documents, with its version
);
-- Catalogs created before the encoder was recorded.
ALTER TABLE builds ADD COLUMN IF NOT EXISTS encoder VARCHAR;

-- Mixture schedules registered by builds (lakeloader.index.mixture), queryable with the
-- mixture_plan and mixture_proportions macros of views.sql. mixture_id hashes the datasets,
-- each stage's start and quantised weights, the batch size and the stop strategy, so the same
-- mixture is stored once however often it is built.
CREATE TABLE IF NOT EXISTS mixtures (
    mixture_id         VARCHAR PRIMARY KEY,
    batch_size         BIGINT NOT NULL,        -- global batch, in examples
    stop               VARCHAR NOT NULL,       -- restart | first_exhausted | all_exhausted
    datasets           VARCHAR[] NOT NULL,     -- dataset order of the schedule (dataset number = position - 1)
    num_stages         INTEGER NOT NULL,
    registered_at      TIMESTAMP NOT NULL,     -- first build that used it
    last_registered_at TIMESTAMP NOT NULL      -- latest build that used it
);

-- One row per stage: its weights from start_step until end_step (exclusive; NULL for the last).
CREATE TABLE IF NOT EXISTS mixture_stages (
    mixture_id   VARCHAR NOT NULL,
    stage        INTEGER NOT NULL,             -- 0, 1, ...
    start_step   BIGINT NOT NULL,
    end_step     BIGINT,
    weights      DOUBLE[] NOT NULL,            -- the config's weights, in dataset order
    quanta       BIGINT[] NOT NULL,            -- the integer weights the schedule uses (about w / sum(w) * 2^40)
    total_weight BIGINT NOT NULL,              -- sum(quanta): target share of dataset d = quanta[d] / total_weight
    PRIMARY KEY (mixture_id, stage)
);

-- The Huffman tree of each stage. After n examples of the stage the root holds n; a node with
-- count C gives its parent's first child floor((2 * split_weight * C + parent_weight) /
-- (2 * parent_weight)) and the second child the rest. Leaves carry their dataset number.
CREATE TABLE IF NOT EXISTS mixture_nodes (
    mixture_id    VARCHAR NOT NULL,
    stage         INTEGER NOT NULL,
    node          INTEGER NOT NULL,
    parent        INTEGER,                     -- NULL for the root
    is_first      BOOLEAN NOT NULL,            -- first child (rounded share) or second (the rest)
    weight        BIGINT NOT NULL,             -- sum of the quanta of the leaves below
    parent_weight BIGINT,
    split_weight  BIGINT,                      -- weight of the parent's first child
    dataset       INTEGER,                     -- leaf: dataset number (0-based); NULL inside
    depth         INTEGER NOT NULL,
    PRIMARY KEY (mixture_id, stage, node)
);

-- The documents index: the documents view's rows of committed chunks but their tokens, in Parquet
-- files of the lake (columns: contracts/chunk_file.py INDEX_COLUMNS, per-kind tokens, metadata),
-- written as chunks commit and compacted now and then. One row per file, checked against its size
-- and sha256 before a query reads it.
CREATE TABLE IF NOT EXISTS document_index_files (
    path        VARCHAR PRIMARY KEY,       -- relative to the lake root
    dataset     VARCHAR NOT NULL,
    first_chunk BIGINT NOT NULL,           -- the lowest and highest global index it covers
    last_chunk  BIGINT NOT NULL,
    num_chunks  BIGINT NOT NULL,
    num_docs    BIGINT NOT NULL,
    num_bytes   BIGINT NOT NULL,
    checksum    VARCHAR NOT NULL,          -- sha256
    created_at  TIMESTAMP NOT NULL
);

-- Which index file holds the rows of each indexed chunk (a chunk of a dataset built from sources:
-- datasets defined by a filter read their source's), and the chunk file they were taken from.
CREATE TABLE IF NOT EXISTS document_index_chunks (
    dataset      VARCHAR NOT NULL,
    global_index BIGINT NOT NULL,
    chunk_path   VARCHAR NOT NULL,         -- the chunk file (chunks.path when indexed)
    path         VARCHAR NOT NULL,         -- the index file (document_index_files.path)
    PRIMARY KEY (dataset, global_index)
);

-- Progress counters: what the views datasets and shards report of the chunk rows, kept by the
-- writer in the transaction of every change of those rows (commits, plans), so that status reads a
-- row per dataset and per shard whatever the number of chunks. They always equal their count from
-- the chunk rows (queries.sql counted_dataset_progress, counted_shard_progress), which the writer
-- checks when it opens the catalog and counts afresh where they differ (a catalog written before
-- them, one recovered from a snapshot, one changed by hand). Readers of a catalog without them
-- read those counts instead.
CREATE TABLE IF NOT EXISTS dataset_progress (
    dataset       VARCHAR PRIMARY KEY,     -- a dataset plan in force
    num_shards    BIGINT NOT NULL,         -- rows of shard_plans
    shards_done   BIGINT NOT NULL,         -- of them complete (committed chunks = num_splits)
    num_chunks    BIGINT NOT NULL,         -- planned chunks
    chunks_done   BIGINT NOT NULL,         -- committed chunks
    prefix_chunks BIGINT NOT NULL,         -- committed_prefix.num_chunks
    num_docs      BIGINT NOT NULL,         -- sums over the chunk rows
    num_tokens    BIGINT NOT NULL,
    num_bytes     BIGINT NOT NULL,
    source_bytes  BIGINT NOT NULL,
    num_rejects   BIGINT NOT NULL          -- rows of rejects
);

-- Per shard with planned chunks. Keyed by its first chunk, so incremental snapshots carry the row
-- with that chunk's rows (catalog/changes.py KEYED_TABLES).
CREATE TABLE IF NOT EXISTS shard_progress (
    dataset      VARCHAR NOT NULL,
    global_index BIGINT NOT NULL,          -- the shard's lowest global index
    shard_index  INTEGER NOT NULL,
    num_splits   BIGINT NOT NULL,          -- shard_plans.num_splits: complete when chunks_done is as many
    chunks_done  BIGINT NOT NULL,          -- committed chunks
    docs_done    BIGINT NOT NULL,          -- sums over the chunk rows
    tokens_done  BIGINT NOT NULL,
    rejects      BIGINT NOT NULL,          -- sum of chunks.num_rejects
    PRIMARY KEY (dataset, global_index)
);

-- The folders a dataset's planned chunk files lie in other than its plan's own (chunk_dir): a
-- filtered dataset's source files of an older plan of its source. With the chunk_dir of each plan
-- in force, the folders the catalog reads (live_chunk_folders), found without reading every chunk.
CREATE TABLE IF NOT EXISTS plan_folders (
    dataset VARCHAR NOT NULL,
    folder  VARCHAR NOT NULL,
    PRIMARY KEY (dataset, folder)
);

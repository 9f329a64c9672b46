-- Named statements used by lakeloader; each starts with a "-- name: <name>" line.

-- name: begin_transaction
BEGIN TRANSACTION;

-- name: commit_transaction
COMMIT;

-- name: rollback_transaction
ROLLBACK;

-- name: checkpoint
CHECKPOINT;

-- name: writer_settings
-- jemalloc's background threads give back within seconds what a large statement freed (a full
-- snapshot's copy of a million-chunk catalog: ~0.6 GB), which DuckDB would keep otherwise.
SET allocator_background_threads = true;

-- name: dataset_plan
SELECT fingerprint FROM dataset_plans WHERE name = $name;

-- name: forget_dataset
-- (The documents index of a replaced plan: its chunks' global indices may change.)
DELETE FROM document_index_chunks WHERE dataset = $name;
DELETE FROM document_index_files WHERE dataset = $name;
DELETE FROM selections WHERE dataset = $name;
DELETE FROM chunk_images WHERE dataset = $name;
DELETE FROM media_files WHERE dataset = $name;
DELETE FROM row_groups WHERE dataset = $name;
DELETE FROM chunk_examples WHERE dataset = $name;
DELETE FROM packing_plans WHERE dataset = $name;
DELETE FROM chunks WHERE dataset = $name;
DELETE FROM shard_plans WHERE dataset = $name;
DELETE FROM rejects WHERE dataset = $name;
DELETE FROM dataset_plans WHERE name = $name;

-- name: insert_dataset_plan
INSERT INTO dataset_plans (name, fingerprint, format, fields, chunk_dir, tokenizer_path, token_type,
                           vocab_size, split_size, on_error, planned_at, encoder, source_dataset, selection)
VALUES ($name, $fingerprint, $format, $fields, $chunk_dir, $tokenizer_path, $token_type,
        $vocab_size, $split_size, $on_error, now()::TIMESTAMP, $encoder, $source_dataset, $selection);

-- name: set_on_error
UPDATE dataset_plans SET on_error = $on_error WHERE name = $name;

-- name: record_definition
-- A config's definition of a dataset was (re)planned as $fingerprint (catalog/identity.py).
INSERT OR REPLACE INTO dataset_definitions (dataset, definition, fingerprint, config, recorded_at)
VALUES ($name, $definition, $fingerprint, $config, now()::TIMESTAMP);

-- name: dataset_definitions
-- Every definition of a dataset name the lake recorded, with the plan it was last built as and the
-- config that built it, the newest first.
SELECT definition, fingerprint, config
FROM dataset_definitions WHERE dataset = $name
ORDER BY recorded_at DESC, definition;

-- name: chunk_tasks
-- Chunks of the datasets, committed or not ($committed), with what a build task needs to (re)build
-- them and their catalog record (size and checksum, null until committed) to check files against,
-- a page of them: the first $rows (NULL: all) after chunk $after_index of the $after_position-th
-- of $datasets (-1, 0: from the first).
SELECT c.dataset, c.global_index, c.shard_index, c.split_index, c.path,
       c.split_kind, c.split_start, c.split_stop, c.first_row,
       s.source, s.layout, s.compression, s.source_raw, c.num_bytes, c.checksum,
       coalesce(d.encoder, '') AS encoder, c.media_bytes, c.media_checksum,
       m.path AS deduped_path, m.num_bytes AS deduped_bytes, m.checksum AS deduped_checksum
FROM chunks c
JOIN shard_plans s ON s.dataset = c.dataset AND s.shard_index = c.shard_index
JOIN dataset_plans d ON d.name = c.dataset
LEFT JOIN media_files m ON m.dataset = c.dataset AND m.global_index = c.global_index
WHERE (c.status = 'committed') = $committed AND list_contains($datasets, c.dataset)
  AND (c.global_index, list_position($datasets, c.dataset)) > ($after_index, $after_position)
ORDER BY c.global_index, list_position($datasets, c.dataset)
LIMIT $rows;

-- name: commit_batch_chunks
-- A batch of finished chunks is committed in one transaction by a few statements whatever its
-- size (a statement per chunk cost the driver a millisecond or more each), each given the
-- batch's values as lists, one element per chunk (row group, plan, selection part, reject).
-- First the chunks not committed yet are marked committed and returned with their shard and
-- split: a chunk committed already (a retried task finishing twice, or a repaired chunk: same
-- bytes) only gets the packing counts it lacks (commit_batch_missing_examples). The statements
-- after it add the rows of the chunks it committed. $lo..$hi spans the batch's global indexes.
UPDATE chunks SET
    status = 'committed', num_docs = b.num_docs, num_tokens = b.num_tokens,
    num_records = b.num_records, num_bytes = b.num_bytes, checksum = b.checksum,
    num_rejects = b.num_rejects, source_bytes = b.source_bytes, build_id = $build_id,
    worker = b.worker, seconds = b.seconds, committed_at = now()::TIMESTAMP,
    num_parts = b.num_parts, part_tokens = b.part_tokens, media_bytes = b.media_bytes,
    media_checksum = b.media_checksum
FROM (SELECT unnest($dataset) AS dataset, unnest($global_index) AS global_index, unnest($num_docs) AS num_docs,
             unnest($num_tokens) AS num_tokens, unnest($num_records) AS num_records,
             unnest($num_bytes) AS num_bytes, unnest($checksum) AS checksum, unnest($num_rejects) AS num_rejects,
             unnest($source_bytes) AS source_bytes, unnest($worker) AS worker, unnest($seconds) AS seconds,
             unnest($num_parts) AS num_parts, unnest($part_tokens) AS part_tokens,
             unnest($media_bytes::BIGINT[]) AS media_bytes, unnest($media_checksum::VARCHAR[]) AS media_checksum) b
WHERE chunks.dataset = b.dataset AND chunks.global_index = b.global_index AND chunks.status <> 'committed'
  AND list_contains($global_index, chunks.global_index) AND chunks.global_index BETWEEN $lo AND $hi
RETURNING chunks.dataset, chunks.global_index, chunks.shard_index, chunks.split_index;

-- name: commit_chunk
-- commit_batch_chunks for a batch of one chunk: its values as scalars, found by its key (about half
-- of the time of the join above, which a driver receiving results one at a time pays for each).
UPDATE chunks SET
    status = 'committed', num_docs = $num_docs, num_tokens = $num_tokens,
    num_records = $num_records, num_bytes = $num_bytes, checksum = $checksum,
    num_rejects = $num_rejects, source_bytes = $source_bytes, build_id = $build_id,
    worker = $worker, seconds = $seconds, committed_at = now()::TIMESTAMP,
    num_parts = $num_parts, part_tokens = $part_tokens, media_bytes = $media_bytes::BIGINT,
    media_checksum = $media_checksum::VARCHAR
WHERE dataset = $dataset AND global_index = $global_index AND status <> 'committed'
RETURNING dataset, global_index, shard_index, split_index;

-- name: commit_batch_row_groups
INSERT INTO row_groups
SELECT unnest($dataset), unnest($global_index), unnest($row_group), unnest($first_doc), unnest($num_docs),
       unnest($first_token), unnest($num_tokens), unnest($num_parts), unnest($part_tokens);

-- name: commit_batch_images
INSERT INTO chunk_images
SELECT unnest($dataset), unnest($global_index), unnest($doc), unnest($image), unnest($image_id), unnest($width),
       unnest($height), unnest($format), unnest($mode), unnest($num_bytes);

-- name: commit_batch_examples
INSERT INTO chunk_examples
SELECT unnest($dataset), unnest($global_index), unnest($plan_key), unnest($num_examples), unnest($num_tokens),
       unnest($truncated_docs), unnest($dropped_tokens), unnest($split_docs);

-- name: commit_batch_missing_examples
-- The packing counts chunks committed already lack (under a packing plan added since).
INSERT OR IGNORE INTO chunk_examples
SELECT unnest($dataset), unnest($global_index), unnest($plan_key), unnest($num_examples), unnest($num_tokens),
       unnest($truncated_docs), unnest($dropped_tokens), unnest($split_docs);

-- name: commit_batch_selections
INSERT INTO selections
SELECT unnest($dataset), unnest($global_index), unnest($row_group), unnest($source_first_doc), unnest($docs);

-- name: commit_batch_rejects
-- In the batch's order, each naming its chunk's source file.
INSERT INTO rejects
SELECT r.dataset, s.source, r.location, r.line, r.reason, r.shard_index, r.split_index, r.global_index,
       $build_id, now()::TIMESTAMP
FROM (SELECT unnest($dataset) AS dataset, unnest($global_index) AS global_index, unnest($location) AS location,
             unnest($line) AS line, unnest($reason) AS reason, unnest($shard_index) AS shard_index,
             unnest($split_index) AS split_index, unnest(range(len($dataset))) AS k) r
JOIN shard_plans s ON s.dataset = r.dataset AND s.shard_index = r.shard_index
ORDER BY r.k;

-- name: pending_selections
-- Chunks of datasets defined by a filter to evaluate: uncommitted ($committed false) or
-- committed ones ($committed true), whose source chunk is committed, with the source chunk's file
-- and catalog record, its source file and line_base (what doc_key hashes). An uncommitted one
-- waits until its line_base is known: until the earlier splits of its file are committed. $built
-- (a list of {dataset, global_index}, or NULL): only chunks of the shards of those source chunks
-- (just committed: what they make ready).
WITH lines AS (
    SELECT * FROM chunk_lines(
        (SELECT list(source_dataset) FROM dataset_plans WHERE list_contains($datasets, name)),
        shards := (SELECT list({'dataset': dataset, 'shard_index': shard_index}) FROM chunks
                   WHERE $built IS NOT NULL AND list_contains($built, {'dataset': dataset, 'global_index': global_index})))
)
SELECT c.dataset, d.source_dataset, d.selection AS "where", c.global_index, s.path, s.num_bytes,
       s.checksum, s.num_records, p.source, l.line_base
FROM chunks c
JOIN dataset_plans d ON d.name = c.dataset
JOIN chunks s ON s.dataset = d.source_dataset AND s.global_index = c.global_index
JOIN shard_plans p ON p.dataset = s.dataset AND p.shard_index = s.shard_index
JOIN lines l ON l.dataset = s.dataset AND l.global_index = s.global_index
WHERE (c.status = 'committed') = $committed AND s.status = 'committed' AND list_contains($datasets, c.dataset)
  AND (l.line_base IS NOT NULL OR $committed)
ORDER BY c.global_index, list_position($datasets, c.dataset);

-- name: chunk_selection
-- The selected documents of a filtered dataset's chunk, per row group of its file.
SELECT row_group, source_first_doc, docs FROM selections
WHERE dataset = $name AND global_index = $global_index ORDER BY row_group;

-- name: audit_filtered_chunks
-- The committed chunks of a dataset defined by a filter with their counts and their source
-- chunk's file and record (what a fresh evaluation of the predicate takes: with its source file
-- and line_base, see pending_selections).
WITH lines AS (
    SELECT * FROM chunk_lines((SELECT list(source_dataset) FROM dataset_plans WHERE name = $name))
)
SELECT c.global_index, c.num_docs, c.num_tokens, c.num_parts, c.part_tokens, d.source_dataset,
       s.path, s.num_bytes, s.checksum, s.num_records, p.source,
       (SELECT l.line_base FROM lines l WHERE l.dataset = s.dataset AND l.global_index = s.global_index) AS line_base,
       (SELECT list(r.num_docs ORDER BY r.row_group) FROM row_groups r
        WHERE r.dataset = c.dataset AND r.global_index = c.global_index) AS row_group_docs,
       (SELECT list(r.num_tokens ORDER BY r.row_group) FROM row_groups r
        WHERE r.dataset = c.dataset AND r.global_index = c.global_index) AS row_group_tokens,
       (SELECT list(e.num_examples) FROM chunk_examples e
        WHERE e.dataset = c.dataset AND e.global_index = c.global_index AND e.plan_key = $plan_key) AS examples
FROM chunks c
JOIN dataset_plans d ON d.name = c.dataset
JOIN chunks s ON s.dataset = d.source_dataset AND s.global_index = c.global_index
JOIN shard_plans p ON p.dataset = s.dataset AND p.shard_index = s.shard_index
WHERE c.dataset = $name AND c.status = 'committed'
ORDER BY c.global_index;

-- name: filtered_datasets
SELECT name, source_dataset, selection AS "where" FROM dataset_plans
WHERE source_dataset IS NOT NULL AND list_contains($datasets, name) ORDER BY name;

-- name: insert_packing_plan
INSERT OR IGNORE INTO packing_plans VALUES ($plan_key, $dataset, $seq_len, $mode, $spec, now()::TIMESTAMP);

-- name: insert_chunk_examples
INSERT OR IGNORE INTO chunk_examples VALUES ($dataset, $global_index, $plan_key, $num_examples, $num_tokens,
                                             $truncated_docs, $dropped_tokens, $split_docs);

-- name: chunks_without_plan
-- Committed chunks of a dataset whose counts under a packing plan are not kept yet.
SELECT c.global_index, c.path FROM chunks c
WHERE c.dataset = $name AND c.status = 'committed' AND NOT EXISTS (
    SELECT 1 FROM chunk_examples e
    WHERE e.dataset = c.dataset AND e.global_index = c.global_index AND e.plan_key = $plan_key)
ORDER BY c.global_index;

-- name: insert_reject
INSERT INTO rejects VALUES (
    $dataset, $source, $location, $line, $reason, $shard_index, $split_index, $global_index,
    $build_id, now()::TIMESTAMP);

-- name: start_build
INSERT INTO builds (started_at, status, workers, scheduler, dashboard, host, pid, version, encoder)
VALUES (now()::TIMESTAMP, 'running', $workers, $scheduler, $dashboard, $host, $pid, $version, $encoder)
RETURNING build_id;

-- name: set_build_cluster
UPDATE builds SET workers = $workers, dashboard = $dashboard WHERE build_id = $build_id;

-- name: finish_build
UPDATE builds SET
    ended_at = now()::TIMESTAMP, status = $status, chunks_built = $chunks_built, docs = $docs,
    tokens = $tokens, source_bytes = $source_bytes, rejects = $rejects, retries = $retries,
    seconds = $seconds, tokens_per_s = $tokens_per_s, error = $error
WHERE build_id = $build_id;

-- name: interrupt_stale_builds
-- Runs left 'running' by a killed driver: mark them and count what they committed.
UPDATE builds SET
    status = 'interrupted',
    chunks_built = (SELECT count(*) FROM chunks c WHERE c.build_id = builds.build_id),
    docs = (SELECT coalesce(sum(num_docs), 0) FROM chunks c WHERE c.build_id = builds.build_id),
    tokens = (SELECT coalesce(sum(num_tokens), 0) FROM chunks c WHERE c.build_id = builds.build_id),
    rejects = (SELECT coalesce(sum(num_rejects), 0) FROM chunks c WHERE c.build_id = builds.build_id)
WHERE status = 'running';

-- name: dataset_status
SELECT name, status, num_shards, num_chunks, chunks_done, prefix_chunks, num_docs, num_tokens,
       num_rejects, format, token_type
FROM datasets ORDER BY name;

-- name: shard_status
SELECT dataset, shard_index, source, status, num_splits, chunks_done, docs_done, tokens_done, rejects
FROM shards ORDER BY dataset, shard_index;

-- name: shard_totals
-- Shards of datasets $datasets (NULL: every dataset), and how many are complete (from the counters).
SELECT coalesce(sum(num_shards), 0)::BIGINT, coalesce(sum(shards_done), 0)::BIGINT FROM dataset_progress
WHERE $datasets IS NULL OR list_contains($datasets, dataset);

-- name: shard_status_unfinished
-- shard_status of the first $limit shards not complete of datasets $datasets (NULL: every dataset),
-- found in shard_progress alone (a shard without chunks is complete).
SELECT s.dataset, s.shard_index, s.source, s.status, s.num_splits, s.chunks_done, s.docs_done, s.tokens_done, s.rejects
FROM shards s
SEMI JOIN (SELECT dataset, shard_index FROM shard_progress
           WHERE chunks_done <> num_splits AND ($datasets IS NULL OR list_contains($datasets, dataset))
           ORDER BY dataset, shard_index LIMIT $limit) u
       ON u.dataset = s.dataset AND u.shard_index = s.shard_index
ORDER BY s.dataset, s.shard_index;

-- name: recent_builds
SELECT build_id, status, started_at, ended_at, workers, chunks_built, docs, tokens,
       round(tokens_per_s) AS tokens_per_s, round(tokens_per_s / nullif(workers, 0)) AS tokens_per_s_per_worker,
       rejects, retries, error
FROM builds ORDER BY build_id DESC LIMIT 5;

-- name: attach_catalog
-- Every reader's connection is an in-memory database that attaches the catalog file read-only as
-- `lake` and reaches its tables through views (reader_table), with the views and macros of
-- views.sql defined from the wheel: no SQL stored in the file runs.
ATTACH $path AS lake (READ_ONLY);

-- name: attached_stored_columns
-- Bound, never run: only the result's column names are read. {tables}: attached_stored_columns_of
-- each table of schema.sql, joined by commas: a marker column naming the table, then the columns
-- the attached catalog file stores for it. A generated column (whose SQL would run when read) is
-- not stored, so it is not among them; and the bind fails with a CatalogException unless each is
-- a table there (a view of that name, or none, raises). One bind (~1 ms): listing the file's
-- objects or columns (attached_objects) first builds DuckDB's own default views of every schema
-- (~10 ms of every reader's open, at any lake size). With attached_all_columns_of instead (only
-- once each is known to be a table: a view's SQL would be bound), every column of each table,
-- generated ones included.
SELECT * FROM {tables}

-- name: attached_stored_columns_of
(SELECT NULL AS "{marker}", * FROM duckdb_table_sample('lake.main.{table}'))

-- name: attached_all_columns_of
(SELECT NULL AS "{marker}", * FROM lake.main.{table})

-- name: attached_objects
-- Tables and views of the attached catalog file (a view where schema.sql has a table means the
-- file was altered).
SELECT table_name AS name, 'table' AS kind FROM duckdb_tables()
WHERE database_name = 'lake' AND schema_name = 'main'
UNION ALL
SELECT view_name, 'view' FROM duckdb_views()
WHERE database_name = 'lake' AND schema_name = 'main' AND NOT internal;

-- name: attached_catalog_path
-- The catalog file a reader's connection attached (none on the build's own connection).
SELECT path FROM duckdb_databases() WHERE database_name = 'lake';

-- name: reader_table
-- One table of the attached catalog as a view of the reader's database ({table}: a table of
-- schema.sql; {columns}: its columns by name, a column schema.sql added after the catalog was
-- written as NULL::<type> AS <column>). Never *: a column the file has beyond those is not read.
CREATE VIEW {table} AS SELECT {columns} FROM lake.main.{table};

-- name: hide_progress_bar
-- DuckDB prints its progress bar on stdout, where `lakeloader sql` writes its result. (In Jupyter
-- without ipywidgets DuckDB refuses the setting, and draws no bar there.)
SET enable_progress_bar = false;

-- name: lock_reader
-- Then no file, network or extension is reachable, and no statement can change that.
SET enable_external_access = false;
SET lock_configuration = true;

-- name: dataset_source
-- The dataset a dataset defined by a filter selects from (NULL for any other dataset).
SELECT source_dataset FROM dataset_plans WHERE name = $name;

-- name: reader_dataset
-- A dataset's plan, part kinds (dataset_plans.fields) and, for a dataset defined by a filter, its
-- source dataset.
SELECT d.fingerprint, d.token_type, d.fields, d.source_dataset
FROM dataset_plans d
WHERE d.name = $name;

-- name: reader_chunks
-- Per-chunk counts of every planned chunk, and whether it is committed: all a reader needs to seek
-- (each chunk's path and checksum come with its row groups when it is read: reader_row_groups_of).
-- The reader takes the committed prefix from these rows, as committed_prefix (prefix.sql) defines
-- it: one scan of the table instead of a second one for that view (~6 ms of a loader's open at
-- 200,000 chunks). Unsorted: a scan returns them in the order the plan inserted them (global
-- order), which the reader checks, reordering them only otherwise, for less than a sort costs.
-- The parts of each kind only with $part_counts (templates that add tokens around parts):
-- otherwise NULL, and the list column is never read (~5 ms of the open at 200,000 chunks).
SELECT global_index, num_docs, num_tokens, status = 'committed' AS committed,
       CASE WHEN $part_counts THEN num_parts END AS num_parts
FROM chunks WHERE dataset = $name;

-- name: packing_plan_registered
SELECT count(*) > 0 FROM packing_plans WHERE dataset = $name AND plan_key = $plan_key;

-- name: reader_chunk_examples
-- Examples per chunk of the committed prefix under a packing plan; the prefix ends at the first
-- chunk without counts (a build commits a chunk and its counts in one transaction).
SELECT e.global_index, e.num_examples
FROM chunk_examples e
WHERE e.dataset = $name AND e.plan_key = $plan_key AND e.global_index < $prefix
ORDER BY e.global_index;

-- name: reader_row_groups_of
-- The row groups of the chunks a batch's rows lie in, with each chunk's file record. Only the
-- columns a reader needs: on a cold catalog every column costs its reads for rows spread over the
-- table (~3-6 ms each for 64 chunks of 200,000); first_doc is counted from num_docs instead, and
-- the parts of each kind are read only with $part_counts (as in reader_chunks).
-- Both tables are filtered by the chunks asked for (semi-joins): then the chunks' strings are read
-- for those rows only (at 200,000 chunks ~15 ms cold against ~19-24 ms filtering the row groups
-- alone; at 22 chunks ~1 ms more).
SELECT r.global_index, r.num_docs, r.num_tokens, CASE WHEN $part_counts THEN r.num_parts END AS num_parts,
       c.path, c.num_bytes, c.checksum, c.shard_index
FROM row_groups r JOIN chunks c ON c.dataset = r.dataset AND c.global_index = r.global_index
WHERE r.dataset = $name AND c.dataset = $name AND c.status = 'committed'
  AND r.global_index IN (SELECT unnest($global_indexes)) AND c.global_index IN (SELECT unnest($global_indexes))
ORDER BY r.global_index, r.row_group;

-- name: reader_index_datasets
-- The reader index of a snapshot being published (lakeloader/catalog/reader_index.py) is read from
-- the copy itself, attached on the writer's connection as published_snapshot: its rows are
-- exactly the snapshot's. Each dataset's plan, as reader_dataset returns it, and its tokenizer.
SELECT name, fingerprint, token_type, fields, source_dataset, tokenizer_path
FROM published_snapshot.dataset_plans ORDER BY name;

-- name: reader_index_definitions
-- The definitions recorded for each dataset name (dataset_definitions' rows, in its order).
SELECT dataset, definition, fingerprint, config
FROM published_snapshot.dataset_definitions ORDER BY dataset, recorded_at DESC, definition;

-- name: reader_index_chunks
-- Every planned chunk: reader_chunks' columns, the file record (reader_chunk_record's) and the
-- media file a build's end rewrote for it (deduped_media_files').
SELECT c.dataset, c.global_index, c.num_docs, c.num_tokens, c.status = 'committed' AS committed, c.num_parts,
       c.path, c.num_bytes, c.checksum, c.shard_index, m.path AS media_file
FROM published_snapshot.chunks c
LEFT JOIN published_snapshot.media_files m ON m.dataset = c.dataset AND m.global_index = c.global_index
ORDER BY c.dataset, c.global_index;

-- name: reader_index_row_groups
-- The row groups of committed chunks, with the columns reader_row_groups_of reads.
SELECT dataset, global_index, num_docs, num_tokens, num_parts
FROM published_snapshot.row_groups ORDER BY dataset, global_index, row_group;

-- name: reader_index_examples
-- Examples of each chunk counted under each packing plan (reader_chunk_examples' rows).
SELECT dataset, plan_key, global_index, num_examples
FROM published_snapshot.chunk_examples ORDER BY dataset, plan_key, global_index;

-- name: reader_index_packing_plans
SELECT dataset, plan_key FROM published_snapshot.packing_plans ORDER BY dataset, plan_key;

-- name: reader_chunk_record
-- The file record of one committed chunk (one not learnt with its row groups).
SELECT path, num_bytes, checksum, shard_index
FROM chunks WHERE dataset = $name AND global_index = $global_index AND status = 'committed';

-- name: chunk_records
-- First line (1-based, text/JSONL) or row (0-based, Parquet) of a chunk's split in its source file.
SELECT c.path, c.split_index, s.source, s.layout, c.split_kind, c.first_row,
       (SELECT sum(e.num_records) FROM chunks e
        WHERE e.dataset = c.dataset AND e.shard_index = c.shard_index AND e.split_index < c.split_index)
           AS records_before,
       (SELECT count(*) FROM chunks e
        WHERE e.dataset = c.dataset AND e.shard_index = c.shard_index AND e.split_index < c.split_index
          AND e.status = 'committed') AS committed_before
FROM chunks c JOIN shard_plans s ON s.dataset = c.dataset AND s.shard_index = c.shard_index
WHERE c.dataset = $name AND c.global_index = $global_index;

-- name: touch_mixture
UPDATE mixtures SET last_registered_at = now()::TIMESTAMP WHERE mixture_id = $mixture_id RETURNING mixture_id;

-- name: insert_mixture
INSERT INTO mixtures VALUES (
    $mixture_id, $batch_size, $stop, $datasets, $num_stages, now()::TIMESTAMP, now()::TIMESTAMP);

-- name: insert_mixture_stage
INSERT INTO mixture_stages VALUES (
    $mixture_id, $stage, $start_step, $end_step, $weights, $quanta, $total_weight);

-- name: insert_mixture_node
INSERT INTO mixture_nodes VALUES (
    $mixture_id, $stage, $node, $parent, $is_first, $weight, $parent_weight, $split_weight,
    $dataset, $depth);

-- name: mixture_proportions
SELECT dataset, target_weight, examples, share, first_index, end_index, max_deviation
FROM mixture_proportions($mixture_id, $first_step, $stop_step);

-- name: schema_version
SELECT value FROM lake_meta WHERE key = 'schema_version';

-- name: set_schema_version
INSERT OR REPLACE INTO lake_meta VALUES ('schema_version', $version);

-- name: insert_shard_plans
-- From the DataFrame registered as new_shards (columns in table order).
INSERT INTO shard_plans SELECT * FROM new_shards;

-- name: keep_adoptable_chunks
-- Before a dataset's plan is replaced: its committed chunks whose file the new plan (the
-- DataFrame registered as new_chunks) names for the same split, with their row groups and
-- rejects, under their new global and shard index. Chunk paths name the settings, the file
-- (URL, size, version) and the split, so such a chunk holds exactly what rebuilding it would.
CREATE OR REPLACE TEMP TABLE adopted_chunks AS
SELECT n.global_index AS new_index, n.shard_index AS new_shard, n.split_index AS new_split, c.*
FROM chunks c JOIN new_chunks n
  ON n.path = c.path AND n.split_kind = c.split_kind AND n.split_start = c.split_start
 AND n.split_stop = c.split_stop AND n.first_row = c.first_row
WHERE c.dataset = $name AND c.status = 'committed';
CREATE OR REPLACE TEMP TABLE adopted_row_groups AS
SELECT a.new_index, r.* FROM row_groups r
JOIN adopted_chunks a ON r.dataset = a.dataset AND r.global_index = a.global_index
WHERE r.dataset = $name;
CREATE OR REPLACE TEMP TABLE adopted_images AS
SELECT a.new_index, i.* FROM chunk_images i
JOIN adopted_chunks a ON i.dataset = a.dataset AND i.global_index = a.global_index
WHERE i.dataset = $name;
CREATE OR REPLACE TEMP TABLE adopted_rejects AS
SELECT a.new_index, a.new_shard, a.new_split, r.* FROM rejects r
JOIN adopted_chunks a ON r.dataset = a.dataset AND r.global_index = a.global_index
WHERE r.dataset = $name;

-- name: adopt_chunks
-- After the new plan is inserted: mark the chunks kept by keep_adoptable_chunks committed.
-- Their packing counts are not copied: they depend on the global index (FIM), so the build
-- recomputes them from the chunk files (chunks_without_plan), without tokenizing.
UPDATE chunks SET
    status = 'committed', num_docs = a.num_docs, num_tokens = a.num_tokens,
    num_records = a.num_records, num_bytes = a.num_bytes, checksum = a.checksum,
    num_rejects = a.num_rejects, source_bytes = a.source_bytes, build_id = a.build_id,
    worker = a.worker, seconds = a.seconds, committed_at = a.committed_at,
    num_parts = a.num_parts, part_tokens = a.part_tokens, media_bytes = a.media_bytes,
    media_checksum = a.media_checksum
FROM adopted_chunks a
WHERE chunks.dataset = $name AND chunks.global_index = a.new_index;
INSERT INTO chunk_images
SELECT dataset, new_index, doc, image, image_id, width, height, format, mode, num_bytes
FROM adopted_images WHERE dataset = $name;
INSERT INTO row_groups
SELECT dataset, new_index, row_group, first_doc, num_docs, first_token, num_tokens, num_parts, part_tokens
FROM adopted_row_groups WHERE dataset = $name;
INSERT INTO rejects
SELECT dataset, source, location, line, reason, new_shard, new_split, new_index, build_id, recorded_at
FROM adopted_rejects WHERE dataset = $name;
SELECT count(*) FROM adopted_chunks WHERE dataset = $name;

-- name: drop_adopted_chunks
DROP TABLE IF EXISTS adopted_chunks;
DROP TABLE IF EXISTS adopted_row_groups;
DROP TABLE IF EXISTS adopted_images;
DROP TABLE IF EXISTS adopted_rejects;

-- name: insert_plan_growth
INSERT OR REPLACE INTO plan_growth (dataset, fingerprint, extends, chunks_before, grown_at)
VALUES ($name, $fingerprint, $extends, $chunks_before, now());

-- name: plan_growth
-- The growths recorded of a dataset: each grown plan, the plan it extends and that plan's chunks.
SELECT fingerprint, extends, chunks_before FROM plan_growth WHERE dataset = $name;

-- name: built_plan_files
-- A dataset's files in shard order as its plan in force recorded them (plan/growth.py).
SELECT coalesce(source_raw, encode(source)) AS source_raw, size_bytes, version
FROM shard_plans WHERE dataset = $name ORDER BY shard_index;

-- name: built_plan_chunks
SELECT global_index, shard_index, split_index, path, split_kind, split_start, split_stop, first_row
FROM chunks WHERE dataset = $name ORDER BY global_index;

-- name: insert_chunk_plans
-- From the DataFrame registered as new_chunks (the planner's chunk table plus dataset).
INSERT INTO chunks (dataset, global_index, shard_index, split_index, path, split_kind,
                    split_start, split_stop, first_row)
SELECT dataset, global_index, shard_index, split_index, path, split_kind, split_start, split_stop, first_row
FROM new_chunks;

-- name: chunk_folders
SELECT chunk_dir FROM dataset_plans WHERE list_contains($datasets, name);

-- name: chunk_count
SELECT count(*) FROM chunks WHERE list_contains($datasets, dataset);

-- name: pending_chunk_count
SELECT count(*) FROM chunks WHERE status <> 'committed' AND list_contains($datasets, dataset);

-- name: datasets_without_documents
-- Completely built datasets none of whose records became a document (all rejected or unreadable),
-- or (source_dataset not NULL) whose filter selects no document.
SELECT d.name, d.num_rejects, list(s.source ORDER BY s.shard_index)[1:5] AS sources, count(s.source) AS num_sources,
       p.source_dataset, p.selection AS "where"
FROM datasets d JOIN shard_plans s ON s.dataset = d.name JOIN dataset_plans p ON p.name = d.name
WHERE list_contains($datasets, d.name) AND d.status = 'complete' AND d.num_docs = 0
GROUP BY d.name, d.num_rejects, p.source_dataset, p.selection ORDER BY d.name;

-- name: committed_chunk_files
-- (Chunks of datasets defined by a filter are their source's files, checked as the source's.)
-- (A chunk whose media file a build's end rewrote is checked by that file, deduped_*.)
SELECT c.dataset, c.global_index, c.path, c.num_bytes, c.checksum, c.num_docs, c.media_bytes, c.media_checksum,
       m.path AS deduped_path, m.num_bytes AS deduped_bytes, m.checksum AS deduped_checksum
FROM chunks c LEFT JOIN media_files m ON m.dataset = c.dataset AND m.global_index = c.global_index
WHERE c.status = 'committed'
  AND c.dataset NOT IN (SELECT name FROM dataset_plans WHERE source_dataset IS NOT NULL)
ORDER BY c.dataset, c.global_index;

-- name: tokenizer_path
SELECT tokenizer_path FROM dataset_plans WHERE list_contains($datasets, name) LIMIT 1;

-- name: mixture_registered
SELECT count(*) > 0 FROM mixtures WHERE mixture_id = $mixture_id;

-- name: mixture_plan_rows
SELECT * FROM mixture_plan($mixture_id, $first, $stop);

-- name: plan_example_tokens
-- Non-padding tokens and examples of a dataset under a packing plan, and how many of its chunks
-- are counted (token-weighted mixtures need them all).
SELECT coalesce(sum(e.num_tokens), 0)::BIGINT, coalesce(sum(e.num_examples), 0)::BIGINT,
       count(e.global_index), (SELECT count(*) FROM chunks c WHERE c.dataset = $name)
FROM chunk_examples e WHERE e.dataset = $name AND e.plan_key = $plan_key;

-- name: lake_meta_value
SELECT value FROM lake_meta WHERE key = $key;

-- name: set_lake_meta
INSERT OR REPLACE INTO lake_meta VALUES ($key, $value);

-- name: init_lake_id
-- The lake's identity: written once, when its catalog is created (every snapshot carries it).
INSERT OR IGNORE INTO lake_meta VALUES ('lake_id', $lake_id);

-- name: live_chunk_folders
-- Every chunk folder the catalog reads: each plan's in force, and each folder a planned chunk's
-- file lies in (a filtered dataset reads its source's files as they were when it was selected,
-- which may be an older plan's of its source). Any other folder of a dataset is stale.
-- (A chunk's file in its own plan's folder, as every chunk of a dataset built from sources, is
-- matched by a prefix comparison: only the others' folders are extracted.)
-- (The others are kept in plan_folders.)
SELECT DISTINCT folder FROM (
    SELECT chunk_dir AS folder FROM dataset_plans
    UNION ALL
    SELECT folder FROM plan_folders
) ORDER BY folder;

-- name: running_builds
SELECT build_id, host, pid FROM builds WHERE status = 'running' ORDER BY build_id;

-- name: document_chunks
-- Committed chunks with what the documents view adds to their rows: the source file, and the
-- line (1-based, text/JSON Lines) or row (0-based, Parquet) of the chunk's record 0 (a filtered
-- dataset's from its source's chunk of the same file where the source still has it); NULL for a
-- byte split while an earlier split of its file is not committed (its line count is unknown); and
-- the file's size and sha256, which it is checked against before it is read. Placeholders:
-- index_file and index_join, the documents index file holding the chunk's rows (NULL: none; a
-- filtered dataset's chunk is its source's rows of the same file), or NULL and nothing for a
-- catalog without the index.
WITH lines AS (
    SELECT * FROM chunk_lines(NULL)
)
SELECT c.dataset, c.global_index, c.path, c.num_bytes, c.checksum, s.source,
       coalesce(l.line_base, o.line_base) AS line_base, {index_file} AS index_file
FROM chunks c
JOIN shard_plans s ON s.dataset = c.dataset AND s.shard_index = c.shard_index
JOIN dataset_plans d ON d.name = c.dataset
JOIN lines o ON o.dataset = c.dataset AND o.global_index = c.global_index
LEFT JOIN lines l ON l.dataset = d.source_dataset AND l.global_index = c.global_index AND l.path = c.path{index_join}
WHERE c.status = 'committed'
ORDER BY c.dataset, c.global_index;

-- name: document_datasets
-- Per dataset, what the documents view takes of its plan: its part kinds and predicate (NULL: none).
SELECT name, fields, selection AS "where" FROM dataset_plans ORDER BY name;

-- name: document_chunks_index_join

LEFT JOIN document_index_chunks x
       ON x.dataset = coalesce(d.source_dataset, c.dataset) AND x.global_index = c.global_index AND x.chunk_path = c.path

-- name: has_document_index
-- Whether the catalog has the documents index (lakes built before it do not).
SELECT count(*) = 2 FROM (SELECT table_name AS name, database_name FROM duckdb_tables()
                          UNION ALL SELECT view_name, database_name FROM duckdb_views())
WHERE database_name = current_database() AND name IN ('document_index_files', 'document_index_chunks');

-- name: document_index_records
SELECT dataset, path, num_bytes, checksum FROM document_index_files ORDER BY dataset, first_chunk, path;

-- name: document_index_paths
SELECT path FROM document_index_files;

-- name: dataset_plan_names
SELECT name FROM dataset_plans ORDER BY name;

-- name: document_index_files_of
SELECT path, dataset, num_bytes, checksum, num_chunks FROM document_index_files WHERE list_contains($paths, path) ORDER BY path;

-- name: documents_of_index
-- The documents view's rows of one dataset's chunks held by the documents index. Placeholders:
-- source, the relation of the index files (INDEX_COLUMNS, per-kind tokens, metadata); chunks,
-- the relation of every global index from the lowest to the highest of the chunks it answers for
-- (chunk, covered: whether it answers for it, and as documents_of_dataset's per-file constants
-- dataset, source, line_base, key_name); columns, as in documents_of_dataset. The constants are
-- looked up by position in lists (a hash join would build its table on the index, whose size
-- DuckDB cannot estimate), so a query that needs none of them costs a scan of the index.
-- Placeholder where: the filter to the chunks it answers for (covered), or nothing when it
-- answers for every chunk of the files.
SELECT k.dataset, i.chunk, i.doc, k.sources[i.chunk - k.first + 1] AS source,
       k.line_bases[i.chunk - k.first + 1] + i.record AS line,
       ('0x' || left(sha256(k.key_names[i.chunk - k.first + 1] || chr(10)
                            || (k.line_bases[i.chunk - k.first + 1] + i.record)::VARCHAR), 16))::UBIGINT AS doc_key,
       i.num_tokens, i.num_parts{columns}
FROM {source} i,
     (SELECT any_value(dataset) AS dataset, min(chunk) AS first, list(covered ORDER BY chunk) AS covered,
             list(source ORDER BY chunk) AS sources, list(line_base ORDER BY chunk) AS line_bases,
             list(key_name ORDER BY chunk) AS key_names FROM {chunks}) k{where}

-- name: documents_of_index_covered

WHERE k.covered[i.chunk - k.first + 1]

-- name: documents_index_kind_tokens
{column} AS {name}

-- name: documents_of_dataset
-- The documents view's rows of one dataset. Placeholders: source, the relation of its committed
-- chunk files (their record, part_lengths, part_kinds and meta.* columns, and per file its
-- dataset, chunk, source, line_base and key_name: the source file's name); columns, its per-kind
-- token counts and metadata fields (documents_kind_tokens, documents_metadata). A chunk's
-- documents are in record order. doc_key: the first 8 bytes of the sha256 of the file's name, a
-- newline and the line, as lakeloader.contracts.doc_keys.doc_key computes it (NULL with line).
SELECT dataset, chunk, (row_number() OVER (PARTITION BY chunk ORDER BY record) - 1)::BIGINT AS doc,
       source, line_base + record AS line,
       ('0x' || left(sha256(key_name || chr(10) || (line_base + record)::VARCHAR), 16))::UBIGINT AS doc_key,
       list_sum(part_lengths)::BIGINT AS num_tokens,
       len(part_lengths)::BIGINT AS num_parts{columns}
FROM {source}

-- name: documents_kind_tokens
list_sum(list_transform(list_zip(part_lengths, part_kinds), lambda p: CASE WHEN p[2] = {kind} THEN p[1] ELSE 0 END))::BIGINT AS {name}

-- name: documents_metadata
{column} AS {name}

-- name: documents_of_filtered_dataset
-- The documents view's rows of a dataset defined by a filter (placeholder where): those of its
-- files' documents that its predicate selects, numbered within each chunk as its loader does.
SELECT * REPLACE ((row_number() OVER (PARTITION BY chunk ORDER BY doc) - 1)::BIGINT AS doc)
FROM ({select}) WHERE ({where})

-- name: documents_view
-- Placeholder selects: documents_of_dataset of each dataset with committed chunks, joined by UNION ALL BY NAME.
CREATE VIEW documents AS {selects};

-- name: documents_empty
SELECT NULL::VARCHAR AS dataset, NULL::BIGINT AS chunk, NULL::BIGINT AS doc, NULL::VARCHAR AS source,
       NULL::BIGINT AS line, NULL::UBIGINT AS doc_key, NULL::BIGINT AS num_tokens, NULL::BIGINT AS num_parts
WHERE false

-- name: document_stats
-- Documents, tokens and length percentiles per group of the documents view (placeholder by:
-- dataset, or dataset and a column of the view).
SELECT {by}, count(*)::BIGINT AS documents, coalesce(sum(num_tokens), 0)::BIGINT AS tokens,
       quantile_disc(num_tokens, 0.5)::BIGINT AS p50, quantile_disc(num_tokens, 0.9)::BIGINT AS p90,
       quantile_disc(num_tokens, 0.99)::BIGINT AS p99, max(num_tokens)::BIGINT AS max
FROM documents GROUP BY {by} ORDER BY {by};

-- name: image_stats
-- Image occurrences, distinct images, the occurrences' bytes (image_bytes: each image as often as
-- it is used) and size percentiles per dataset of the images view (datasets storing their images).
SELECT dataset, count(*)::BIGINT AS images, count(DISTINCT image_id)::BIGINT AS distinct_images,
       sum(num_bytes)::BIGINT AS image_bytes,
       quantile_disc(width, 0.5)::INTEGER AS width_p50, max(width)::INTEGER AS width_max,
       quantile_disc(height, 0.5)::INTEGER AS height_p50, max(height)::INTEGER AS height_max,
       quantile_disc(width::BIGINT * height, 0.5)::BIGINT AS pixels_p50,
       quantile_disc(width::BIGINT * height, 0.99)::BIGINT AS pixels_p99,
       quantile_disc(num_bytes, 0.5)::BIGINT AS bytes_p50, max(num_bytes)::BIGINT AS bytes_max
FROM images GROUP BY dataset ORDER BY dataset;

-- name: document_length_histogram
-- Documents per length bin of each dataset (and placeholder value: a column of the view, or
-- NULL): bin b holds lengths in [2^(b/k), 2^((b+1)/k)) tokens, k = per_octave (0 joins bin 0).
SELECT dataset, {value} AS value,
       floor(log2(greatest(num_tokens, 1)) * {per_octave})::INTEGER AS bin, count(*)::BIGINT AS documents
FROM documents GROUP BY ALL ORDER BY ALL;

-- name: demo_committed_chunks
-- lakeloader.demo.many_chunks: chunks of a dataset, and how many are committed.
SELECT count(*), count(*) FILTER (WHERE status = 'committed') FROM chunks WHERE dataset = $name;

-- name: demo_copy_rows
-- The rows of one table (placeholder: chunks, row_groups or chunk_examples) of a dataset's chunks.
CREATE OR REPLACE TEMP TABLE demo_rows AS FROM {table} WHERE dataset = $name;

-- name: demo_delete_rows
DELETE FROM {table} WHERE dataset = $name;

-- name: demo_repeat_rows
-- Chunk i of the grown dataset is a copy of chunk i % base (its rows; its file is shared).
INSERT INTO {table} SELECT r.* REPLACE (g.i AS global_index)
FROM range($chunks) g(i) JOIN demo_rows r ON r.global_index = g.i % $base;

-- name: committed_among
-- Those of chunks $global_index of dataset $name committed already.
SELECT global_index FROM chunks
WHERE dataset = $name AND status = 'committed' AND list_contains($global_index, global_index);

-- name: insert_document_index_file
INSERT INTO document_index_files VALUES ($path, $dataset, $first_chunk, $last_chunk, $num_chunks, $num_docs,
                                         $num_bytes, $checksum, now()::TIMESTAMP);

-- name: insert_document_index_chunks
INSERT INTO document_index_chunks
SELECT dataset, global_index, path AS chunk_path, $path FROM chunks
WHERE dataset = $dataset AND list_contains($global_index, global_index);

-- name: document_index_files_of_dataset
SELECT path, num_chunks, num_docs, first_chunk, checksum, num_bytes FROM document_index_files WHERE dataset = $name ORDER BY first_chunk, path;

-- name: move_document_index_chunks
-- The rows of index files $paths now held by the index file $path (then drop_document_index_files).
UPDATE document_index_chunks SET path = $path WHERE list_contains($paths, path);

-- name: drop_document_index_files
DELETE FROM document_index_files WHERE list_contains($paths, path);

-- name: forget_document_index_chunks
-- (The chunks of index files $paths are read from their chunk files again.)
DELETE FROM document_index_chunks WHERE list_contains($paths, path);

-- name: document_index_chunk_keys
-- The chunks (dataset, global_index) whose rows index files $paths hold.
SELECT dataset, global_index FROM document_index_chunks WHERE list_contains($paths, path);

-- name: document_index_chunks_of
-- The chunks whose rows index files $paths hold.
SELECT global_index FROM document_index_chunks WHERE list_contains($paths, path) ORDER BY global_index;

-- name: attach_delta
-- A delta being published (lakeloader/catalog/delta.py) is gathered in an in-memory database
-- attached under the name the reader index's queries read ({name}), so the same queries give the
-- delta's index rows.
ATTACH ':memory:' AS {name};

-- name: detach_delta
DETACH {name};

-- name: delta_keyed_rows
-- Every row of a keyed table ({table}) of the chunks the delta replaces (the view delta_keys);
-- the bounds let DuckDB skip the row groups of other chunks.
CREATE TABLE {name}.{table} AS
SELECT t.* FROM {table} t SEMI JOIN delta_keys k ON t.dataset = k.dataset AND t.global_index = k.global_index
WHERE t.global_index BETWEEN $lo AND $hi;

-- name: copy_table
-- Every row of a table of the writer's catalog, copied into the database attached as {name}: a
-- delta being published (a whole table) or a full snapshot. Rows only, without the table's keys:
-- a snapshot is only read, and building the keys' indexes was over half of a whole copy's time and
-- a third of its bytes (catalog/snapshot.py _copy_catalog).
CREATE TABLE {name}.{table} AS FROM {table};

-- name: memory_held
SELECT sum(memory_usage_bytes) FROM duckdb_memory();

-- name: limit_memory
-- While a snapshot is copied ({limit}: bytes): DuckDB spills to disk what does not fit.
SET memory_limit = '{limit}B';

-- name: unlimit_memory
RESET memory_limit;

-- name: attach_snapshot_rows
-- The catalog file whose rows a new writer catalog takes (``writer_catalog_from``), read-only.
ATTACH $path AS snapshot_rows (READ_ONLY);

-- name: snapshot_tables
SELECT table_name FROM duckdb_tables() WHERE database_name = 'snapshot_rows' ORDER BY table_name;

-- name: snapshot_schema_version
SELECT value FROM snapshot_rows.lake_meta WHERE key = 'schema_version';

-- name: snapshot_next_build_id
SELECT coalesce(max(build_id), 0) + 1 FROM snapshot_rows.builds;

-- name: start_build_ids
-- Before catalog/schema.sql, so that build ids go on after those of the rows taken over.
CREATE SEQUENCE build_ids START {start};

-- name: take_snapshot_rows
INSERT INTO {table} BY NAME FROM snapshot_rows.{table};

-- name: detach_snapshot_rows
DETACH snapshot_rows;

-- name: delta_no_rows
CREATE TABLE {name}.{table} AS FROM {table} LIMIT 0;

-- name: delta_rows
FROM {name}.{table};

-- name: delta_schema
-- A reader's in-memory copy of what a published version's deltas add to its base snapshot
-- (lakeloader/catalog/delta.py): the chunks they replace (keys) and each carried table's rows.
CREATE SCHEMA lakeloader_delta

-- name: delta_keys_table
CREATE TABLE lakeloader_delta.keys AS SELECT dataset::VARCHAR AS dataset, global_index::BIGINT AS global_index
FROM delta_rows_keys

-- name: delta_table
-- {table}: a table the deltas carry, of {columns}: the columns the base file stores for it, typed
-- as there; the deltas' rows (the view delta_rows_{table}) inserted by name (a column the file
-- lacks, or of another type that does not cast, fails).
CREATE TABLE lakeloader_delta.{table} AS SELECT {columns} FROM lake.main.{table} LIMIT 0;
INSERT INTO lakeloader_delta.{table} BY NAME FROM delta_rows_{table}

-- name: reader_keyed_table
-- reader_table of a keyed table under deltas: the base file's rows of the chunks no delta
-- replaces, and the deltas' rows.
CREATE VIEW {table} AS
SELECT {columns} FROM lake.main.{table} b
WHERE NOT EXISTS (SELECT 1 FROM lakeloader_delta.keys k WHERE k.dataset = b.dataset AND k.global_index = b.global_index)
UNION ALL
SELECT {columns} FROM lakeloader_delta.{table};

-- name: reader_whole_table
-- reader_table of a table the deltas carry whole.
CREATE VIEW {table} AS SELECT {columns} FROM lakeloader_delta.{table};

-- name: apply_delete_keyed
-- A build adopting a published version (lakeloader/catalog/delta.py apply_deltas): the base's
-- rows of {table} of the chunks its deltas replace (the view delta_keys) ...
DELETE FROM {table} t WHERE EXISTS (
    SELECT 1 FROM delta_keys k WHERE k.dataset = t.dataset AND k.global_index = t.global_index);

-- name: apply_delete_whole
-- ... or every row of a table the deltas carry whole ...
DELETE FROM {table};

-- name: apply_insert
-- ... then the deltas' rows of it (the view delta_rows).
INSERT INTO {table} BY NAME FROM delta_rows;

-- name: image_sizes
-- Width and height of every image occurrence of a dataset's committed chunks (the audit's image
-- tokens, counted under the config's resolution).
SELECT width, height FROM images WHERE dataset = $name;

-- name: media_rewrites
-- The committed chunks of dataset $name whose media file (their own: no media_files row) holds
-- images that a lower chunk holds too, with the ids of the images they are the lowest chunk of
-- (keep), to rewrite without the others (dropped: each with the lowest chunk holding it), in
-- global order (ingest/media_dedup.py).
WITH owners AS (
    SELECT image_id, min(global_index) AS owner FROM chunk_images WHERE dataset = $name GROUP BY image_id
), held AS (
    SELECT DISTINCT i.global_index, i.image_id, o.owner
    FROM chunk_images i JOIN owners o ON o.image_id = i.image_id
    WHERE i.dataset = $name
)
SELECT c.global_index, c.path, c.media_bytes, c.media_checksum,
       coalesce(list(h.image_id ORDER BY h.image_id) FILTER (WHERE h.owner = c.global_index), []::VARCHAR[]) AS keep,
       list({'image_id': h.image_id, 'owner': h.owner} ORDER BY h.image_id) FILTER (WHERE h.owner < c.global_index)
           AS dropped
FROM chunks c JOIN held h ON h.global_index = c.global_index
WHERE c.dataset = $name AND c.status = 'committed' AND c.media_checksum IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM media_files m WHERE m.dataset = c.dataset AND m.global_index = c.global_index)
GROUP BY c.global_index, c.path, c.media_bytes, c.media_checksum
HAVING bool_or(h.owner < c.global_index)
ORDER BY c.global_index;

-- name: insert_media_files
INSERT OR REPLACE INTO media_files
SELECT $dataset, unnest($global_index), unnest($path), unnest($num_images), unnest($num_bytes), unnest($checksum);

-- name: forget_media_files
-- (Chunks $global_index of $dataset read their own media files again.)
DELETE FROM media_files WHERE dataset = $dataset AND list_contains($global_index, global_index);

-- name: deduped_media_files
-- Each chunk file whose media file a build's end rewrote, and that file.
SELECT c.path, m.path FROM media_files m
JOIN chunks c ON c.dataset = m.dataset AND c.global_index = m.global_index;

-- name: current_media_files
-- The committed chunks of dataset $name storing images: chunk file and rewritten media file (or NULL).
SELECT c.global_index, c.path, m.path AS deduped FROM chunks c
LEFT JOIN media_files m ON m.dataset = c.dataset AND m.global_index = c.global_index
WHERE c.dataset = $name AND c.status = 'committed' AND c.media_checksum IS NOT NULL
ORDER BY c.global_index;

-- name: media_file_paths
-- The chunk file of every committed chunk storing images, and its rewritten media file (or NULL).
SELECT c.dataset, c.path, m.path FROM chunks c
LEFT JOIN media_files m ON m.dataset = c.dataset AND m.global_index = c.global_index
WHERE c.media_checksum IS NOT NULL AND c.status = 'committed';

-- name: has_media_files
-- Whether the catalog has the media_files table (a catalog written before it has none).
SELECT count(*) > 0 FROM (SELECT table_name AS name, database_name FROM duckdb_tables()
                          UNION ALL SELECT view_name, database_name FROM duckdb_views())
WHERE database_name = current_database() AND name = 'media_files';

-- name: counted_dataset_progress
-- The rows of dataset_progress counted from the chunk rows (columns in table order): what the
-- counters always equal. A shard is complete as the shards view has it: as many chunks committed
-- as it has splits (none, for a file without any).
WITH per_shard AS (
    SELECT dataset, shard_index, count(*) FILTER (WHERE status = 'committed') AS done
    FROM chunks GROUP BY dataset, shard_index
), shard_counts AS (
    SELECT s.dataset, count(*) AS num_shards, count(*) FILTER (WHERE coalesce(p.done, 0) = s.num_splits) AS shards_done
    FROM shard_plans s LEFT JOIN per_shard p ON p.dataset = s.dataset AND p.shard_index = s.shard_index
    GROUP BY s.dataset
), chunk_counts AS (
    SELECT dataset, count(*) AS num_chunks, count(*) FILTER (WHERE status = 'committed') AS chunks_done,
           coalesce(min(global_index) FILTER (WHERE status <> 'committed'), count(*)) AS prefix_chunks,
           sum(num_docs) AS num_docs, sum(num_tokens) AS num_tokens, sum(num_bytes) AS num_bytes,
           sum(source_bytes) AS source_bytes
    FROM chunks GROUP BY dataset
), reject_counts AS (
    SELECT dataset, count(*) AS num_rejects FROM rejects GROUP BY dataset
)
SELECT d.name AS dataset, coalesce(s.num_shards, 0)::BIGINT AS num_shards,
       coalesce(s.shards_done, 0)::BIGINT AS shards_done, coalesce(c.num_chunks, 0)::BIGINT AS num_chunks,
       coalesce(c.chunks_done, 0)::BIGINT AS chunks_done, coalesce(c.prefix_chunks, 0)::BIGINT AS prefix_chunks,
       coalesce(c.num_docs, 0)::BIGINT AS num_docs, coalesce(c.num_tokens, 0)::BIGINT AS num_tokens,
       coalesce(c.num_bytes, 0)::BIGINT AS num_bytes, coalesce(c.source_bytes, 0)::BIGINT AS source_bytes,
       coalesce(r.num_rejects, 0)::BIGINT AS num_rejects
FROM dataset_plans d
LEFT JOIN shard_counts s ON s.dataset = d.name
LEFT JOIN chunk_counts c ON c.dataset = d.name
LEFT JOIN reject_counts r ON r.dataset = d.name

-- name: counted_shard_progress
-- The rows of shard_progress counted from the chunk rows (columns in table order).
SELECT c.dataset, min(c.global_index)::BIGINT AS global_index, c.shard_index, s.num_splits::BIGINT AS num_splits,
       count(*) FILTER (WHERE c.status = 'committed')::BIGINT AS chunks_done,
       coalesce(sum(c.num_docs), 0)::BIGINT AS docs_done,
       coalesce(sum(c.num_tokens), 0)::BIGINT AS tokens_done,
       coalesce(sum(c.num_rejects), 0)::BIGINT AS rejects
FROM chunks c JOIN shard_plans s ON s.dataset = c.dataset AND s.shard_index = c.shard_index
GROUP BY c.dataset, c.shard_index, s.num_splits

-- name: counted_plan_folders
-- The rows of plan_folders found from the chunk rows. (A chunk's file in its own plan's folder, as
-- every chunk of a dataset built from sources, is matched by a prefix comparison: only the others'
-- folders are extracted.)
SELECT DISTINCT c.dataset, regexp_extract(c.path, '^(.*)/[^/]*$', 1) AS folder
FROM chunks c JOIN dataset_plans d ON d.name = c.dataset
WHERE NOT starts_with(c.path, d.chunk_dir || '/') OR contains(c.path[length(d.chunk_dir) + 2:], '/')

-- name: counted_view
-- A reader's table of counters of a catalog written before them: their count from the chunk rows
-- (placeholders: the table, and its counted_dataset_progress, counted_shard_progress or
-- counted_plan_folders).
CREATE VIEW {table} AS {select};

-- name: progress_differs
-- Whether the counters differ from their count from the chunk rows (placeholders datasets, shards
-- and folders: counted_dataset_progress, counted_shard_progress and counted_plan_folders).
SELECT EXISTS (FROM dataset_progress EXCEPT ALL FROM ({datasets}))
    OR EXISTS (FROM ({datasets}) EXCEPT ALL FROM dataset_progress)
    OR EXISTS (FROM shard_progress EXCEPT ALL FROM ({shards}))
    OR EXISTS (FROM ({shards}) EXCEPT ALL FROM shard_progress)
    OR EXISTS (FROM plan_folders EXCEPT ALL FROM ({folders}))
    OR EXISTS (FROM ({folders}) EXCEPT ALL FROM plan_folders);

-- name: recount_progress
-- The counters of datasets $datasets (NULL: every dataset) counted afresh from their chunk rows
-- (placeholders as above).
DELETE FROM dataset_progress WHERE $datasets IS NULL OR list_contains($datasets, dataset);
DELETE FROM shard_progress WHERE $datasets IS NULL OR list_contains($datasets, dataset);
INSERT INTO dataset_progress SELECT * FROM ({datasets}) WHERE $datasets IS NULL OR list_contains($datasets, dataset);
INSERT INTO shard_progress SELECT * FROM ({shards}) WHERE $datasets IS NULL OR list_contains($datasets, dataset);
DELETE FROM plan_folders WHERE $datasets IS NULL OR list_contains($datasets, dataset);
INSERT INTO plan_folders SELECT * FROM ({folders}) WHERE $datasets IS NULL OR list_contains($datasets, dataset);

-- name: count_committed_dataset
-- What a commit adds to one dataset's counters: the chunks it committed, their sums and the
-- shards it completed. $first, the lowest of those chunks, is where the committed prefix ended if
-- the commit moves it (every chunk below the prefix is committed, so the commit's chunks lie at or
-- above it): then it ends at the first uncommitted chunk of the $window from $first on, or after
-- that window (the caller looks further). Returns the prefix and the planned chunks.
UPDATE dataset_progress SET
    shards_done = shards_done + $shards_done, chunks_done = chunks_done + $chunks,
    num_docs = num_docs + $num_docs, num_tokens = num_tokens + $num_tokens, num_bytes = num_bytes + $num_bytes,
    source_bytes = source_bytes + $source_bytes, num_rejects = num_rejects + $num_rejects,
    prefix_chunks = CASE WHEN prefix_chunks = $first THEN coalesce(
        (SELECT min(global_index) FROM chunks
         WHERE dataset = $dataset AND global_index BETWEEN $first AND $first + $window - 1 AND status <> 'committed'),
        least($first + $window, num_chunks)) ELSE prefix_chunks END
WHERE dataset = $dataset
RETURNING prefix_chunks, num_chunks;

-- name: count_committed_shards
-- What a commit adds to its shards' counters: per shard (one element each). Returns their keys and
-- whether they are complete now (then by this commit: it commits at least one chunk of each).
UPDATE shard_progress p SET
    chunks_done = p.chunks_done + b.chunks, docs_done = p.docs_done + b.num_docs,
    tokens_done = p.tokens_done + b.num_tokens, rejects = p.rejects + b.num_rejects
FROM (SELECT unnest($dataset) AS dataset, unnest($shard_index) AS shard_index, unnest($chunks) AS chunks,
             unnest($num_docs) AS num_docs, unnest($num_tokens) AS num_tokens, unnest($num_rejects) AS num_rejects) b
WHERE p.dataset = b.dataset AND p.shard_index = b.shard_index
RETURNING p.dataset, p.global_index, p.chunks_done = p.num_splits;

-- name: count_committed_shard
-- count_committed_shards for a commit of one shard: its values as scalars, found without a join
-- (about half the time: what a driver receiving results one at a time pays for each).
UPDATE shard_progress SET
    chunks_done = chunks_done + $chunks, docs_done = docs_done + $num_docs,
    tokens_done = tokens_done + $num_tokens, rejects = rejects + $num_rejects
WHERE dataset = $dataset AND shard_index = $shard_index
RETURNING dataset, global_index, chunks_done = num_splits;

-- name: next_uncommitted
-- The lowest global index of an uncommitted chunk of a dataset in [$lo, $hi] (NULL: none): where
-- its committed prefix ends, looked for a window at a time from where count_committed_dataset left it.
SELECT min(global_index) FROM chunks
WHERE dataset = $name AND global_index BETWEEN $lo AND $hi AND status <> 'committed';

-- name: set_committed_prefix
UPDATE dataset_progress SET prefix_chunks = $prefix WHERE dataset = $name;

-- Views derived from the tables of schema.sql. Progress is read from its counters (dataset_progress,
-- shard_progress), which the writer keeps equal to their count from the chunk rows.
-- They build on prefix.sql (committed_prefix), defined first: readers need only that one.

-- Per-shard progress (the counters of shard_progress: a row per shard whatever the number of chunks).
CREATE OR REPLACE VIEW shards AS
SELECT
    s.dataset,
    s.shard_index,
    s.source,
    s.layout,
    s.compression,
    s.size_bytes,
    s.num_splits,
    coalesce(p.chunks_done, 0)::BIGINT AS chunks_done,
    coalesce(p.docs_done, 0)::BIGINT AS docs_done,
    coalesce(p.tokens_done, 0)::BIGINT AS tokens_done,
    coalesce(p.rejects, 0)::BIGINT AS rejects,
    CASE
        WHEN coalesce(p.chunks_done, 0) = s.num_splits THEN 'complete'
        WHEN p.chunks_done > 0 THEN 'building'
        ELSE 'planned'
    END AS status
FROM shard_plans s
LEFT JOIN shard_progress p ON p.dataset = s.dataset AND p.shard_index = s.shard_index;

-- Committed-prefix chunks with cumulative document and token offsets within their dataset.
CREATE OR REPLACE VIEW chunk_offsets AS
SELECT
    c.dataset,
    c.global_index,
    c.shard_index,
    c.split_index,
    c.path,
    c.num_docs,
    c.num_tokens,
    c.num_bytes,
    c.checksum,
    (sum(c.num_docs) OVER w - c.num_docs)::BIGINT AS first_doc,
    (sum(c.num_tokens) OVER w - c.num_tokens)::BIGINT AS first_token
FROM chunks c
JOIN committed_prefix p ON p.dataset = c.dataset AND c.global_index < p.num_chunks
WINDOW w AS (PARTITION BY c.dataset ORDER BY c.global_index ROWS UNBOUNDED PRECEDING);

-- One row per dataset with planned chunks and its progress (the counters of dataset_progress).
CREATE OR REPLACE VIEW datasets AS
SELECT
    d.name,
    d.fingerprint,
    CASE
        WHEN p.chunks_done = p.num_chunks THEN 'complete'
        WHEN p.chunks_done > 0 THEN 'building'
        ELSE 'planned'
    END AS status,
    p.num_shards,
    p.num_chunks,
    p.chunks_done,
    p.prefix_chunks,
    p.num_docs,
    p.num_tokens,
    p.num_bytes,
    p.source_bytes,
    p.num_rejects,
    d.format,
    d.token_type,
    d.vocab_size,
    d.chunk_dir,
    d.planned_at
FROM dataset_plans d
JOIN dataset_progress p ON p.dataset = d.name AND p.num_chunks > 0;

-- The mixture schedule of a registered mixture (tables mixtures, mixture_stages, mixture_nodes),
-- the analyst's view of lakeloader.index.mixture.schedule (what the loader and the audit use; equal
-- bit for bit, tests/test_specs.py): one row per (step, dataset) for the
-- global steps [first_step, stop_step) (stop_step excluded, as `lakeloader audit --steps A:B`).
--   examples         examples of the dataset in the step's batch
--   before, after    the dataset's stream indices that fed the step are [before, after)
--   stage_before/after, stage_examples
--                    the same counts from the start of the step's stage (counts restart at each
--                    stage's start_step; stream indices continue) and the stage's examples so far
--   target_weight    the stage's (quantised) weight of the dataset
--   deviation        |stage_after - target_weight * stage_examples|, which stays below 2
-- Every count is exact integer (HUGEINT) arithmetic over the stage's Huffman tree.
CREATE OR REPLACE MACRO mixture_plan(mixture, first_step, stop_step) AS TABLE
WITH RECURSIVE
mix AS (
    SELECT batch_size, datasets FROM mixtures WHERE mixture_id = mixture
),
dataset_numbers AS (
    SELECT unnest(range(len(datasets))) AS dataset FROM mix
),
stages AS (
    -- lo..hi: the steps of the range inside the stage (none when lo > hi)
    SELECT stage, start_step, end_step, quanta, total_weight,
           greatest(first_step, start_step) AS lo,
           least(stop_step - 1, coalesce(end_step - 1, stop_step - 1)) AS hi
    FROM mixture_stages WHERE mixture_id = mixture
),
points AS (
    -- the steps of the range, as the batches m done in their stage by their end (m >= 1), and
    -- the full length of each stage ending before stop_step (where later stages' indices start)
    SELECT stage, unnest(range(lo - start_step + 1, hi - start_step + 2)) AS m FROM stages WHERE lo <= hi
    UNION
    SELECT stage, end_step - start_step AS m FROM stages WHERE end_step < stop_step
),
counts(stage, m, node, dataset, c0, c1) AS (
    -- each node's count after m - 1 (c0) and m (c1) whole batches of the stage: the root holds
    -- all the stage's examples, and each child takes its share of its parent's count
    SELECT p.stage, p.m, t.node, t.dataset,
           (p.m - 1)::HUGEINT * (SELECT batch_size FROM mix), p.m::HUGEINT * (SELECT batch_size FROM mix)
    FROM points p
    JOIN mixture_nodes t ON t.mixture_id = mixture AND t.stage = p.stage AND t.parent IS NULL
    UNION ALL
    SELECT c.stage, c.m, t.node, t.dataset,
           CASE WHEN t.is_first THEN f0 ELSE c.c0 - f0 END,
           CASE WHEN t.is_first THEN f1 ELSE c.c1 - f1 END
    FROM counts c
    JOIN mixture_nodes t ON t.mixture_id = mixture AND t.stage = c.stage AND t.parent = c.node,
    LATERAL (SELECT (2 * t.split_weight * c.c0 + t.parent_weight) // (2 * t.parent_weight) AS f0,
                    (2 * t.split_weight * c.c1 + t.parent_weight) // (2 * t.parent_weight) AS f1)
),
grid AS MATERIALIZED (
    -- every dataset at every point (a dataset without weight in a stage draws nothing in it)
    SELECT p.stage, p.m, d.dataset, coalesce(c.c0, 0)::BIGINT AS c0, coalesce(c.c1, 0)::BIGINT AS c1
    FROM points p
    CROSS JOIN dataset_numbers d
    LEFT JOIN counts c ON c.stage = p.stage AND c.m = p.m AND c.dataset = d.dataset
),
bases AS (
    -- examples of each dataset drawn by all the stages before each stage of the range
    SELECT s.stage, d.dataset, coalesce(sum(g.c1), 0)::BIGINT AS base
    FROM stages s
    CROSS JOIN dataset_numbers d
    LEFT JOIN (grid g JOIN stages e ON e.stage = g.stage AND g.m = e.end_step - e.start_step)
        ON g.dataset = d.dataset AND g.stage < s.stage
    WHERE s.lo <= s.hi
    GROUP BY s.stage, d.dataset
)
SELECT
    s.start_step + g.m - 1 AS step,
    g.stage,
    x.datasets[g.dataset + 1] AS dataset,
    g.dataset::INTEGER AS dataset_index,
    g.c1 - g.c0 AS examples,
    b.base + g.c0 AS before,
    b.base + g.c1 AS after,
    g.c0 AS stage_before,
    g.c1 AS stage_after,
    g.m * x.batch_size AS stage_examples,
    s.quanta[g.dataset + 1] / s.total_weight AS target_weight,
    abs(g.c1::HUGEINT * s.total_weight
        - s.quanta[g.dataset + 1]::HUGEINT * g.m * x.batch_size)::DOUBLE / s.total_weight AS deviation
FROM grid g
CROSS JOIN mix x
JOIN stages s ON s.stage = g.stage
JOIN bases b ON b.stage = g.stage AND b.dataset = g.dataset
WHERE g.m BETWEEN s.lo - s.start_step + 1 AND s.hi - s.start_step + 1
ORDER BY step, dataset_index;

-- Proportions of a registered mixture over the global steps [first_step, stop_step) (stop_step
-- excluded), one row per dataset: its examples in those steps and their share, the target (the
-- example-weighted mean of the stages' weights over the steps), the dataset's stream indices
-- [first_index, end_index) that fed them, and the largest deviation of mixture_plan.
CREATE OR REPLACE MACRO mixture_proportions(mixture, first_step, stop_step) AS TABLE
SELECT
    dataset,
    dataset_index,
    sum(target_weight) / count(*) AS target_weight,
    sum(examples)::BIGINT AS examples,
    sum(examples) / sum(sum(examples)) OVER () AS share,
    min(before) AS first_index,
    max(after) AS end_index,
    max(deviation) AS max_deviation
FROM mixture_plan(mixture, first_step, stop_step)
GROUP BY dataset, dataset_index
ORDER BY dataset_index;

-- Per dataset and packing plan (loader.packing pack | pad): examples, non-padding tokens and the
-- padding fraction over the chunks counted so far, and what long documents cost.
CREATE OR REPLACE VIEW packing AS
SELECT
    p.dataset,
    p.plan_key,
    p.mode,
    p.seq_len,
    count(e.global_index) AS chunks,
    coalesce(sum(e.num_examples), 0)::BIGINT AS examples,
    coalesce(sum(e.num_tokens), 0)::BIGINT AS tokens,
    1 - coalesce(sum(e.num_tokens), 0) / nullif(sum(e.num_examples) * p.seq_len, 0) AS padding_fraction,
    coalesce(sum(e.split_docs), 0)::BIGINT AS split_docs,
    coalesce(sum(e.truncated_docs), 0)::BIGINT AS truncated_docs,
    coalesce(sum(e.dropped_tokens), 0)::BIGINT AS dropped_tokens,
    p.spec,
    p.created_at
FROM packing_plans p
LEFT JOIN chunk_examples e ON e.dataset = p.dataset AND e.plan_key = p.plan_key
GROUP BY p.dataset, p.plan_key, p.mode, p.seq_len, p.spec, p.created_at;

-- The images of committed chunks: one row per image occurrence in a document (datasets with
-- interleaved.images: stored), its size after EXIF orientation, format and stored bytes.
CREATE OR REPLACE VIEW images AS
SELECT i.dataset, i.global_index AS chunk, i.doc, i.image, i.image_id, i.width, i.height, i.format, i.mode,
       i.num_bytes
FROM chunk_images i
JOIN chunks c ON c.dataset = i.dataset AND c.global_index = i.global_index AND c.status = 'committed';

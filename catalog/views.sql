-- Views derived from the tables of schema.sql. Progress is never stored twice: it is computed here.

-- Per-shard progress.
CREATE OR REPLACE VIEW shards AS
SELECT
    s.dataset,
    s.shard_index,
    s.source,
    s.layout,
    s.compression,
    s.size_bytes,
    s.num_splits,
    count(c.global_index) FILTER (WHERE c.status = 'committed') AS chunks_done,
    coalesce(sum(c.num_docs), 0)::BIGINT AS docs_done,
    coalesce(sum(c.num_tokens), 0)::BIGINT AS tokens_done,
    coalesce(sum(c.num_rejects), 0)::BIGINT AS rejects,
    CASE
        WHEN chunks_done = s.num_splits THEN 'complete'
        WHEN chunks_done > 0 THEN 'building'
        ELSE 'planned'
    END AS status
FROM shard_plans s
LEFT JOIN chunks c ON c.dataset = s.dataset AND c.shard_index = s.shard_index
GROUP BY s.dataset, s.shard_index, s.source, s.layout, s.compression, s.size_bytes, s.num_splits;

-- The longest run of committed chunks from global index 0, per dataset: what readers may read.
CREATE OR REPLACE VIEW committed_prefix AS
SELECT
    dataset,
    coalesce(min(global_index) FILTER (WHERE status <> 'committed'), count(*))::BIGINT AS num_chunks,
    count(*)::BIGINT AS planned_chunks
FROM chunks
GROUP BY dataset;

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

-- One row per dataset with its progress.
CREATE OR REPLACE VIEW datasets AS
SELECT
    d.name,
    d.fingerprint,
    CASE
        WHEN agg.chunks_done = agg.num_chunks THEN 'complete'
        WHEN agg.chunks_done > 0 THEN 'building'
        ELSE 'planned'
    END AS status,
    (SELECT count(*) FROM shard_plans s WHERE s.dataset = d.name) AS num_shards,
    agg.num_chunks,
    agg.chunks_done,
    p.num_chunks AS prefix_chunks,
    agg.num_docs,
    agg.num_tokens,
    agg.num_bytes,
    agg.source_bytes,
    (SELECT count(*) FROM rejects r WHERE r.dataset = d.name) AS num_rejects,
    d.format,
    d.token_type,
    d.vocab_size,
    d.chunk_dir,
    d.planned_at
FROM dataset_plans d
JOIN (
    SELECT
        dataset,
        count(*) AS num_chunks,
        count(*) FILTER (WHERE status = 'committed') AS chunks_done,
        coalesce(sum(num_docs), 0)::BIGINT AS num_docs,
        coalesce(sum(num_tokens), 0)::BIGINT AS num_tokens,
        coalesce(sum(num_bytes), 0)::BIGINT AS num_bytes,
        coalesce(sum(source_bytes), 0)::BIGINT AS source_bytes
    FROM chunks
    GROUP BY dataset
) agg ON agg.dataset = d.name
JOIN committed_prefix p ON p.dataset = d.name;

-- The view every reader needs and the table macro of chunks' source lines, defined before
-- views.sql (whose views build on them). A loader's catalog connection defines only these up
-- front: the analyst views of views.sql cost ~18 ms to define and are defined when the
-- connection first runs SQL of its user's.

-- The longest run of committed chunks from global index 0, per dataset: what readers may read.
CREATE OR REPLACE VIEW committed_prefix AS
SELECT
    dataset,
    coalesce(min(global_index) FILTER (WHERE status <> 'committed'), count(*))::BIGINT AS num_chunks,
    count(*)::BIGINT AS planned_chunks
FROM chunks
GROUP BY dataset;

-- Each chunk's line_base of datasets `datasets` (a list of names; NULL: every dataset), of the
-- shards `shards` only if given (a list of {dataset, shard_index}): the line (1-based, text/JSON
-- Lines) or row (0-based, Parquet) of its record 0 in its source file, NULL for a byte split while
-- an earlier split of its file is not committed (its line count is unknown). What the documents
-- view's lines and doc_key, and a filtered dataset's selections, start from.
CREATE OR REPLACE MACRO chunk_lines(datasets, shards := NULL) AS TABLE
SELECT dataset, global_index, path,
       CASE WHEN split_kind = 'row_group' THEN first_row
            WHEN committed_before = split_index THEN records_before + 1 END AS line_base
FROM (
    SELECT *,
           coalesce(sum(num_records) OVER w, 0) AS records_before,
           coalesce(count(CASE WHEN status = 'committed' THEN 1 END) OVER w, 0) AS committed_before
    FROM chunks
    WHERE (datasets IS NULL OR list_contains(datasets, dataset))
      AND (shards IS NULL OR list_contains(shards, {'dataset': dataset, 'shard_index': shard_index}))
    WINDOW w AS (PARTITION BY dataset, shard_index ORDER BY split_index
                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
);

-- The view every reader needs, defined before views.sql (whose views build on it). A loader's
-- catalog connection defines only this one up front: the analyst views of views.sql cost ~18 ms
-- to define and are defined when the connection first runs SQL of its user's.

-- The longest run of committed chunks from global index 0, per dataset: what readers may read.
CREATE OR REPLACE VIEW committed_prefix AS
SELECT
    dataset,
    coalesce(min(global_index) FILTER (WHERE status <> 'committed'), count(*))::BIGINT AS num_chunks,
    count(*)::BIGINT AS planned_chunks
FROM chunks
GROUP BY dataset;

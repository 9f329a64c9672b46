"""The catalog's SQL (schema, views, named queries), shipped in the wheel as ``lakeloader.sql``."""

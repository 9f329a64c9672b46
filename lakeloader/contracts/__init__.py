"""Contracts: what the stages agree on and nothing else. The errors users catch, the chunk-file
schema and build-task report, record formats and the plain specs the index maps take. Every stage
may import this package; it imports no stage and no config."""

VERSION = "0.1.0"   # the package version, recorded in every build

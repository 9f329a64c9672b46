"""The ``lakeloader`` command line (the stable contract of docs/design.md)."""

from __future__ import annotations

import argparse
import errno
import functools
import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from lakeloader.catalog.sql import ALLOWED_SQL, STATUS_TABLES
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.report.tables import FORMATS, SHOWN_SHARDS, audit_heading, format_frame, format_status

if TYPE_CHECKING:
    from lakeloader.feed.loader import Loader

WHOLE_LAKE_HELP = ("answer for every dataset of the lake; given a CONFIG, status and stats answer for its "
                   "datasets only (a lake is shared by several configs)")
DESCRIPTION = """\
lakeloader turns raw text corpora into a tokenized Parquet data lake (built on Dask,
catalogued in DuckDB) and streams deterministic training batches from it.

CONFIG is a YAML file (see configs/demo.yaml); relative paths in it are relative to
the file's folder. LAKE is a lake folder or URL (s3://bucket/prefix)."""


# OS errors of a full, read-only or forbidden disk: a clear message, never a traceback.
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def _print_frame(frame: pd.DataFrame, fmt: str) -> None:
    """``frame`` on stdout as :func:`lakeloader.report.tables.format_frame` formats it."""
    sys.stdout.write(format_frame(frame, fmt))


def _cmd_build(args: argparse.Namespace) -> int:
    from lakeloader.ingest.driver import build

    report = build(args.config, workers=args.workers, scheduler=args.scheduler,
                   progress=not args.no_progress, recover_catalog=args.recover_catalog,
                   dashboard_address=args.dashboard_address)
    print(
        f"built {report.chunks_built} chunks ({report.chunks_total} in the lake): {report.docs:,} docs, "
        f"{report.tokens:,} tokens, {report.rejects} rejects in {report.seconds:.1f}s "
        f"({report.tokens_per_s:,.0f} tokens/s) -> {report.lake}"
    )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from lakeloader.catalog.lake import open_lake

    text = args.table is None and args.format == "table"   # the text lists SHOWN_SHARDS shards at most
    tables = open_lake(args.target).status(whole_lake=args.whole_lake, shards_shown=SHOWN_SHARDS if text else None)
    if args.table is not None:
        _print_frame(tables[args.table], args.format)
        return 0
    if args.format == "csv":
        raise LakeloaderError(f"--format csv prints one table: choose it with --table {{{','.join(tables)}}}")
    sys.stdout.write(format_status(tables, args.format))
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from lakeloader.catalog.gc import remove_stale
    from lakeloader.catalog.lake import open_lake

    stale = remove_stale(open_lake(args.target), dry_run=args.dry_run)
    _print_frame(stale, args.format)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(stale)} stale chunk folders and documents index files: {int(stale['files'].sum())} files, "
          f"{int(stale['bytes'].sum()):,} bytes", file=sys.stderr)
    return 0


def _cmd_sql(args: argparse.Namespace) -> int:
    from lakeloader.catalog.lake import open_lake

    relations = {"run_segments": _run_segments(args.target, args.state, None)} if args.state else None
    _print_frame(open_lake(args.target).sql(args.query, relations=relations), args.format)
    return 0


def _run_segments(config: str, state_path: str, stop: int | None) -> pd.DataFrame:
    """The ``run_segments`` table of the run saved in ``state_path`` under ``config``, over its
    steps so far (or ``[0, stop)``)."""
    from lakeloader.feed.loader import Loader
    from lakeloader.feed.run_audit import run_segments

    if not config.endswith((".yaml", ".yml")):
        raise LakeloaderError(f"--state needs the run's CONFIG (its mixture and loader settings), not the lake {config}")
    state = _read_state(state_path)
    with Loader(config) as loader:
        step = loader.follow(state)
        return run_segments(loader, stop if stop is not None else step)


def _cmd_stats(args: argparse.Namespace) -> int:
    from lakeloader.catalog.lake import open_lake
    from lakeloader.report.lengths_plot import plot_lengths

    if args.plot is None:
        _print_frame(open_lake(args.target).stats(by=args.by, whole_lake=args.whole_lake), args.format)
        return 0
    _print_frame(plot_lengths(args.target, args.plot, by=args.by, whole_lake=args.whole_lake), args.format)
    print(f"wrote the document-length histogram to {args.plot}", file=sys.stderr)
    return 0


def _report_verify(report: pd.DataFrame, output_format: str, prefix: str = "") -> int:
    """Print the damaged chunks of a verify report and a count line; returns how many are damaged."""
    bad = report[report.status != "ok"]
    if len(bad):
        _print_frame(bad, output_format)
    counts = ", ".join(f"{n} {status}" for status, n in report.status.value_counts().items())
    print(f"{prefix}verified {len(report)} files (chunks and documents index files): {counts or 'none'}",
          file=sys.stderr)
    return len(bad)


def _cmd_verify(args: argparse.Namespace) -> int:
    from lakeloader.ingest.repair import repair_lake
    from lakeloader.read.verify import verify_lake

    report = verify_lake(args.target, progress=not args.no_progress)
    damaged = _report_verify(report, args.format)
    if damaged and args.repair:
        report = repair_lake(args.target, report, workers=args.workers, scheduler=args.scheduler,
                             progress=not args.no_progress)
        damaged = _report_verify(report, args.format, prefix="after repair, ")
    elif damaged:
        print("run `lakeloader verify CONFIG --repair` to rebuild the damaged chunks", file=sys.stderr)
    return 1 if damaged else 0


def _steps(text: str) -> tuple[int, int]:
    try:
        first, last = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps must look like A:B (e.g. 0:10), got {text!r}") from None
    if not 0 <= first < last:
        raise argparse.ArgumentTypeError(f"--steps A:B needs 0 <= A < B, got {text!r}")
    return first, last


def _loader(args: argparse.Namespace) -> Loader:
    from lakeloader.feed.loader import Loader

    return Loader(args.config, process_index=args.process_index, process_count=args.process_count,
                  mode=args.mode)


def _check_writable(path: str) -> None:
    """Fail before any work when ``path`` cannot be written (no such folder, no permission)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise LakeloaderError(f"--out {path}: folder {folder} does not exist; create it or choose another path")
    if os.path.isdir(path):
        raise LakeloaderError(f"--out {path}: is a folder; give a file name such as {os.path.join(path, 'batches.npz')}")
    try:  # a real write tells what os.access cannot (a read-only mount, a full disk, root's rights)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".lakeloader-probe-"):
            pass
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
    except OSError as exc:
        raise _output_error(path, exc) from exc


def _output_error(path: str | None, exc: OSError) -> LakeloaderError:
    """The error for an output file (--out, --plot) that cannot be written."""
    return LakeloaderError(f"cannot write {path or 'a file'}: {exc.strerror}. Free space or choose a "
                           "writable location, then re-run")


def _read_state(path: str) -> dict[str, Any]:
    """A saved loader state (``Loader.state``) from a JSON file."""
    try:
        with open(path, encoding="utf-8") as file:
            found = json.load(file)
    except OSError as exc:
        raise LakeloaderError(f"--resume/--state {path}: {exc.strerror}; give the JSON file of a saved loader state") from None
    except json.JSONDecodeError as exc:
        raise LakeloaderError(f"--resume/--state {path}: not JSON (line {exc.lineno}: {exc.msg}); give the file "
                              "Loader.state() was saved to") from None
    if not isinstance(found, dict):
        raise LakeloaderError(f"--resume/--state {path}: holds a JSON {type(found).__name__}, not a loader state")
    return found


def _cmd_batches(args: argparse.Namespace) -> int:
    from lakeloader.feed.npz import write_batches

    _check_writable(args.out)
    first, stop = args.steps
    with _loader(args) as loader:
        if args.resume:
            loader.follow(_read_state(args.resume), continue_changes=args.continue_changes)
        elif args.continue_changes:
            raise LakeloaderError("--continue-changes continues the run of --resume STATE.json: give it too")
        loader.check_step(stop - 1)  # before computing any batch
        out, shapes = write_batches(loader, first, stop, args.out, progress=not args.no_progress)
        if args.save_state:
            with open(args.save_state, "w", encoding="utf-8") as file:
                json.dump(loader.state(stop), file)
    described = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
    print(f"wrote steps [{first}, {stop}), process {args.process_index} of {args.process_count}: "
          f"{described} -> {out}")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    _print_frame(_loader(args).explain(args.step), args.format)
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from lakeloader.catalog.audit import audit
    from lakeloader.report.audit_plot import plot_audit

    if args.state:
        frame = _run_segments(args.config, args.state, args.steps[1] if args.steps else None)
        if args.format == "table":
            print(f"run_segments: the run revised at steps {frame.attrs['revisions']}, steps "
                  f"[0, {frame.attrs['stop_step']}) of batch {frame.attrs['batch_size']}, from the closed form")
        _print_frame(frame, args.format)
        return 0
    if args.steps is None:
        raise LakeloaderError("audit needs --steps A:B (or --state STATE.json: the run's steps so far)")
    first, stop = args.steps
    frame = audit(args.config, first, stop)
    if args.format == "table":
        sys.stdout.write(audit_heading(frame))
    _print_frame(frame, args.format)
    if args.plot:
        plot_audit(args.config, first, stop, args.plot)
        print(f"plot -> {args.plot}", file=sys.stderr)
    return 0


def _add_loader_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="YAML config file")
    parser.add_argument("--process-index", type=int, default=0, metavar="p",
                        help="this process's index in [0, P) (default 0)")
    parser.add_argument("--process-count", type=int, default=1, metavar="P",
                        help="number of reading processes; must divide loader.batch_size (default 1)")
    parser.add_argument("--mode", choices=("train", "eval"), default="train",
                        help="train: cycle the data forever; eval: one pass, last batch padded")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``lakeloader`` command."""
    from lakeloader.contracts import VERSION as __version__

    parser = argparse.ArgumentParser(prog="lakeloader", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"lakeloader {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    # -v also after the command; SUPPRESS keeps a -v given before it
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log debug messages")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser = functools.partial(commands.add_parser, parents=[common])  # type: ignore[method-assign]

    build = commands.add_parser(
        "build", help="build or resume the lake of a config",
        description="Plan every dataset, tokenize each split on Dask and commit the chunks to the "
        "catalog. Re-running resumes: committed chunks are never re-tokenized, except those whose "
        "file is missing or of the wrong size, which are rebuilt byte for byte. The Dask dashboard "
        "address is printed at start.")
    build.add_argument("config", metavar="CONFIG", help="YAML config file")
    build.add_argument("--workers", type=int, default=None,
                       help="local Dask worker processes (default: build.workers, else the cores)")
    build.add_argument("--scheduler", default=None, metavar="ADDRESS",
                       help="use an existing Dask cluster: tcp://host:port or a scheduler-file .json")
    build.add_argument("--dashboard-address", default=None, metavar="HOST:PORT",
                       help="where a local cluster's Dask dashboard listens (default: build.dashboard, "
                       "127.0.0.1:0: this host only, any free port); e.g. 0.0.0.0:8787 opens it to the "
                       "network (it has no authentication)")
    build.add_argument("--no-progress", action="store_true", help="no progress bar")
    build.add_argument("--recover-catalog", action="store_true",
                       help="set the lake's catalog aside (e.g. a corrupt catalog.duckdb) and restore it "
                       "from the lake's newest published snapshot; chunks committed after it are rebuilt")
    build.set_defaults(func=_cmd_build)

    formats = FORMATS
    status = commands.add_parser(
        "status", help="per-dataset and per-shard progress",
        description="Show each dataset's chunks, documents, tokens and rejects, each shard's "
        "progress and the recent builds. Works during a build (reads the published snapshot).")
    status.add_argument("target", metavar="CONFIG|LAKE")
    status.add_argument("--format", choices=formats, default="table",
                        help="table (text), json (one object: each table's rows by its name) or csv (one "
                        "table: give --table)")
    status.add_argument("--table", choices=STATUS_TABLES, help="print only this table")
    status.add_argument("--whole-lake", action="store_true", help=WHOLE_LAKE_HELP)
    status.set_defaults(func=_cmd_status)

    sql = commands.add_parser(
        "sql", help="run SQL against the catalog",
        description="Query the lake's DuckDB catalog. Allowed: " + ALLOWED_SQL + " Tables: "
        "chunks, row_groups, rejects, builds, dataset_plans, shard_plans, plan_growth, mixtures, mixture_stages, "
        "mixture_nodes, packing_plans, chunk_examples, chunk_images, media_files, document_index_files, "
        "document_index_chunks, dataset_progress, shard_progress; views: datasets and shards (one row each, with "
        "their progress), committed_prefix, chunk_offsets, packing, documents (one row per document of the committed chunks: dataset, chunk, doc, source, line, "
        "num_tokens, num_parts, tokens_<kind> per part kind, and each metadata field), images (one row per "
        "image occurrence of the committed chunks: dataset, chunk, doc, image, image_id, width, height, "
        "format, mode, num_bytes); "
        "table macros: mixture_plan(id, "
        "first_step, stop_step), mixture_proportions(id, first_step, stop_step) over the steps [first_step, "
        "stop_step), as --steps A:B. A query runs within the config's sql section (memory_limit, "
        "threads, timeout_s; given LAKE, their defaults) and Ctrl-C stops it. Example: lakeloader sql configs/demo.yaml "
        "\"SELECT name, num_docs, num_tokens FROM datasets\"")
    sql.add_argument("target", metavar="CONFIG|LAKE")
    sql.add_argument("query", metavar="QUERY")
    sql.add_argument("--format", choices=formats, default="table")
    sql.add_argument("--state", metavar="STATE.json", help=(
        "with a CONFIG: also offer the table run_segments of the run saved in this loader state (one row "
        "per segment and dataset, and the whole run as segment 'all': weights, shares, examples, tokens, "
        "epochs; as `lakeloader audit CONFIG --state` prints it), to query beside the catalog"))
    sql.set_defaults(func=_cmd_sql)

    stats = commands.add_parser(
        "stats", help="documents, tokens and document lengths per dataset (or metadata value)",
        description="Per dataset (with --by, per dataset and value of FIELD): documents, tokens and "
        "the document-length percentiles p50, p90, p99 and max (in stored tokens, without special "
        "tokens; pXX: the shortest length that XX% of the documents do not exceed), computed in SQL "
        "over the documents view (`lakeloader sql CONFIG \"SELECT ... FROM documents\"` asks anything "
        "else). Reads the committed chunks: works during a build.")
    stats.add_argument("target", metavar="CONFIG|LAKE")
    stats.add_argument("--by", default=None, metavar="FIELD",
                       help="also group by this column of the documents view: a metadata field "
                       "(datasets.<name>.metadata_fields), source, chunk, ...")
    stats.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw a histogram of document lengths into a PNG: one panel per dataset, "
                       "log-scaled length axis, a curve per value with --by (matplotlib)")
    stats.add_argument("--format", choices=formats, default="table")
    stats.add_argument("--whole-lake", action="store_true", help=WHOLE_LAKE_HELP)
    stats.set_defaults(func=_cmd_stats)

    verify = commands.add_parser(
        "verify", help="check every chunk file against the catalog",
        description="Read every committed chunk file and compare its size, sha256 checksum and "
        "document count with the catalog. Lists each problem (missing, size, checksum, "
        "unreadable, rows) and exits with status 1 if there is any. With --repair (needs CONFIG), "
        "rebuilds those chunks byte for byte, verifies again and exits with status 1 only if a "
        "problem remains. (`lakeloader build` itself repairs chunk files that are missing or of the "
        "wrong size; only verify's checksum pass finds a damaged file of the right size.)")
    verify.add_argument("target", metavar="CONFIG|LAKE")
    verify.add_argument("--format", choices=formats, default="table")
    verify.add_argument("--no-progress", action="store_true", help="no progress bar")
    verify.add_argument("--repair", action="store_true",
                        help="rebuild the chunks found damaged (a build of CONFIG), then verify again")
    verify.add_argument("--workers", type=int, default=None,
                        help="--repair: local Dask worker processes (default: build.workers, else the cores)")
    verify.add_argument("--scheduler", default=None, metavar="ADDRESS",
                        help="--repair: use an existing Dask cluster")
    verify.set_defaults(func=_cmd_verify)

    batches = commands.add_parser(
        "batches", help="write global batches [A, B) (this process's rows) to an .npz file",
        description="Materialize batches A..B-1 (--steps A:B is half-open, as everywhere) exactly as a training process would and save one "
        "array per field (input_ids, targets, loss_mask, segment_ids, positions: those loader.fields names; "
        "dataset_ids[, example_mask]) "
        "shaped [B-A, rows_of_this_process, seq_len]. Streams each batch to disk as it is made (memory "
        "of about one batch; the file appears complete or not at all). Works while the lake is still "
        "building: waits only for chunks it needs.")
    _add_loader_options(batches)
    batches.add_argument("--steps", type=_steps, required=True, metavar="A:B",
                         help="steps A..B-1 (half-open [A, B))")
    batches.add_argument("--out", required=True, metavar="FILE.npz", help="output file")
    batches.add_argument("--resume", metavar="STATE.json", help=(
        "a saved loader state (Loader.state as JSON): the batches are those of its run, whose mixture may have "
        "been revised mid-run"))
    batches.add_argument("--continue-changes", action="store_true", help=(
        "with --resume: continue the run under CONFIG although its mixture or datasets changed since the state "
        "was saved, files added to a dataset included (earlier steps keep their batches; each dataset continues "
        "where it stopped)"))
    batches.add_argument("--save-state", metavar="STATE.json", help="write the run's state at step B here")
    batches.add_argument("--no-progress", action="store_true", help="no progress bar")
    batches.set_defaults(func=_cmd_batches)

    audit = commands.add_parser(
        "audit", help="realized vs target mixture proportions over steps [A, B)",
        description="For each dataset of the config's mixture over global steps A..B-1: the target "
        "weight (the stage's; across stages, the example-weighted mean), the realized share of "
        "examples and of non-padding tokens (packing concat: seq_len tokens per example), the "
        "largest |count - weight * n| over the whole-batch prefixes of the range (counted from the "
        "start of each stage; the schedule keeps it below 2) and the dataset's stream indices "
        "[first_index, end_index) that fed the steps. Reads the mixture's plan from the catalog when "
        "a build registered it (SQL: mixture_plan, mixture_proportions), else computes the same "
        "closed form; reads no data.")
    audit.add_argument("config", metavar="CONFIG", help="YAML config file")
    audit.add_argument("--steps", type=_steps, metavar="A:B",
                       help="steps A..B-1 (half-open [A, B), as audit(config, A, B) in Python)")
    audit.add_argument("--state", metavar="STATE.json", help=(
        "audit the run of a saved loader state instead: its steps so far (or [0, B) of --steps), segment by "
        "segment (between the steps its config was revised) and in total, with each dataset's examples, tokens "
        "and epochs (the run_segments table; --format json for other tools)"))
    audit.add_argument("--format", choices=formats, default="table")
    audit.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw realized vs target share over the steps into a PNG (matplotlib)")
    audit.set_defaults(func=_cmd_audit)

    gc = commands.add_parser(
        "gc", help="remove the chunk folders of replaced dataset plans and replaced documents index files",
        description="A dataset whose build settings changed (tokenizer, format, fields or "
        "build.split_size) is rebuilt into a new chunk folder; the old one is never read again. "
        "`lakeloader status` lists such stale folders; this removes them (never the folders of "
        "the plans in force), and the documents index files a compaction replaced or a killed build "
        "left. Refuses while a build holds the catalog, and keeps builds out while "
        "it runs. Readers still using a replaced plan lose its files.")
    gc.add_argument("target", metavar="CONFIG|LAKE")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    gc.add_argument("--format", choices=formats, default="table")
    gc.set_defaults(func=_cmd_gc)

    explain = commands.add_parser(
        "explain", help="where every row of batch S came from",
        description="For every row of batch S (this process's rows): dataset, epoch, example, "
        "segment, shard, chunk, source file and line/row of each document, and token ranges.")
    _add_loader_options(explain)
    explain.add_argument("--step", type=int, required=True, metavar="S")
    explain.add_argument("--format", choices=formats, default="table")
    explain.set_defaults(func=_cmd_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lakeloader`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
    )
    if not args.verbose:
        # Dask logs every worker start and stop at INFO; keep its warnings and errors only.
        os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
        for noisy in ("distributed", "bokeh", "tornado", "asyncio", "fsspec", "botocore", "s3fs",
                      "httpx", "httpx2", "huggingface_hub"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    # The S3 clients' DEBUG records show request headers and signing details (access key id):
    # never shown, even with -v.
    for signer in ("botocore", "aiobotocore", "s3fs", "urllib3"):
        logging.getLogger(signer).setLevel(max(logging.getLogger(signer).level, logging.INFO))
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except BrokenPipeError:
        # The reader of stdout left (`lakeloader status LAKE | head -3`): stop quietly like
        # unix tools do, with the status of a process ended by SIGPIPE (128 + 13).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt as exc:
        # Ctrl-C (a query of sql or stats is interrupted first, a build records itself and says
        # what it kept): one line and the status of a process ended by SIGINT (128 + 2), as unix
        # tools do, never a traceback.
        print(f"lakeloader {args.command}: interrupted" + (f": {exc}" if str(exc) else ""), file=sys.stderr)
        return 130
    except LakeloaderError as exc:
        print(f"lakeloader {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in _WRITE_ERRNOS:
            raise
        # The library's own lake writes name their file and chunk; this is any other (--out, --plot).
        print(f"lakeloader {args.command}: error: {_output_error(exc.filename, exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`tokenmill bench`: one sub-subcommand per benchmark."""
from __future__ import annotations

import argparse

from tokenmill.bench import ablation, compare_hf, latency, multiturn, parts, profile, throughput, variants
from tokenmill.bench.serve import add_serve_bench_parser


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench_command", required=True)
    add_serve_bench_parser(bench)
    for module in (latency, throughput, ablation, compare_hf, multiturn, profile, parts, variants):
        module.add_parser(bench)

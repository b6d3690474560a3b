"""Summarizes Nsight Compute exports of the grouped-GEMM kernels as a markdown page.

Inputs are what ``ncu --import`` writes from a report of ``benchmarks/profile_kernels.py``::

    ncu --import kernels.ncu-rep --page raw --csv > ncu_grouped_gemm_raw.csv
    ncu --import kernels.ncu-rep --page source --csv --print-source sass \\
        --kernel-name grouped_matmul_nvfp4_decode > ncu_grouped_gemm_nvfp4_decode_sass.csv

Usage (no GPU needed)::

    python benchmarks/ncu_summary.py RAW_CSV SASS_CSV [NOTE] > benchmarks/results/ncu_pallas_kernels_h200/ncu_grouped_gemm.md

NOTE, if given, is printed under the title (which code was profiled).
"""

from __future__ import annotations

import collections
import csv
import re
import sys

# (label, raw metric name, scale); None: to microseconds by the unit the export's second row names
# (ncu picks ns, us or ms by the value).
METRICS = (
    ("duration (us)", "gpu__time_duration.sum", None),
    ("registers per thread", "launch__registers_per_thread", 1),
    ("achieved warps per SM", "sm__warps_active.avg.per_cycle_active", 1),
    ("issue slots busy (%)", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    ("eligible warps per scheduler", "smsp__warps_eligible.avg.per_cycle_active", 1),
    ("DRAM throughput (% of peak)", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("tensor pipe (% of peak)", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", 1),
    ("warp instructions issued (M)", "smsp__inst_issued.sum", 1e-6),
    ("shared-load bank conflicts", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum", 1),
)
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def _table(path: str, header_first: str) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(open(path, newline="")))
    start = next(i for i, row in enumerate(rows) if row and row[0] == header_first)
    header = rows[start]
    return header, [row for row in rows[start + 1:] if len(row) == len(header)]


def kernels_section(raw_csv: str) -> list[str]:
    header, rows = _table(raw_csv, "ID")
    units = dict(zip(header, rows[0]))  # the raw page's row under the header: each metric's unit
    col = {name: i for i, name in enumerate(header)}
    rows = [row for row in rows if _number(row[col["gpu__time_duration.sum"]]) is not None]
    names = [row[col["Kernel Name"]] for row in rows]
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, metric, scale in METRICS:
        cells = []
        for row in rows:
            value = _number(row[col[metric]])
            factor = TO_US[units[metric]] if scale is None else scale
            cells.append("" if value is None else f"{value * factor:,.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Cycles a warp spends per issued instruction, by stall reason (top 6 per kernel):", ""]
    for name, row in zip(names, rows):
        stalls = sorted(((_number(row[i]) or 0.0, STALL.match(h).group(1)) for h, i in col.items() if STALL.match(h)),
                        reverse=True)
        lines.append(f"- `{name}`: " + ", ".join(f"{reason} {value:.2f}" for value, reason in stalls[:6]))
    return lines


def sass_section(sass_csv: str, top: int = 12) -> list[str]:
    header, rows = _table(sass_csv, "Address")
    col = {name: i for i, name in enumerate(header)}
    samples = [(_number(row[col["Warp Stall Sampling (All Samples)"]]) or 0.0) for row in rows]
    total = sum(samples) or 1.0
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    by_opcode, executed = collections.Counter(), collections.Counter()
    for row, count in zip(rows, samples):
        source = re.sub(r"^@!?U?P\w+\s+", "", row[col["Source"]].strip())
        opcode = source.split(" ")[0].split(".")[0] or "?"
        by_opcode[opcode] += count
        executed[opcode] += _number(row[col["Instructions Executed"]]) or 0.0
    all_executed = sum(executed.values()) or 1.0
    lines = ["| opcode | share of stall samples | share of executed instructions |", "|---|---:|---:|"]
    for opcode, count in by_opcode.most_common(10):
        lines.append(f"| {opcode} | {count / total:.1%} | {executed[opcode] / all_executed:.1%} |")
    lines += ["", f"Top {top} instructions by stall samples:", "",
              "| share | SASS | main stall reason | executed |", "|---:|---|---|---:|"]
    ranked = sorted(zip(samples, rows), key=lambda pair: -pair[0])[:top]
    for count, row in ranked:
        reason = max(stall_cols, key=lambda h: _number(row[col[h]]) or 0.0)
        lines.append(f"| {count / total:.1%} | `{row[col['Source']].strip()}` | {reason.removeprefix('stall_')} | "
                     f"{row[col['Instructions Executed']]} |")
    lines += ["", "Shared-memory and L2 sector excess by instruction:", "",
              "| SASS | shared wavefronts (ideal) | L2 sectors (excess) |", "|---|---:|---:|"]
    def excess(row):
        return (_number(row[col["L1 Wavefronts Shared Excessive"]]) or 0.0) + (
            _number(row[col["L2 Theoretical Sectors Global Excessive"]]) or 0.0)
    for row in sorted(rows, key=excess, reverse=True)[:6]:
        lines.append(f"| `{row[col['Source']].strip()}` | {row[col['L1 Wavefronts Shared']]} "
                     f"({row[col['L1 Wavefronts Shared Ideal']]}) | {row[col['L2 Theoretical Sectors Global']]} "
                     f"({row[col['L2 Theoretical Sectors Global Excessive']]}) |")
    return lines


def main():
    if len(sys.argv) not in (3, 4):
        raise SystemExit(__doc__)
    raw_csv, sass_csv, *note = sys.argv[1:]
    lines = [
        "# Nsight Compute: grouped-GEMM kernels on one H200",
        "",
        *([f"**{note[0]}**", ""] if note else []),
        "- profiled: `ncu --clock-control none --set full --kernel-name regex:grouped -o kernels "
        "python benchmarks/profile_kernels.py` (one launch per case: Kimi K2 gate_up, 48 experts, uniform routing, "
        "tile-table configurations)",
        f"- exported: `{raw_csv}`, `{sass_csv}` (`ncu --import`, see `benchmarks/ncu_summary.py`)",
        f"- rendered: `python benchmarks/ncu_summary.py {raw_csv} {sass_csv}" + (" NOTE`" if note else "`"),
        "",
        "## Kernels",
        "",
        *kernels_section(raw_csv),
        "",
        "## NVFP4 decode kernel, per SASS instruction",
        "",
        *sass_section(sass_csv),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()

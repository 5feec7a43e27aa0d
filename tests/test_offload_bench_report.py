"""tools/offload/bench.py's report rendered from fabricated probe results (no launch): the
gradient tier's two disk variants each get a row of bytes per link per step, the engine's
swap counters beside zero-estimate's links for the same run; a variant without a disk tier
gets none; and a hand-written part of docs/benchmarks/offload.md below the marker survives
a run."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tools.offload import bench

MIB = 2**20


def args(out: Path) -> argparse.Namespace:
    return argparse.Namespace(
        cap_mib=512, nproc=2, width=256, heads=4, context=64, threads=1, bucket_numel=2**20,
        sub_group_numel=2**19, prefetch_numel=2**22, out=out,
    )  # fmt: skip


def result(variant: str, psi: int, disk: dict[str, int] | None) -> dict[str, Any]:
    rank = {"rss_increase_mib": 80.0, "vm_increase_mib": 150.0, "host_mib": 10.0,
            "disk_mib": 91.0, "step_seconds": [0.5, 0.5], "disk_bytes_last_step": disk}  # fmt: skip
    best = {"parameters": psi, "ranks": [rank, rank]}
    return {"variant": variant, "layers": 12, "first_failing_layers": None, "best": best}


def test_each_disk_variant_has_its_links_beside_the_estimate(tmp_path: Path) -> None:
    psi = 10_000_000
    results = [
        result("ours-3", psi, None),
        result("ours-3-disk", psi, {"read": 91 * MIB, "written": 73 * MIB}),
        result("ours-3-disk-grads-on-device", psi, {"read": 73 * MIB, "written": 55 * MIB}),
    ]
    text = bench.report(args(tmp_path), results)
    rows = [line for line in text.splitlines() if line.startswith("| ours-3")]
    links = [row for row in rows if row.count("|") == 6 and " / " in row.split("|")[3]]
    assert [row.split("|")[1].strip() for row in links] == [
        "ours-3-disk", "ours-3-disk-grads-on-device"
    ]  # fmt: skip
    on_disk, on_device = (bench.estimated_links(args(tmp_path), psi, g) for g in (True, False))
    # The gradients on disk: written every micro-step and read by the step (4 bytes x Ψ/N
    # each way more than with them on the device).
    extra = on_disk["host_to_disk"]["total"] - on_device["host_to_disk"]["total"]
    assert extra == on_disk["disk_to_host"]["total"] - on_device["disk_to_host"]["total"]
    assert extra == 4 * psi / 2
    assert f"| 91 / 73 | {on_disk['disk_to_host']['total'] / MIB:,.0f} / " in links[0]
    assert f"| 73 / 55 | {on_device['disk_to_host']['total'] / MIB:,.0f} / " in links[1]


def test_a_run_keeps_the_hand_written_part(tmp_path: Path) -> None:
    target = tmp_path / "offload.md"
    bench.write_report(target, "first table\n")
    assert target.read_text() == "first table\n"
    target.write_text(f"old table\n\n{bench.KEPT}\n## Measured by hand\n")
    bench.write_report(target, "new table\n")
    assert target.read_text() == f"new table\n\n{bench.KEPT}\n## Measured by hand\n"
    bench.write_report(target, "newer table\n")  # and again, not doubled
    assert target.read_text() == f"newer table\n\n{bench.KEPT}\n## Measured by hand\n"

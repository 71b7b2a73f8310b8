"""The accelerator script's bookkeeping: differences from plain decoding, a deadline that
skips rather than starts work, and runs merged into one report (no model runs here: the
script's measurements are the engine's own, tested elsewhere)."""

import json

from specjax import bench_accelerator as acc


def test_differences_name_rows_and_first_index():
    ref = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    got = [[1, 2, 3, 4], [5, 0, 7], [8, 9, 10]]  # row 1 differs at 1; row 2 runs on past its reference
    assert acc._differences(ref, got) == {"rows": 3, "rows_differing": 2, "first_difference": [1, 2]}
    assert acc._differences(ref, ref)["rows_differing"] == 0


def test_out_of_time_run_skips_every_stage_and_still_reports(tmp_path, capsys):
    acc.main(["--out", str(tmp_path), "--small", "--budget-s", "0"])
    results = json.loads((tmp_path / "accelerator.json").read_text())
    stages = ["rates", "profile", "engine-b1", "exact-bf16", "engine-b8", "exact-f32"]
    assert [k for k in results if k not in ("machine", "stage_s")] == stages
    assert all(results[k] == [{"skipped": "the whole stage"}] for k in stages)
    md = (tmp_path / "accelerator.md").read_text()
    assert "exact-f32 the whole stage (out of time)" in md


def _row(method, batch, differing=0, at=()):
    return {"method": method, "batch": batch, "tokens_per_step": 2.0, "speedup": 1.5,
            "checks": {"greedy rows": {"rows": batch, "rows_differing": differing, "first_difference": list(at)}}}


def test_merge_fills_what_an_earlier_run_skipped(tmp_path):
    machine = {"jax": "x", "backend": "gpu", "devices": ["cuda:0"]}
    first = {"machine": machine, "stage_s": {"rates": 1.0, "exact-bf16": 5.0},
             "rates": {"copy_gb_s": 10.0, "bf16_tflops": 1.0},
             "exact-bf16": [_row("lookup k=7", 1), _row("dflash k=7", 8), {"skipped": "lookup k=7"}]}
    second = {"machine": machine, "stage_s": {"exact-bf16": 7.0},
              "exact-bf16": [_row("lookup k=7", 8, differing=1, at=[8]), _row("dflash k=7", 8, differing=2, at=[3, 5]),
                             {"skipped": "draft k=4"}]}
    merged = acc.merge([first, second])
    assert merged["rates"] == first["rates"]
    assert merged["stage_s"] == {"rates": 1.0, "exact-bf16": 12.0}
    assert merged["exact-bf16"] == [_row("lookup k=7", 1), _row("lookup k=7", 8, differing=1, at=[8]),
                                    _row("dflash k=7", 8, differing=2, at=[3, 5]), {"skipped": "draft k=4"}]
    paths = []
    for i, run in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(run))
    acc.main(["--out", str(tmp_path / "merged"), "--report", *map(str, paths)])
    md = (tmp_path / "merged" / "accelerator.md").read_text()
    assert "| dflash k=7 | 8 | 2 of 8 (at 3, 5) | 2.00 | 1.50x |" in md
    assert "exact-bf16 draft k=4 (out of time)" in md and "exact-bf16 lookup k=7 (out" not in md

"""Every benchmark in benchmarks/ runs its smoke mode (`--smoke`: tiny tables, a few steps, the same code path) and
ends with the JSON line it promises: {"benchmark", "results", "ratios", "figures"}, with the ratio and figure names
its docstring gives. A benchmark nothing runs breaks unnoticed (dlrm_distributed.py did, in every mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU benchmark: needs a CUDA device")
BATTERY_CLASSES = ("clear", "correct", "unclear", "silent", "crash", "hang", "skipped")

# (file, extra arguments, ratio names, figure names) its --smoke run must print; the slowest first (pytest-xdist
# hands them out in this order)
SMOKES = [
    ("dlrm_distributed", [], {"two_rank_vs_one_process"},
     {"one_process_samples_per_s", "table_wise_samples_per_s", "row_wise_samples_per_s",
      "column_wise_samples_per_s", "table_row_wise_samples_per_s", "grid_shard_samples_per_s",
      "data_parallel_samples_per_s", "two_rank_peak_rss_mb"}),
    ("multitask_movielens", [], set(), {"auc_mmoe_minus_single_min", "auc"}),
    ("bad_input_battery", [], set(), {"cases", "threads", "seconds", *BATTERY_CLASSES}),
    ("serving", [], {"table_bytes_int8_vs_fp32", "table_bytes_int4_vs_fp32", "p50_package_vs_eager"},
     {"auc_loss_int8", "auc_loss_int4", "max_abs_diff_package", "recall10_index_vs_eval"}),
    ("strategy_overhead", [], {"trainer_vs_loop"}, {"loop_steps_per_s", "trainer_steps_per_s"}),
    ("dlrm_distributed", ["--pipeline"], {"pipelined_vs_plain"},
     {"plain_samples_per_s", "pipelined_samples_per_s", "overlap_bound_vs_plain", "offload_bound_vs_plain"}),
    ("planner", [], {"dlrm_8x80gb_max_over_mean", "cpu_dlrm_planner_measured_over_fastest",
                     "cpu_dlrm_planner_estimate_over_best_forced_estimate"},
     {"seconds_26_tables_8_ranks", "dlrm_8x80gb_fits", "dlrm_2x24gb_small_ddr_fails_with_explanation"}),
    ("criteo_ingest", [], {"native_vs_pyarrow", "native_vs_datasets", "load_vs_dlrm_cpu_step", "npy_vs_parquet"},
     {"native_rows_per_s", "peak_rss_mb_4gb", "preprocess_rows_per_s", "load_rows_per_s",
      "dlrm_cpu_samples_per_s"}),
    ("checkpoint", [], {"dcp_vs_gathered_peak_rss", "dcp_vs_gathered_save_s", "dcp_vs_gathered_load_s",
                        "dcp_vs_gathered_load_peak_rss"},
     {"gathered_save_s", "gathered_load_s", "dcp_save_s", "dcp_load_s"}),
    ("embedding", [], {"ours_vs_raw_tbe", "ours_vs_plain", "rss_ours_vs_raw_tbe"},
     {"ours_samples_per_s", "raw_tbe_samples_per_s", "plain_samples_per_s"}),
    ("collectives", [], {"a2a_pooled_gloo_over_shm", "all_reduce_pooled_gloo_over_shm",
                         "a2a_tiny_gloo_guard_over_plain", "a2a_tiny_shm_guard_over_plain"},
     {"ranks", "iters", "a2a_pooled_shm_ms"}),
    ("criteo_tables", [], {"parquet_vs_text_native", "parquet_vs_text_python"},
     {"text_native_rows_per_s", "parquet_rows_per_s", "saved_dataset_rows_per_s", "parquet_stream_rows_per_s"}),
    ("ranking_eval", [], {"torchmetrics_over_ours_time", "ours_peak_mem_x10_over_x1",
                          "torchmetrics_peak_mem_x10_over_x1"},
     {"full_ranking_eval_s_ml100k", "ours_peak_above_start_mb_x1", "ours_peak_above_start_mb_x10",
      "max_abs_diff_vs_torchmetrics"}),
    ("jagged_attention", [], {"peak_memory_vs_padded", "time_vs_padded", "softmax_peak_memory_vs_padded",
                              "softmax_time_vs_padded"}, {"sum_l2_over_b_lmax2"}),
    ("sequential_movielens", [], {"hstu_over_sasrec", "sasrec_over_bpr_mf", "hstu_over_bpr_mf"},
     {"ndcg10_sasrec", "ndcg10_hstu", "ndcg10_bpr_mf", "epoch_s_cpu"}),
    ("kjt_forward", [], {"kjt_construct_share_b2048", "kjt_construct_share_b128"},
     {"kjt_construct_us", "ebc_forward_us"}),
    ("predict_writer", [], {"peak_rss_spilled_vs_in_memory", "speed_spilled_vs_in_memory"},
     {"rows", "in_memory_seconds", "spilled_seconds"}),
    ("auc", [], {"torchmetrics_over_ours_time_n20000", "torchmetrics_over_ours_state_n20000"},
     {"abs_diff_ours_vs_torchmetrics_n20000", "confident_logits_ours", "confident_logits_torchmetrics"}),
    ("vbe", [], {"a2a_bytes_expanded_vs_vbe", "vbe_step_vs_expanded"},
     {"vbe_step_ms", "expanded_step_ms", "vbe_a2a_bytes", "expanded_a2a_bytes"}),
    ("metrics", [], {"step_with_metrics_vs_without"}, {"step_ms_without", "step_ms_with", "metric_logs"}),
    ("elastic_resume", [], set(), {"ne_2_to_1", "ne_2_to_2", "abs_ne_diff", "ne_2_to_1_same_rows",
                                   "abs_ne_diff_same_rows", "ne_2_to_1_accumulate2", "abs_ne_diff_accumulate2",
                                   "saved_step", "compared_step"}),
    ("accumulation", [], {"step_k4_vs_k1", "step_k4_vs_plain4"},
     {"max_rel_diff_k4_vs_one_step", "extra_bytes_vs_bound", "step_k1_ms", "step_k4_ms"}),
    ("collective_guard", [], {"gloo_guard_over_plain", "shm_guard_over_plain"},
     {"gloo_guard_added_us_per_call", "shm_guard_added_us_per_call"}),
    ("zch", [], {"collision_rate_modulo_vs_zch", "step_with_zch_vs_without"},
     {"auc_zch_minus_modulo", "rows_fraction"}),
    ("interaction", [], {"fused_vs_composed_dot"},
     {"batch", "features", "threads"}),
    pytest.param("dlrm_gpu", [], {"trainer_vs_loop_cuda"},
                 {"dlrm_samples_s_fp32", "dlrm_samples_s_tf32", "dlrm_samples_s_bf16", "peak_gpu_mb_fp32"},
                 marks=[pytest.mark.gpu, CUDA], id="dlrm_gpu"),
    pytest.param("dlrm_gpu", ["--pipeline"], {"pipelined_vs_plain_cuda", "semi_sync_vs_sparse_dist_cuda"},
                 {"pipelined_samples_s_fp32", "plain_host_samples_s_fp32", "pipelined_semi_sync_samples_s_fp32"},
                 marks=[pytest.mark.gpu, CUDA],
                 id="dlrm_gpu--pipeline"),
    pytest.param("dlrm_gpu", ["--uvm-cache", "0.2", "--prefetch"], {"prefetch_vs_none"},
                 {"uvm_cache_none_samples_s_fp32", "uvm_cache_prefetch_samples_s_fp32", "uvm_cache_load_factor"},
                 marks=[pytest.mark.gpu, CUDA], id="dlrm_gpu--uvm-cache--prefetch"),
    pytest.param("gpu_profile", [], set(), {"host_ms_per_step", "wall_ms_per_step", "gpu_kernel_ms_per_step",
                                            "syncs_per_step"}, marks=[pytest.mark.gpu, CUDA], id="gpu_profile"),
]


def _id(entry) -> str:
    return entry.id if hasattr(entry, "id") else "".join([entry[0], *entry[1]])


def _last_json(name: str, args: list[str], tmp_path: Path) -> dict:
    extra = ["--log", str(tmp_path / "worker.log")] if name == "bad_input_battery" else []
    # this checkout's lightning_rec, whatever the environment installed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    for _ in range(2):  # a rank 0 that found its free port taken by another process in the meantime: once more
        done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke", *args, *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode == 0 or "EADDRINUSE" not in done.stderr + done.stdout:
            break
    assert done.returncode == 0, f"{name} {args}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"{name} printed nothing:\n{done.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize(("name", "args", "ratios", "figures"), SMOKES, ids=[_id(e) for e in SMOKES])
def test_smoke_ends_with_its_json_line(name, args, ratios, figures, tmp_path, request):
    if name == "serving":  # the session's compiled package, not a second compile (a minute or two)
        args = [*args, "--package", str(request.getfixturevalue("ranker_package")[1])]
    out = _last_json(name, args, tmp_path)
    assert {"benchmark", "results", "ratios", "figures"} <= set(out), sorted(out)
    assert out["benchmark"] in (name, f"{name}_cuda"), out["benchmark"]
    assert isinstance(out["results"], list) and out["results"], out["results"]
    assert ratios <= set(out["ratios"]), f"missing ratios {sorted(ratios - set(out['ratios']))}"
    assert figures <= set(out["figures"]), f"missing figures {sorted(figures - set(out['figures']))}"
    if name == "kjt_forward":  # microseconds per batch, per batch size
        for key in ("kjt_construct_us", "ebc_forward_us"):
            assert set(out["figures"][key]) == {"2048", "128"} and all(v > 0 for v in out["figures"][key].values())
    if name == "bad_input_battery":  # every case a clear error or a correct result, as in the full battery
        fig = out["figures"]
        assert fig["cases"] >= 30 and fig["clear"] + fig["correct"] + fig["skipped"] == fig["cases"], out["results"]


def test_every_benchmark_has_a_smoke_test():
    smoked = {(e.values[0] if hasattr(e, "values") else e[0]) for e in SMOKES}
    tools = {"against"}  # runs a benchmark at two commits (tests/test_benchmarks_against.py)
    assert {p.stem for p in BENCHMARKS.glob("*.py")} - tools == smoked

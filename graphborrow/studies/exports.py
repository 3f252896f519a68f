"""The names the notebooks import from ``graphborrow`` itself, and where each is defined.

A notebook imports graphborrow's root names only (``from graphborrow import memory_map, ...``;
``tests/run/test_notebook_code.py``): its device code is ``torch.cuda``, and what it needs of the
library (a study, a plot, a measured table) is one of these. ``graphborrow/__init__.py`` loads
each on first use. A value is ``"module"`` (the same name there) or ``"module:name"``.
"""

__all__ = ["NOTEBOOK_EXPORTS"]

NOTEBOOK_EXPORTS = {
    # the device and the shapes
    "PRESETS": "graphborrow.studies.presets",
    "notebook_setup": "graphborrow.studies.notebook",
    "capture_ladder": "graphborrow.studies.notebook",
    "model_shape": "graphborrow.studies.notebook",
    "borrowable_ladder": "graphborrow.workloads.ladder",
    "save_results": "graphborrow.run.results:save",
    # words and tables
    "prose": "graphborrow.studies.text",
    "size_text": "graphborrow.studies.text",
    "sizes_text": "graphborrow.studies.text",
    "share_text": "graphborrow.studies.text",
    "course_table": "graphborrow.studies.course",
    "markdown_table": "graphborrow.studies.measured",
    # pools and runs
    "summarize_pool": "graphborrow.core.runs:summarize",
    "BumpArena": "graphborrow.core.arena",
    "arena_library": "graphborrow.core.arena:library_path",
    "round_size": "graphborrow.core.sizes",
    "allocation_size": "graphborrow.core.sizes",
    "largest_borrowable": "graphborrow.planning.capacity",
    "fit_policy_pool": "graphborrow.planning.capacity",
    "size_class_table": "graphborrow.planning.capacity",
    "unborrowable_runs": "graphborrow.planning.capacity",
    "BorrowLeakError": "graphborrow.core.errors",
    "PoolBusyError": "graphborrow.core.errors",
    "WrongStreamError": "graphborrow.core.errors",
    "inspect_snapshot": "graphborrow.studies.inspection",
    # the explorer (07): a widget over its own layout-only device
    "Explorer": "graphborrow.studies.explorer",
    "explorer_settings": "graphborrow.studies.explorer:preset_settings",
    "explorer_state": "graphborrow.studies.explorer:fresh_state",
    "format_report": "graphborrow.studies.inspection",
    "read_snapshot": "graphborrow.studies.inspection",
    "prefill_table": "graphborrow.studies.model_pools",
    "order_verdict": "graphborrow.studies.capture_order",
    "deferred_free_lanes": "graphborrow.studies.deferred",
    "early_release_on_sim": "graphborrow.studies.deferred",
    "covered_fraction": "graphborrow.studies.writes",
    "merged_writes": "graphborrow.studies.writes",
    # verification
    "MODES": "graphborrow.eagle.modes",
    "drafted_tree": "graphborrow.studies.sampling",
    "modes_in_borrow": "graphborrow.studies.sampling",
    "acceptance_study": "graphborrow.studies.sampling",
    "verify_inputs": "graphborrow.studies.capacity",
    # why upstream stopped borrowing (notebook 08)
    "library_workspace_hazard": "graphborrow.studies.hazards",
    "escaped_tensor_hazard": "graphborrow.studies.hazards",
    "peak_step_bytes": "graphborrow.studies.hazards",
    "MEASURED_VARIANTS": "graphborrow.studies.mode_costs",
    "mode_costs": "graphborrow.studies.mode_costs",
    "summarize_costs": "graphborrow.studies.mode_costs",
    "plot_mode_costs": "graphborrow.studies.mode_costs",
    # capacity
    "plan_table": "graphborrow.studies.capacity",
    "summarize_fit": "graphborrow.studies.capacity",
    "boundary_cells": "graphborrow.studies.capacity",
    "run_verify_step": "graphborrow.studies.capacity",
    "fit_policy_contrast": "graphborrow.studies.capacity",
    "fit_grid_figure": "graphborrow.studies.capacity",
    "tensor_fits_run": "graphborrow.studies.capacity",
    "vocab_of": "graphborrow.studies.model_pools",
    "example_sweep_results": "graphborrow.studies.shipped",
    "read_csv": "graphborrow.run.sweep",
    # plots (a cell that calls one is tagged "figure": its image must be in the executed notebook)
    "memory_map": "graphborrow.studies.plots",
    "bar_chart": "graphborrow.studies.plots:bar_policy_comparison",
    "capacity_map": "graphborrow.studies.plots",
    "stream_timeline": "graphborrow.studies.plots",
    "largest_borrowable_plot": "graphborrow.studies.plots",
    "sweep_plot": "graphborrow.studies.plots",
    # the whole decode loop (notebook 09)
    "build_loop": "graphborrow.studies.whole_loop",
    "mode_runs": "graphborrow.studies.whole_loop",
    "loop_memory_figure": "graphborrow.studies.whole_loop",
    "agreement_sweep": "graphborrow.studies.whole_loop",
    "agreement_figure": "graphborrow.studies.whole_loop",
    "loop_record": "graphborrow.studies.whole_loop",
    "loop_record_rows": "graphborrow.studies.whole_loop",
    "upstream_choice_rows": "graphborrow.studies.whole_loop",
    # the H200's records
    "load_measured": "graphborrow.studies.measured:load",
    "eagle_headline": "graphborrow.studies.measured",
    "pool_rows": "graphborrow.studies.measured",
    "savings_table": "graphborrow.studies.measured",
    "fused_kernel_table": "graphborrow.studies.measured",
    "fused_kernel_markdown": "graphborrow.studies.measured",
    "fused_summary": "graphborrow.studies.measured",
    "fused_summary_text": "graphborrow.studies.measured",
}

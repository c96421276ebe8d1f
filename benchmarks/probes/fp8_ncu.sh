#!/usr/bin/env bash
# Where the fp8 decode kernels wait (issue 44; dev tool, one device call of about 5 minutes): Nsight Compute on one
# launch each of the fp8-product kernel (cache_compute fp8: `full`, and `no-vt`, its converters writing no V^T) and
# the exact fp8 kernel (`exact`), DeepSeek H16 B128 S8192 (benchmarks/probes/fp8_compute_parts.py's case); per
# variant the warp-state and shared-memory figures, and benchmarks/sass_partitions.py's stall samples partition by
# partition with each busy partition's most stalled instructions.
#   bash benchmarks/probes/fp8_ncu.sh [VARIANTS]   (default "full no-vt exact"; carry [".whl"])
# Back under $OUT: ncu_<variant>.log (the probe's own line and ncu's details), partitions_<variant>.txt.
set -uo pipefail
budget=${H200_BUDGET_S:-330}
source benchmarks/job_steps.sh
ncu=${NCU:-/usr/local/cuda/bin/ncu}
STEP_LINES='(full|no-vt|exact):|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Active Warps|bank_conflicts|wavefronts'
metrics=l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
metrics=$metrics,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
metrics=$metrics,smsp__inst_executed.sum,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active
for variant in ${1:-full no-vt exact}; do
  case $variant in
    exact) kernel='regex:^_mla_decode_gluon_kernel' ;;
    *) kernel='regex:_mla_decode_gluon_fp8_kernel' ;;
  esac
  step "ncu_$variant" 120 "$ncu" --clock-control none --kernel-name "$kernel" --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SchedulerStats --metrics "$metrics" \
    -f -o "/tmp/$variant" python3 benchmarks/probes/fp8_compute_parts.py --variants "$variant"
  [ -f "/tmp/$variant.ncu-rep" ] || continue
  "$ncu" -i "/tmp/$variant.ncu-rep" --page details --print-details all >>"$out/ncu_$variant.log" 2>&1
  "$ncu" -i "/tmp/$variant.ncu-rep" --page source --csv --print-source sass >"/tmp/$variant.csv" 2>&1
  python3 benchmarks/sass_partitions.py "/tmp/$variant.csv" --top 8 --stalled 12 >"$out/partitions_$variant.txt" 2>&1
  head -c 2500 "$out/partitions_$variant.txt"
done

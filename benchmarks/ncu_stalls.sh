#!/usr/bin/env bash
# Where a warp-specialised kernel waits: Nsight Compute on one launch of it, then sass_partitions.py's stall
# samples partition by partition (dev tool; one device call, carry [".whl"]).
#   bash benchmarks/ncu_stalls.sh NAME KERNEL_REGEX COMMAND...
# e.g. the Gluon prefill at a short and a long length (issue 43: what its tensor cores wait on):
#   bash benchmarks/ncu_stalls.sh s1024 _mla_prefill_gluon_kernel \
#     python3 benchmarks/probes/prefill_lengths.py --lengths 1024
# The launch profiled is the command's first launch of a kernel whose name KERNEL_REGEX matches (ncu's
# --kernel-name regex:; a probe's first launch is its checked one). Several jobs in one call: separate them with `;`.
# Back under $OUT: ncu_NAME.log (the command's output and ncu's details: warp states, scheduler, shared memory)
# and partitions_NAME.txt (per partition: instructions, stall samples and reasons, the most stalled instructions).
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: bash benchmarks/ncu_stalls.sh NAME KERNEL_REGEX COMMAND..." >&2; exit 2; }
name=$1 kernel=$2
shift 2
budget=${NCU_BUDGET_S:-300}
source benchmarks/job_steps.sh
ncu=${NCU:-/usr/local/cuda/bin/ncu}
STEP_LINES='Warp Cycles Per Issued|No Eligible|Eligible Warps Per|Stall (Long|Barrier|Short|Wait|GMMA|Math|MIO)|shared_op|Duration|Pipe Tensor|DRAM Throughput'
metrics=l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
metrics=$metrics,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
rm -f "/tmp/ncu_$name.ncu-rep"
"$ncu" --clock-control none --kernel-name "regex:$kernel" --launch-count 1 --section SourceCounters \
  --section WarpStateStats --section SchedulerStats --section SpeedOfLight --metrics "$metrics" \
  -o "/tmp/ncu_$name" "$@" >"$out/ncu_$name.log" 2>&1
echo "ncu $name: exit $?"
[ -f "/tmp/ncu_$name.ncu-rep" ] || { tail -n 5 "$out/ncu_$name.log"; exit 1; }
"$ncu" -i "/tmp/ncu_$name.ncu-rep" --page details --print-details all >>"$out/ncu_$name.log" 2>&1
grep -E "$STEP_LINES" "$out/ncu_$name.log" | cut -c1-160
"$ncu" -i "/tmp/ncu_$name.ncu-rep" --page source --csv --print-source sass >"/tmp/ncu_$name.csv" 2>&1
python3 benchmarks/sass_partitions.py "/tmp/ncu_$name.csv" --top 4 --stalled 8 >"$out/partitions_$name.txt" 2>&1
grep -E '^\| (prologue|try_alloc|dealloc)' "$out/partitions_$name.txt" | cut -c1-260

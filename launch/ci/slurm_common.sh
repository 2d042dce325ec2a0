# Shared by slurm_localhost.sh and slurm_two_nodes.sh (sourced, not run).

# cgroup_proctrack DIR WRITER: how Slurm tracks a job's processes. Where cgroup v1's freezer is
# mounted, proctrack/cgroup (Slurm then kills every process a job left behind, Ray's included),
# with DIR/cgroup.conf written to track and constrain nothing; else proctrack/linuxproc.
cgroup_proctrack() {
    if [[ -d /sys/fs/cgroup/freezer ]]; then
        cat > "$1/cgroup.conf" <<CGROUP
# Written by launch/ci/$2: track job processes, constrain nothing.
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
CGROUP
        echo proctrack/cgroup
    else
        echo proctrack/linuxproc
    fi
}

# scheduling_settings DIR PROCTRACK: the slurm.conf lines both test clusters share (no
# accounting database: finished jobs are read with scontrol, kept MinJobAge seconds).
scheduling_settings() {
    cat <<SLURM
ProctrackType=$2
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=3600
JobCompType=jobcomp/filetxt
JobCompLoc=$1/log/jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# scancel's SIGTERM to SIGKILL: the launcher's cleanup (the driver's teardown, then Ray) fits
# (at 10 s it once did not: tests/test_launch_two_nodes.py's scancel test; Slurm's default is 30)
KillWait=20
SLURM
}

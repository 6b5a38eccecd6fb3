#!/vm/busybox sh
# PID 1 of a `cargo xtask vm` guest (xtask/src/vm.rs builds the initramfs).
#
# Sets up what the tests expect of a host (proc, sys, dev, bpffs, lo),
# loads the modules, then runs the commands of /vm/job.sh, which xtask
# writes: its `load` and `run` lines use the functions below. Every line
# that xtask reads back starts with the run's nonce (set by job.sh), so a
# program's own output can never be taken for a marker.

/vm/busybox mkdir -p /vm/bin
/vm/busybox --install -s /vm/bin
# The host's tools (iproute2's `ip`, `nft`, the copied programs) first:
# busybox's applets only fill in what the host's files do not provide.
# (This shell itself is busybox's, which prefers its applets: the commands
# are started through the host's setsid, and /bin/sh is the host's.)
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/vm/bin
export HOME=/root USER=root LOGNAME=root

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
# /run and /tmp stay on the rootfs (a tmpfs already): a tmpfs mounted
# over them would hide the files copied there.
mount -t bpf bpf /sys/fs/bpf
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
# `ip netns add` bind-mounts under /run/netns; `ip netns exec` remounts /sys.
mkdir -p /run/netns /run/vm
# Defines NONCE, SETSID (the host's setsid), and the functions `modules`
# (its `load` lines) and `commands` (its `run` lines).
. /vm/job.sh

# `load NAME`: insmod a module xtask copied to /vm/ko (xtask orders them,
# dependencies first).
load() {
    out=$(insmod "/vm/ko/$1.ko" 2>&1) || echo "$NONCE warn insmod $1: $out"
}

# `run INDEX SECONDS DIR ARGV...`: runs ARGV in DIR with no input, between
# a start and an end marker. It runs in the foreground: a background job
# of a shell without job control starts with SIGINT and SIGQUIT ignored,
# and so would every process it starts (tests stop daemons with SIGINT).
# It gets a session of its own, so that a timeout kills whatever it
# started too; its pid (= that session) goes to /run/vm/pid.
run() {
    index=$1 seconds=$2 dir=$3
    shift 3
    rm -f /run/vm/timed-out /run/vm/pid
    echo "$NONCE start $index"
    setsid sh -c "sleep $seconds; touch /run/vm/timed-out; kill -KILL -\$(cat /run/vm/pid)" &
    watchdog=$!
    # `exec setsid` keeps the pid: the shell leads no process group, so
    # setsid need not fork. The host's setsid, not busybox's: busybox runs
    # its own applets before anything on PATH (its `ip` for iproute2's).
    sh -c 'echo $$ >/run/vm/pid && cd "$1" && shift && exec "$@"' run "$dir" "$SETSID" "$@" </dev/null
    code=$?
    kill -KILL -"$watchdog" 2>/dev/null
    # What the program left running must not disturb the next one.
    [ -e /run/vm/pid ] && kill -KILL -"$(cat /run/vm/pid)" 2>/dev/null
    if [ -e /run/vm/timed-out ]; then
        echo "$NONCE end $index timeout"
    else
        echo "$NONCE end $index exit $code"
    fi
}

modules
ip link set lo up
echo "$NONCE ready $(uname -r)"
commands
echo "$NONCE done"
poweroff -f
